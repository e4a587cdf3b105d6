"""A full disk is one line and exit 1 in every stage, and nothing half-written gets a final name.

A real full file system: a 64 KiB tmpfs mounted for the test (skipped where mounting is not
permitted). Before, each stage ended in an OSError traceback.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from conftest import base_config

from tessera.ckpt_convert.cli import main as ckpt_main
from tessera.common.errors import run_cli, storage_exhausted
from tessera.data_prep.cli import entry as data_entry
from tessera.trainer.cli import main as train_main

pytestmark = pytest.mark.slow


@pytest.fixture
def full_disk(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _one_line_exit_1(command, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        command()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 1, err[-2000:]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "No space left on device" in lines[0], lines[0]
    return lines[0]


def test_prep_on_a_full_disk_is_one_line_and_publishes_nothing(full_disk, artifacts, tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"word{i} " * 60}) + "\n" for i in range(3000)))
    line = _one_line_exit_1(lambda: run_cli(data_entry, [
        "prep", "--input", str(corpus), "--tokenizer", str(artifacts["tokenizer"]),
        "--output-prefix", str(full_disk / "x"), "--quiet"]), capsys)
    assert str(full_disk) in line
    assert not list(full_disk.glob("x*"))


def test_training_on_a_full_disk_is_one_line_and_leaves_no_final_checkpoint(full_disk, artifacts, capsys):
    cfg = base_config(artifacts, full_disk / "run")
    cfg["training"]["steps"] = 2
    config = full_disk.parent / "train.yaml"
    config.write_text(yaml.safe_dump(cfg))
    _one_line_exit_1(lambda: run_cli(train_main, ["--config", str(config), "--quiet"]), capsys)
    for directory in (full_disk / "run").glob("checkpoints/iter_*"):
        assert not directory.name.startswith("iter_") or not (directory / "tessera_checkpoint.json").exists()
    assert not (full_disk / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").exists()


def test_export_on_a_full_disk_is_one_line_and_leaves_no_export(full_disk, artifacts, tmp_path, capsys):
    cfg = base_config(artifacts, tmp_path / "run")
    cfg["training"]["steps"] = 1
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert train_main(["--config", str(config), "--quiet"]) == 0
    out = full_disk / "hf"
    _one_line_exit_1(lambda: ckpt_main(["export", "--format", "hf", "--checkpoint", str(tmp_path / "run"),
                                        "--output", str(out), "--quiet"]), capsys)
    assert not out.exists()


def test_a_full_disk_is_recognised_inside_dcp_and_chained_errors():
    class CheckpointException(BaseException):  # the shape of DCP's: per-rank (exception, traceback) pairs
        def __init__(self, failures):
            self.failures = failures

    full = OSError(28, "No space left on device")
    assert storage_exhausted(CheckpointException({0: (full, None)})) is full
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("save failed") from exc
    except RuntimeError as chained:
        assert storage_exhausted(chained) is full
    assert storage_exhausted(OSError(2, "No such file")) is None
    assert storage_exhausted(ValueError("x")) is None


def test_a_ctrl_c_inside_a_dcp_save_is_interrupted_exit_130(capsys):
    class CheckpointException(BaseException):  # DCP wraps the KeyboardInterrupt raised in its writer
        def __init__(self, failures):
            self.failures = failures

    def main(argv):
        raise CheckpointException({0: (KeyboardInterrupt(), None)})

    with pytest.raises(SystemExit) as exc:
        run_cli(main, [])
    assert exc.value.code == 130
    assert capsys.readouterr().err.strip().endswith(": interrupted")
