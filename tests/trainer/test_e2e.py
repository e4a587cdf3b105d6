"""End to end on real CLIs: tessera-data prep + blend, then tessera-train (plain and under torchrun)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from trainer_fixtures import assert_weights_close
from trainer_fixtures import run_tool as run

from tessera.common.checkpoint import load_model_tensors, resolve_checkpoint

BIN = Path(sys.executable).parent


def write(root: Path, name: str, **training) -> Path:
    cfg = {
        "run_dir": str(root / name),
        "model": {"preset": "tiny", "hidden_size": 32, "ffn_hidden_size": 64, "max_seq_len": 64},
        "data": {"mixture": str(root / "mix"), "tokenizer": str(root / "tok")},
        "optim": {"lr": 3e-3, "min_lr": 3e-4},
        "schedule": {"warmup_steps": 5},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 32, "steps": 40,
                     "log_interval": 10, "eval_interval": 20, "threads": 1, **training},
        "logging": {"tensorboard": False},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_train_from_tessera_data_artifacts(data_dir):
    proc = run([str(BIN / "tessera-train"), "--config", str(write(data_dir, "plain")), "--quiet"], data_dir)
    assert "step     40/40" in proc.stdout and "saved checkpoint" in proc.stdout
    records = [json.loads(x) for x in (data_dir / "plain" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, train
    ckpt = resolve_checkpoint(data_dir / "plain")
    assert (ckpt / "tokenizer" / "tokenizer.json").is_file()


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_data_parallel_matches_one_process(data_dir):
    """torchrun with 2 gloo ranks (data parallel) gives the single-process weights."""
    single = write(data_dir, "single", steps=3)
    run([str(BIN / "tessera-train"), "--config", str(single), "--quiet"], data_dir)
    cfg = write(data_dir, "torchrun2", steps=3)
    run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "tessera.trainer.cli",
         "--config", str(cfg), "--quiet"], data_dir)
    ref = load_model_tensors(resolve_checkpoint(data_dir / "single"))
    got = load_model_tensors(resolve_checkpoint(data_dir / "torchrun2"))
    # The two runs sum the same micro-batch gradients in a different order, and Adam divides by
    # sqrt(v) + eps, so an element whose gradient nearly cancels turns float32 rounding into a
    # visible difference (seen: one lm_head element 1.1e-6 apart). Elementwise bounds test the
    # rounding, not the parallelism; the bound is normwise, as in tests/parallel/test_parity.py:
    # 1e-4 per tensor and 1e-5 over the whole model (trainer_fixtures.assert_weights_close).
    # Measured: 2.3e-7 and 4.7e-8; training on half the batch (what a missed all-reduce amounts to) gives 0.15 and 2.1e-2.
    assert_weights_close(got, ref, "torchrun DP=2 vs one process")
