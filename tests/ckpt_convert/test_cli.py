"""The installed console script: help, usage errors (one line, exit 2) and a real conversion."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import make_checkpoint, tiny_llama

EXE = shutil.which("tessera-ckpt") or str(__import__("pathlib").Path(sys.executable).parent / "tessera-ckpt")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_verb_and_flag():
    top = cli("--help")
    assert top.returncode == 0
    for verb in ("reshard", "export", "import", "verify", "info"):
        assert verb in top.stdout
    export = cli("export", "--help").stdout
    for flag in ("--format", "--checkpoint", "--output", "--dtype", "--max-shard-size", "--tensor-parallel",
                 "--pipeline-parallel", "--overwrite", "--quiet"):
        assert flag in export


@pytest.mark.slow
def test_usage_errors_are_one_line_exit_2(tmp_path, tokenizer_dir):
    make_checkpoint(tmp_path / "ck", tiny_llama(), tokenizer_dir)
    cases = [
        (["export", "--format", "onnx", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "o")], "invalid choice"),
        (["export", "--format", "hf", "--checkpoint", str(tmp_path / "missing"), "--output", str(tmp_path / "o")], "not found"),
        (["export", "--format", "hf", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "o"),
          "--max-shard-size", "lots"], "--max-shard-size"),
        (["export", "--format", "hf", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "ck")],
         "already exists"),
    ]
    for argv, message in cases:
        proc = cli(*argv)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()
    ok = cli("export", "--format", "hf", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "hf"))
    assert ok.returncode == 0 and ok.stdout.strip().endswith("hf") and (tmp_path / "hf" / "config.json").is_file()
