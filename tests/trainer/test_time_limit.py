"""training.exit_after_minutes: stop at the first step past the limit, save, exit 0; resume goes on exactly."""

from __future__ import annotations

import torch
from test_loop import make_trainer, weights

from tessera.trainer.cli import main
from tessera.trainer.components.checkpoint.storage import latest_checkpoint


def test_time_limit_saves_exits_0_and_resume_matches_an_uninterrupted_run(make_config, tmp_path, capsys):
    path = make_config("limited")
    # Any step takes longer than 1e-6 minutes: the run stops after step 1.
    assert main(["--config", str(path), "--quiet", "training.exit_after_minutes=1e-6"]) == 0
    assert "training.exit_after_minutes=1e-06 reached: saved at step 1, exiting" in capsys.readouterr().out
    assert latest_checkpoint(tmp_path / "limited" / "checkpoints").name == "iter_0000001"
    assert main(["--config", str(path), "--quiet", "--resume"]) == 0

    straight = make_trainer(make_config("straight"))
    straight.train()
    final = make_trainer(path)
    final.load(latest_checkpoint(tmp_path / "limited" / "checkpoints"))
    assert final.state.step == straight.state.step == 6
    for (name, a), b in zip(weights(straight).items(), weights(final).values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
