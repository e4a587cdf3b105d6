"""Shared fixtures: one tiny tokenizer + shard + mixture per session, and config writers."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from trainer_fixtures import build_mixture

SEQ = 32


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    return build_mixture(tmp_path_factory.mktemp("data"), seq_length=SEQ, vocab_size=384)


def base_config(artifacts: dict[str, Path], run_dir: Path) -> dict:
    """A small run: tiny preset at d=32, 4 sequences of 32 tokens per step, 2 micro-batches."""
    return {
        "run_dir": str(run_dir),
        "model": {"preset": "tiny", "hidden_size": 32, "ffn_hidden_size": 64, "max_seq_len": 64},
        "data": {"mixture": str(artifacts["mixture"]), "tokenizer": str(artifacts["tokenizer"])},
        "optim": {"lr": 3e-3, "min_lr": 3e-4},
        "schedule": {"kind": "cosine", "warmup_steps": 2},
        "training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": SEQ, "steps": 6,
                     "log_interval": 1, "threads": 1},
        "logging": {"tensorboard": False},
    }


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def train_two_steps(artifacts: dict[str, Path], root: Path) -> tuple[dict, Path, Path]:
    """A 2-step one-process `tessera-train` run under `root`: (its config, config file, run directory)."""
    from tessera.trainer.cli import main as train_main

    cfg = base_config(artifacts, root / "run")
    cfg["training"]["steps"] = 2
    config = write_config(root / "config.yaml", cfg)
    assert train_main(["--config", str(config), "--quiet"]) == 0
    return cfg, config, root / "run"


@pytest.fixture
def make_config(artifacts, tmp_path):
    """make_config(**sections) -> path of a YAML config; sections are merged into base_config."""
    counter = iter(range(1000))

    def make(run_name: str = "run", **sections) -> Path:
        cfg = copy.deepcopy(base_config(artifacts, tmp_path / run_name))
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key].update(value)
            else:
                cfg[key] = value
        return write_config(tmp_path / f"config{next(counter)}.yaml", cfg)

    return make


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """Data made by the real `tessera-data` CLIs (tok/, data/, mix/), for the end-to-end tests."""
    import shutil
    import sys

    from trainer_fixtures import prepare_with_cli

    bin_dir = Path(sys.executable).parent
    if shutil.which("tessera-data", path=str(bin_dir)) is None:
        pytest.skip("tessera-data is not installed")
    return prepare_with_cli(tmp_path_factory.mktemp("e2e"), bin_dir)
