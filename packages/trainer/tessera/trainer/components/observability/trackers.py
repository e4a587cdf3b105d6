"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow.

Both are optional dependencies (the trainer's `trackers` extra). A tracker that is configured but
not installed is one notice line and the run goes on; nothing is silently skipped. Each receives
every record MetricsSink logs (numeric fields, under train/, eval/ or test/ as in TensorBoard) at
its step, and the run's resolved config once at start, from rank 0 only.

- `logging.wandb`: `wandb.init(mode="offline")` by default, writing under <run_dir>/wandb (upload
  later with `wandb sync`); `mode: online` needs the network and a login.
- `logging.mlflow`: a local file store under <run_dir>/mlruns by default (`tracking_uri` for a
  server). MLflow 3 puts the file store in maintenance mode behind MLFLOW_ALLOW_FILE_STORE; Tessera
  sets it for `file:` URIs only, since a local store is what a run without a server has.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _numeric(rec: dict[str, Any]) -> dict[str, float]:
    prefix = {"eval": "eval/", "test": "test/"}.get(rec.get("kind"), "train/")
    return {prefix + k: float(v) for k, v in rec.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "total_steps")}


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out


class WandbTracker:
    def __init__(self, settings: Any, run_dir: Path, config: dict[str, Any]):
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=settings.project, name=settings.name, mode=settings.mode, dir=str(run_dir),
                              config=_flatten(config), reinit="finish_previous")

    def log(self, rec: dict[str, Any]) -> None:
        self.run.log(_numeric(rec), step=int(rec["step"]))

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, settings: Any, run_dir: Path, config: dict[str, Any]):
        uri = settings.tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        import mlflow

        self.client = mlflow.tracking.MlflowClient(uri)
        experiment = self.client.get_experiment_by_name(settings.experiment)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(settings.experiment))
        self.run_id = self.client.create_run(experiment_id, run_name=settings.run_name).info.run_id
        params = _flatten(config)
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, rec: dict[str, Any]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k.replace("/", "_"), v, now, int(rec["step"])) for k, v in _numeric(rec).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_trackers(logging: Any, run_dir: Path, config: dict[str, Any], write: Callable[[str], None]) -> list[Any]:
    """The configured trackers that could be started; a notice line for each one that could not."""
    trackers = []
    for field, cls, package in (("wandb", WandbTracker, "wandb"), ("mlflow", MlflowTracker, "mlflow-skinny")):
        settings = getattr(logging, field)
        if settings is None:
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            trackers.append(cls(settings, run_dir, config))
        except ImportError:
            write(f"note: logging.{field} is configured but {field} is not installed; not tracked there "
                  f"(pip install {package}, or pip install 'tessera-trainer[trackers]')")
    return trackers
