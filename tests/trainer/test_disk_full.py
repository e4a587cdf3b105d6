"""A full disk is one line naming the file and exit 1 in every stage, and nothing half-written gets
a final name.

Two full disks: a real one, a 64 KiB tmpfs mounted for the test (skipped where mounting is not
permitted), and one needing no privileges: every file opened for writing under the test's folder
writes to /dev/full, so each write fails with ENOSPC where the kernel's would, carrying no file
name, inside whatever library made it (DCP's writer threads included). Before, each stage ended in
an OSError traceback; then training and export said "writing output" instead of the file.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import base_config, train_two_steps

from tessera.ckpt_convert.cli import main as ckpt_main
from tessera.common.errors import run_cli, storage_exhausted
from tessera.data_prep.cli import entry as data_entry
from tessera.trainer.cli import main as train_main

pytestmark = pytest.mark.slow


@pytest.fixture(params=["tmpfs", "dev-full"])
def full_disk(request, tmp_path, monkeypatch):
    mount = tmp_path / "tiny"
    mount.mkdir()
    if request.param == "dev-full":
        if not os.path.exists("/dev/full"):
            pytest.skip("no /dev/full here")
        _writes_go_to_dev_full(mount, monkeypatch)
        yield mount
        return
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=False)  # a file left open: detach it anyway


def _writes_go_to_dev_full(directory: Path, monkeypatch) -> None:
    """Files opened for writing under `directory` are created there, but their descriptor is
    /dev/full's: every write() fails with ENOSPC and no file name, as on a full disk."""
    real_open = io.open

    def open_on_a_full_disk(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if not isinstance(file, int) and set(mode) & set("wax") and Path(file).resolve().is_relative_to(directory):
            full = os.open("/dev/full", os.O_WRONLY)
            os.dup2(full, f.fileno())
            os.close(full)
        return f

    monkeypatch.setattr(io, "open", open_on_a_full_disk)  # what pathlib and DCP call
    monkeypatch.setattr(builtins, "open", open_on_a_full_disk)
    real_fsync = os.fsync

    def fsync(fd):  # /dev/full cannot be fsynced (EINVAL); a full disk's fsync fails as its writes did
        try:
            real_fsync(fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None
    monkeypatch.setattr(os, "fsync", fsync)


def _one_line_exit_1(command, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        command()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 1, err[-2000:]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "No space left on device" in lines[0] and "writing output" not in lines[0], lines[0]
    return lines[0]


def test_prep_on_a_full_disk_is_one_line_and_publishes_nothing(full_disk, artifacts, tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"word{i} " * 60}) + "\n" for i in range(3000)))
    line = _one_line_exit_1(lambda: run_cli(data_entry, [
        "prep", "--input", str(corpus), "--tokenizer", str(artifacts["tokenizer"]),
        "--output-prefix", str(full_disk / "x"), "--quiet"]), capsys)
    assert str(full_disk) in line
    assert not list(full_disk.glob("x*"))


@pytest.mark.parametrize("save", ["synchronous", "background"])
def test_training_on_a_full_disk_is_one_line_and_leaves_no_final_checkpoint(full_disk, artifacts, capsys,
                                                                             monkeypatch, save):
    cfg = base_config(artifacts, full_disk / "run")
    cfg["training"].update(steps=2, save_interval=1)
    cfg["checkpoint"] = {"async_save": save == "background"}
    config = full_disk.parent / "train.yaml"
    config.write_text(yaml.safe_dump(cfg))
    if not os.path.ismount(full_disk):  # /dev/full for the checkpoints only: the failing write is DCP's
        monkeypatch.undo()
        _writes_go_to_dev_full(full_disk / "run" / "checkpoints", monkeypatch)
    line = _one_line_exit_1(lambda: run_cli(train_main, ["--config", str(config), "--quiet"]), capsys)
    assert f"{full_disk / 'run'}/" in line  # the file or the checkpoint directory being written
    if not os.path.ismount(full_disk):
        assert f"{full_disk / 'run' / 'checkpoints' / '.iter_0000001.partial'}:" in line, line
    for directory in (full_disk / "run").glob("checkpoints/iter_*"):
        assert not directory.name.startswith("iter_") or not (directory / "tessera_checkpoint.json").exists()
    assert not (full_disk / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").exists()


def test_export_on_a_full_disk_is_one_line_and_leaves_no_export(full_disk, artifacts, tmp_path, capsys):
    train_two_steps(artifacts, tmp_path)
    out = full_disk / "hf"
    line = _one_line_exit_1(lambda: ckpt_main(["export", "--format", "hf", "--checkpoint", str(tmp_path / "run"),
                                               "--output", str(out), "--quiet"]), capsys)
    assert f"{out}/" in line  # the file, under the name it would have had
    assert not out.exists()


@pytest.mark.parametrize("verb", ["blend", "merge"])
def test_blend_and_merge_on_a_full_disk_are_one_line_naming_the_output(full_disk, artifacts, capsys, verb):
    shard = str(artifacts["shard"])
    argv = (["blend", "--data", shard, "--seq-length", "32", "--train-samples", "1800", "--output",
             str(full_disk / "out"), "--quiet"] if verb == "blend" else
            ["merge", "--inputs", shard, shard, "--output-prefix", str(full_disk / "out"), "--quiet"])
    line = _one_line_exit_1(lambda: run_cli(data_entry, argv), capsys)
    assert f"{full_disk / 'out'}" in line  # the mixture's file (or folder), the merged shard's file
    assert not list(full_disk.glob("out*"))


def test_reshard_on_a_full_disk_is_one_line_naming_the_file(full_disk, artifacts, tmp_path, capsys):
    train_two_steps(artifacts, tmp_path)
    out = full_disk / "resharded"
    line = _one_line_exit_1(lambda: ckpt_main(["reshard", "--checkpoint", str(tmp_path / "run"), "--output", str(out),
                                               "--tensor-parallel", "2", "--pipeline-parallel", "1", "--quiet"]), capsys)
    assert f"{out}" in line  # its file, or the output folder when the failing write is not one of ours
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
