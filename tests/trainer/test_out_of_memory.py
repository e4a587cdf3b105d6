"""Running out of memory in training is one line that says what to change, exit 1, no traceback,
the last checkpoint intact (tessera.trainer.components.observability.out_of_memory).

Injected in the component that would really run out (tests/trainer/oom_injection.py), from step 2
on: step 1 is saved (save_interval=1), so the line must name it as the checkpoint to resume from
and a save cut short by the error must leave the pointer on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from oom_injection import inject, raise_device, raise_host

from tessera.common.checkpoint import read_pointer
from tessera.common.errors import run_cli
from tessera.trainer.cli import main

ACTIVATIONS = ["training.micro_batch_size=1 (now 2;", "training.recompute=selective (now none)",
               "training.loss_chunk_tokens=4096", "a shorter training.seq_length (now 32)",
               "training.precision=bf16 (now fp32)"]
PARALLEL = "more tensor or pipeline parallel (--tensor-parallel, --pipeline-parallel; now 1 and 1)"


def one_line_exit_1(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_cli(main, argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 1, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("phase, error, what", [
    ("forward", raise_device, "out of device memory: tried to allocate 1.50 GiB, 512.00 MiB free of 79.11 GiB"),
    ("backward", raise_host, "out of host memory: tried to allocate 65536.00 GiB,"),
    ("optimizer step", raise_device, "out of device memory: tried to allocate 1.50 GiB"),
])
def test_a_step_out_of_memory_names_the_phase_the_levers_and_the_checkpoint(make_config, tmp_path, capsys,
                                                                            monkeypatch, phase, error, what):
    inject(monkeypatch.setattr, phase, error)
    err = one_line_exit_1(capsys, ["--config", str(make_config()), "--quiet", "training.save_interval=1"])
    assert f"step 2 ({phase}) on cpu: {what}" in err, err
    assert "layout tp1-cp1-ep1-dp1-pp1, micro-batch 2 x 32 tokens, precision fp32, recompute none" in err, err
    assert PARALLEL in err, err
    for lever in ACTIVATIONS:  # an optimizer step's memory is its state: activation settings do not apply
        assert (lever in err) == (phase != "optimizer step"), (lever, err)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert f"the newest checkpoint is {checkpoints / 'iter_0000001'} (then --resume)" in err, err
    assert read_pointer(checkpoints) == 1


def test_a_save_cut_short_leaves_the_previous_checkpoint_newest_and_the_run_resumes(make_config, tmp_path, capsys,
                                                                                    monkeypatch):
    path = make_config()
    with monkeypatch.context() as patched:
        inject(patched.setattr, "checkpoint save")
        err = one_line_exit_1(capsys, ["--config", str(path), "--quiet", "training.save_interval=1"])
    assert "step 2 (checkpoint save) on cpu: out of device memory" in err, err
    assert "training.micro_batch_size" not in err and PARALLEL in err, err
    checkpoints = tmp_path / "run" / "checkpoints"
    assert read_pointer(checkpoints) == 1 and not (checkpoints / "iter_0000002").exists()
    assert main(["--config", str(path), "--quiet", "--resume", "training.steps=3"]) == 0
    assert read_pointer(checkpoints) == 3


def test_out_of_memory_while_building_the_model_is_one_line_too(make_config, capsys, monkeypatch):
    inject(monkeypatch.setattr, "setting up the model")
    err = one_line_exit_1(capsys, ["--config", str(make_config()), "--quiet"])
    assert "step 0 (setting up the model) on cpu: out of device memory" in err and "no checkpoint was saved yet" in err, err


def test_the_first_compiled_step_says_it_was_compiling(make_config, capsys, monkeypatch):
    """training.compile's first step compiles as it runs (torch.compile's own frames are in every
    compiled step, so the loop tells it); compilation itself is stood in for here (eager)."""
    import torch

    monkeypatch.setattr(torch, "compile", lambda fn=None, *args, **kwargs: fn if fn is not None else (lambda f: f))
    inject(monkeypatch.setattr, "forward", from_step=1)
    err = one_line_exit_1(capsys, ["--config", str(make_config()), "--quiet", "training.compile=true"])
    assert "step 1 (forward, the first step, compiling) on cpu: out of device memory" in err, err


@pytest.mark.parametrize("hook", ["after_step", "before_step"])
def test_out_of_memory_in_a_hook_between_steps_names_the_step_it_belongs_to(make_config, capsys, monkeypatch, hook):
    """The profiler's hooks run after step 2 completed (a trace export, in host memory) and before
    step 2 starts (the profiler's buffers): neither is step 3, which never started, nor step 1's
    checkpoint save, which completed."""
    from tessera.trainer.components.observability.profiling import StepProfiler

    real = getattr(StepProfiler, hook)

    def failing(self, step):
        if step >= 2:
            raise MemoryError()
        return real(self, step)

    monkeypatch.setattr(StepProfiler, hook, failing)
    err = one_line_exit_1(capsys, ["--config", str(make_config()), "--quiet", "training.save_interval=1"])
    assert "step 2 (" in err and "step 3" not in err and "checkpoint save" not in err, err
    if hook == "after_step":
        assert "step 2 (after the step) on cpu: out of host memory" in err, err
        assert "training.micro_batch_size" not in err and "async_save" not in err, err


def test_another_error_still_raises_as_it_is(make_config, monkeypatch):
    from tessera.common.layers.mlp import MLP

    def broken(self, x):
        raise RuntimeError("a bug, not memory")

    monkeypatch.setattr(MLP, "forward", broken)
    with pytest.raises(RuntimeError, match="a bug, not memory"):
        main(["--config", str(make_config()), "--quiet"])


@pytest.mark.slow
@pytest.mark.distributed
def test_under_torchrun_rank_0_prints_the_line_and_the_other_rank_at_most_a_short_one(make_config, tmp_path):
    worker = Path(__file__).with_name("oom_injection.py")
    config = make_config()
    proc = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2",
                           str(worker), "forward", "--", "--config", str(config), "--quiet", "training.save_interval=1"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=tmp_path)
    assert proc.returncode != 0 and "exitcode: 1" in proc.stderr, proc.stderr[-3000:]
    assert "/tessera/" not in proc.stderr, proc.stderr[-3000:]  # no worker traceback (torchrun prints its own report)
    full = [line for line in proc.stderr.splitlines() if "To fit, change:" in line]
    assert len(full) == 1 and "step 2 (forward) on cpu: out of device memory" in full[0], proc.stderr[-3000:]
    assert "dp2" in full[0] and "parallel.data_shard=2" not in full[0], full[0]  # forward: activation levers
    short = [line for line in proc.stderr.splitlines() if "rank 1: step 2 (forward)" in line]
    assert len(short) <= 1 and all("rank 0's line" in line for line in short), proc.stderr[-3000:]
    assert read_pointer(tmp_path / "run" / "checkpoints") == 1


def test_the_micro_batch_it_suggests_divides_the_global_batch(make_config, capsys, monkeypatch):
    """micro-batch 5 of a global batch of 5: half of it (2) would be refused by the next run
    (the global batch must be a multiple of it); its largest proper divisor, 1, is not."""
    inject(monkeypatch.setattr, "forward", from_step=1)
    err = one_line_exit_1(capsys, ["--config", str(make_config()), "--quiet", "training.micro_batch_size=5",
                                   "training.global_batch_size=5"])
    assert "training.micro_batch_size=1 (now 5;" in err, err
