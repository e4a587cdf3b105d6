"""checkpoint.async_save: periodic checkpoints written on a thread hold exactly what a synchronous
save holds, finish before the run ends, and a failed background write is reported, never hidden."""

from __future__ import annotations

import pytest
import torch
from test_loop import make_trainer, weights

from tessera.common.checkpoint import read_pointer, read_sidecar, verify_checksums
from tessera.trainer import checkpointing
from tessera.trainer.checkpointing import list_checkpoints
from tessera.trainer.cli import main

SAVES = ["training.save_interval=2", "checkpoint.keep_last=3"]  # 6 steps: saves at 2, 4 (background), 6 (final)


def optimizer_state(trainer) -> list[torch.Tensor]:
    return [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


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
    real = checkpointing.finalize_checkpoint

    def failing_at_step_4(directory, sidecar, *args, **kwargs):
        if sidecar.step == 4:
            raise OSError("disk full (simulated)")
        return real(directory, sidecar, *args, **kwargs)

    monkeypatch.setattr(checkpointing, "finalize_checkpoint", failing_at_step_4)
    with pytest.raises(RuntimeError, match=r"background save of .*iter_0000004 failed: disk full \(simulated\)"):
        trainer.train()
    root = tmp_path / "run" / "checkpoints"
    assert read_pointer(root) == 2 and list_checkpoints(root) == [2]
