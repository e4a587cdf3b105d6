"""End to end on real CLIs: tessera-data prep + blend, then tessera-train (plain and under torchrun)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from trainer_fixtures import stdlib_documents

from tessera.common.checkpoint import load_model_tensors, resolve_checkpoint

BIN = Path(sys.executable).parent


def run(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[0]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    if shutil.which("tessera-data", path=str(BIN)) is None:
        pytest.skip("tessera-data is not installed")
    root = tmp_path_factory.mktemp("e2e")
    with open(root / "corpus.jsonl", "w") as f:
        for text in stdlib_documents():
            f.write(json.dumps({"text": text}) + "\n")
    run([str(BIN / "tessera-data"), "prep", "--input", "corpus.jsonl", "--train-tokenizer", "--vocab-size", "512",
         "--output-prefix", "data/stdlib", "--tokenizer-output", "tok", "--quiet"], root)
    run([str(BIN / "tessera-data"), "blend", "--data", "1.0", "data/stdlib_text_document", "--seq-length", "32",
         "--split", "8,2,0", "--train-samples", "400", "--valid-samples", "16", "--output", "mix", "--quiet"], root)
    return root


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
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
