"""training.check_nonfinite: a diverged step stops the run with one line, saving nothing."""

from __future__ import annotations

import json

import pytest
from test_loop import make_trainer

from tessera.common.errors import RunError, run_cli
from tessera.trainer.cli import main
from tessera.trainer.components.checkpoint.storage import latest_checkpoint

# lr 1e30: step 1 is finite and blows the weights up, so step 2's forward overflows to inf/nan.
DIVERGE = ["optim.lr=1e30", "optim.min_lr=0", "schedule.warmup_steps=0"]


def test_diverged_step_is_one_line_exit_1_and_the_last_good_checkpoint_stays_newest(make_config, tmp_path, capsys):
    path = make_config()
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--config", str(path), "--quiet", "training.save_interval=1", *DIVERGE])
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "step 2: loss" in err and "not finite" in err and "iter_0000001" in err
    run = tmp_path / "run"
    assert latest_checkpoint(run / "checkpoints").name == "iter_0000001"
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("iter_")) == ["iter_0000001"]
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and last["kind"] == "train"  # the bad step is logged before stopping


def test_without_a_checkpoint_the_message_says_so(make_config):
    trainer = make_trainer(make_config(), *DIVERGE)
    with pytest.raises(RunError, match="no checkpoint was saved yet"):
        trainer.train()


def test_check_off_trains_on(make_config, tmp_path):
    trainer = make_trainer(make_config(), *DIVERGE, "training.check_nonfinite=false")
    assert trainer.train().step == 6
