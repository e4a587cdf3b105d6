"""checkpoint.async_save: periodic checkpoints written on a thread hold exactly what a synchronous
save holds, finish before the run ends, and a failed background write is reported, never hidden."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_loop import make_trainer, weights

from tessera.common.checkpoint import read_pointer, read_sidecar, verify_checksums
from tessera.common.errors import run_cli
from tessera.trainer.cli import main
from tessera.trainer.components.checkpoint import storage
from tessera.trainer.components.checkpoint.storage import list_checkpoints

SAVES = ["training.save_interval=2", "checkpoint.keep_last=3"]  # 6 steps: saves at 2, 4 (background), 6 (final)


def optimizer_state(trainer) -> list[torch.Tensor]:
    return [t for s in trainer.engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


def test_background_checkpoints_equal_synchronous_ones(make_config, tmp_path, capsys):
    assert main(["--config", str(make_config("sync")), "--quiet", *SAVES]) == 0
    assert main(["--config", str(make_config("async")), "--quiet", *SAVES, "checkpoint.async_save=true"]) == 0
    out = capsys.readouterr().out
    assert "saving checkpoint" in out and "in the background (state copied in" in out
    assert out.count("(in the background, ") == 2  # steps 2 and 4 reported when done
    root = tmp_path / "async" / "checkpoints"
    assert list_checkpoints(root) == [2, 4, 6] and read_pointer(root) == 6
    for step in (2, 4):
        sync_dir, async_dir = (tmp_path / run / "checkpoints" / f"iter_{step:07d}" for run in ("sync", "async"))
        verify_checksums(async_dir)
        assert read_sidecar(async_dir).step == step and read_sidecar(async_dir).consumed_samples == 4 * step
        a, b = make_trainer(make_config("a")), make_trainer(make_config("b"))
        a.load(sync_dir)
        b.load(async_dir)
        assert a.state == b.state
        for (name, x), y in zip(weights(a).items(), weights(b).values()):
            torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)
        for x, y in zip(optimizer_state(a), optimizer_state(b), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_a_failed_background_save_is_raised_and_the_pointer_stays(make_config, tmp_path, monkeypatch):
    trainer = make_trainer(make_config(), *SAVES, "checkpoint.async_save=true")
    real = storage.finalize_checkpoint

    def failing_at_step_4(directory, sidecar, *args, **kwargs):
        if sidecar.step == 4:
            raise OSError("disk full (simulated)")
        return real(directory, sidecar, *args, **kwargs)

    monkeypatch.setattr(storage, "finalize_checkpoint", failing_at_step_4)
    with pytest.raises(RuntimeError, match=r"background save of .*iter_0000004 failed: disk full \(simulated\)"):
        trainer.train()
    root = tmp_path / "run" / "checkpoints"
    assert read_pointer(root) == 2 and list_checkpoints(root) == [2]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rank_0_failing_to_finish_fails_every_rank_alike(artifacts, tmp_path, mode):
    """Rank 0 writes tokenizer, sidecar and pointer: when that fails, the other ranks learn it at
    once and raise the same error (they used to wait in a barrier until gloo's timeout)."""
    worker = Path(__file__).with_name("finalize_failure_worker.py")
    proc = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2",
                           str(worker), str(tmp_path / "ckpt"), str(artifacts["tokenizer"]), mode],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    assert "disk full (simulated)" in lines[0]
    assert "rank 0 could not finish iter_0000001: OSError: disk full (simulated)" in lines[1]
    assert read_pointer(tmp_path / "ckpt") is None


def test_divergence_during_a_background_save_names_the_checkpoint_it_lands(make_config, tmp_path, monkeypatch, capsys):
    """The one-line error says which checkpoint to resume from: the background save of step 1 (slowed
    down here) must have landed before the message is written."""
    real = storage.finalize_checkpoint

    def slow(directory, sidecar, *args, **kwargs):
        time.sleep(1.0)
        return real(directory, sidecar, *args, **kwargs)

    monkeypatch.setattr(storage, "finalize_checkpoint", slow)
    path = make_config()
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--config", str(path), "--quiet", "checkpoint.async_save=true", "training.save_interval=1",
                       "optim.lr=1e30", "optim.min_lr=0", "schedule.warmup_steps=0"])
    assert exc.value.code == 1
    assert "the newest checkpoint is" in capsys.readouterr().err and read_pointer(tmp_path / "run" / "checkpoints") == 1


def test_a_stop_agreed_because_of_another_rank_exits_cleanly(make_config, tmp_path, monkeypatch, capsys):
    """Under torchrun a signal may reach only some ranks; the others stop at the same step with a
    clean save and a reason that says so."""
    trainer = make_trainer(make_config())
    monkeypatch.setattr(trainer, "_agree_on_stop", lambda local: trainer.state.step == 2)
    trainer.train()
    assert trainer.state.step == 2 and read_pointer(tmp_path / "run" / "checkpoints") == 2
    assert "another rank was asked to stop: saved at step 2, exiting" in capsys.readouterr().out
