"""Weights & Biases (offline) and MLflow (local file store) receive what metrics.jsonl records,
tested against the real libraries without network; a configured tracker that is not installed is
one notice line."""

from __future__ import annotations

import json
import sys

import pytest

from tessera.trainer.cli import main

pytestmark = pytest.mark.slow


def _train_losses(run_dir) -> dict[int, float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r.get("kind") == "train"}


def test_mlflow_and_wandb_get_every_logged_loss(make_config, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = make_config("tracked")
    try:
        assert main(["--config", str(config), "--quiet", "logging.wandb.project=tessera-test",
                     "logging.mlflow.experiment=tessera-test", "training.steps=3"]) == 0
    finally:
        import wandb

        # wandb keeps its service process (wandb-core) for the interpreter's life, ending it at exit;
        # in a CLI run that is the run's end, here it would outlive the test (conftest's process check).
        wandb.teardown()
    run_dir = tmp_path / "tracked"
    want = _train_losses(run_dir)
    assert sorted(want) == [1, 2, 3]

    from mlflow.tracking import MlflowClient

    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("tessera-test")
    (run,) = client.search_runs([experiment.experiment_id])
    got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train_loss")}
    assert got == pytest.approx(want, rel=1e-6)
    assert run.data.params["training.steps"] == "3" and run.info.status == "FINISHED"

    # An offline run keeps its history in the run's .wandb record file (what `wandb sync` uploads);
    # wandb has no public reader for it, so look for each logged value's JSON encoding there.
    (records,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = records.read_bytes()
    assert b"train/loss" in data
    for loss in want.values():
        assert json.dumps(loss).encode() in data, loss


def test_a_configured_tracker_that_is_not_installed_is_one_notice(make_config, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    assert main(["--config", str(make_config("untracked")), "--quiet", "logging.wandb.project=x",
                 "training.steps=1"]) == 0
    out = capsys.readouterr().out
    assert "note: logging.wandb is configured but wandb is not installed" in out
