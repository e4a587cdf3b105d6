"""The installed console script: help, usage errors (one line, exit 2) and a real conversion."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from ckpt_helpers import make_checkpoint, tiny_llama

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
def test_console_script_error_and_success(tmp_path, tokenizer_dir):
    """The installed script maps a user error to one line + exit 2 and succeeds on good input
    (the other error cases run in-process in the other test files)."""
    make_checkpoint(tmp_path / "ck", tiny_llama(), tokenizer_dir)
    bad = cli("export", "--format", "hf", "--checkpoint", str(tmp_path / "missing"), "--output", str(tmp_path / "o"))
    assert bad.returncode == 2 and "not found" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    assert not (tmp_path / "o").exists()
    ok = cli("export", "--format", "hf", "--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "hf"),
             "--quiet")
    assert ok.returncode == 0 and ok.stdout.strip().endswith("hf") and (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.parametrize("argv, message", [
    (["export", "--format", "onnx", "--checkpoint", "x", "--output", "y"], "invalid choice"),
    (["export", "--format", "hf", "--checkpoint", "CK", "--output", "y", "--max-shard-size", "lots"], "--max-shard-size"),
    (["export", "--format", "hf", "--checkpoint", "CK", "--output", "CK"], "already exists"),
    (["export", "--format", "hf", "--checkpoint", "CK", "--output", "y", "--tensor-parallel", "2"], "trtllm only"),
    (["reshard", "--checkpoint", "CK", "--output", "y"], "required"),
])
def test_usage_errors_in_process(tmp_path, tokenizer_dir, capsys, argv, message):
    from tessera.ckpt_convert.cli import main

    make_checkpoint(tmp_path / "ck", tiny_llama(num_layers=1), tokenizer_dir)
    argv = [str(tmp_path / "ck") if a == "CK" else str(tmp_path / a) if a in ("x", "y") else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "y").exists()


def _tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("argv", [
    ["export", "--format", "hf", "--checkpoint", "CK", "--output", "CK"],
    ["export", "--format", "trtllm", "--checkpoint", "CK", "--output", "CK"],
    ["export", "--format", "megatron", "--checkpoint", "CK/iter_0000010", "--output", "ROOT"],
    ["reshard", "--checkpoint", "CK", "--output", "CK", "--tensor-parallel", "1", "--pipeline-parallel", "1"],
    ["import", "--format", "hf", "--input", "HF", "--output", "HF"],
], ids=["export-hf-into-its-run", "export-trtllm-into-its-run", "export-megatron-above-its-run", "reshard-into-itself",
        "import-into-itself"])
def test_an_output_that_holds_the_input_is_refused_even_with_overwrite_and_the_input_is_kept(
        tmp_path, tokenizer_dir, capsys, argv):
    """--overwrite used to replace the run (every iteration) or the HF directory it read by the
    conversion's output; the one line now names the input the output would delete."""
    from ckpt_helpers import refused

    from tessera.ckpt_convert.cli import run

    root = tmp_path / "root"
    make_checkpoint(root / "ck", tiny_llama(num_layers=1), tokenizer_dir)
    run(["export", "--format", "hf", "--checkpoint", str(root / "ck"), "--output", str(root / "hf"), "--quiet"])
    before = _tree(root)
    names = {"CK": root / "ck", "HF": root / "hf", "ROOT": root}
    argv = [str(names[a.split("/")[0]].joinpath(*a.split("/")[1:])) if a.split("/")[0] in names else a for a in argv]
    err = refused(capsys, [*argv, "--overwrite", "--quiet"])
    assert "holds the input" in err and "--output" in err, err
    assert _tree(root) == before


def test_reshard_to_more_ranks_than_the_soft_open_file_limit_raises_it_and_past_the_hard_limit_is_refused(
        tmp_path, tokenizer_dir, capsys, monkeypatch):
    """reshard keeps one file per target rank open: under `ulimit -Sn 256`, --data-parallel 400 died
    with EMFILE's traceback (and 10^8 did at any limit); now the soft limit is raised to what is
    needed, and a layout past the hard limit is one line."""
    import resource

    from ckpt_helpers import refused

    from tessera.ckpt_convert.cli import run

    make_checkpoint(tmp_path / "ck", tiny_llama(num_layers=1), tokenizer_dir)
    argv = ["reshard", "--checkpoint", str(tmp_path / "ck"), "--tensor-parallel", "1", "--pipeline-parallel", "1",
            "--quiet"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 600:
        pytest.skip(f"hard open-file limit {hard} leaves no room for 400 rank files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        assert run([*argv, "--data-parallel", "400", "--output", str(tmp_path / "dp400")]) == 0
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(list((tmp_path / "dp400").glob("iter_*/__*_0.distcp"))) == 400

    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 300))  # a hard limit of 300 files
    err = refused(capsys, [*argv, "--data-parallel", "400", "--output", str(tmp_path / "over")])
    assert "the target layout has 400 ranks" in err and "more than the 300 files this process may open" in err, err
    assert not (tmp_path / "over").exists() and not list(tmp_path.glob(".over.tmp-*"))
