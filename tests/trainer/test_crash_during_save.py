"""SIGKILL at every step of a checkpoint save, synchronous and in the background: no directory
ever carries a final name before its sidecar is durable, and resuming yields the uninterrupted
run's weights, bit for bit.

Each mode is one chain of runs: every link resumes from the newest complete checkpoint and is
killed (TESSERA_FAULT, tessera.common.faults) at the next point of the save sequence; after each
kill the checkpoints directory is checked; the last link runs to the end. Plus kills at random
moments (mid-payload writes included) by a timer from outside.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import base_config

from tessera.common.checkpoint import POINTER, SIDECAR, iter_dir_name, load_model_tensors, read_pointer

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
STEPS = 12

SYNC_POINTS = ["save.partial_created", "save.payload_written", "save.tokenizer_written", "save.sidecar_written",
               "save.renamed", "save.pointer_written", "save.pruned"]
ASYNC_POINTS = ["save.state_staged", *SYNC_POINTS]


def _config(artifacts, root: Path, background: bool) -> Path:
    cfg = base_config(artifacts, root / "run")
    cfg["training"].update(steps=STEPS, save_interval=1)
    cfg["checkpoint"] = {"keep_last": 2, "async_save": background}
    path = root / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config: Path, fault: str | None = None, resume: bool = True, kill_after: float | None = None):
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_FAULT"}
    if fault:
        env["TESSERA_FAULT"] = fault
    cmd = [str(BIN / "tessera-train"), "--config", str(config), "--quiet", *(["--resume"] if resume else [])]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if kill_after is not None:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, err


def _check_no_final_name_is_incomplete(root: Path) -> None:
    checkpoints = root / "run" / "checkpoints"
    if not checkpoints.is_dir():
        return
    for d in checkpoints.iterdir():
        if d.name.startswith("iter_"):
            assert (d / SIDECAR).is_file(), f"{d.name} carries a final name without its sidecar: {os.listdir(d)}"
    step = read_pointer(checkpoints)
    if step is not None:
        assert (checkpoints / iter_dir_name(step) / SIDECAR).is_file(), f"{POINTER} names an incomplete {step}"


def _final_weights(root: Path) -> dict[str, torch.Tensor]:
    checkpoints = root / "run" / "checkpoints"
    assert read_pointer(checkpoints) == STEPS
    return load_model_tensors(checkpoints / iter_dir_name(STEPS))


@pytest.fixture(scope="module")
def uninterrupted(artifacts, tmp_path_factory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("reference")
    code, err = _train(_config(artifacts, root, background=False), resume=False)
    assert code == 0, err[-2000:]
    return _final_weights(root)


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_sigkill_at_every_point_of_a_save_then_resume_is_bit_exact(background, artifacts, uninterrupted, tmp_path):
    config = _config(artifacts, tmp_path, background)
    points = ASYNC_POINTS if background else SYNC_POINTS
    killed = []
    for point in points:
        code, err = _train(config, fault=f"{point}@1")  # this link's first save: at most one step of progress per link
        assert code == -signal.SIGKILL, f"{point}: not reached (exit {code}): {err[-1500:]}"
        killed.append(point)
        _check_no_final_name_is_incomplete(tmp_path)
    rng = random.Random(0)
    for _ in range(3):  # kills at arbitrary moments: mid-write, mid-step, during start-up
        _train(config, kill_after=rng.uniform(2.0, 6.0))
        _check_no_final_name_is_incomplete(tmp_path)
    code, err = _train(config)
    assert code == 0, err[-2000:]
    resumed = _final_weights(tmp_path)
    assert resumed.keys() == uninterrupted.keys()
    for name in uninterrupted:
        assert torch.equal(resumed[name], uninterrupted[name]), name
    assert len(killed) == len(points)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in metrics if r.get("kind") == "train") == STEPS
