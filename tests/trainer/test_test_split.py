"""data.test_split: when training completes, the test split is evaluated once (Megatron's test-set loss)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from trainer_fixtures import run_tool

from tessera.common.config import load_config
from tessera.common.mixture import MixtureSplit
from tessera.trainer.cli import main
from tessera.trainer.components.checkpoint.storage import latest_checkpoint
from tessera.trainer.components.distributed import init_runtime
from tessera.trainer.config import TrainConfig
from tessera.trainer.inputs import check_inputs
from tessera.trainer.objectives.batches import MixtureBatches
from tessera.trainer.trainer import Trainer


@pytest.fixture(scope="module")
def mixture_with_test(data_dir) -> Path:
    run_tool([str(Path(sys.executable).parent / "tessera-data"), "blend", "--data", "1.0", "data/stdlib_text_document",
              "--seq-length", "32", "--split", "8,1,1", "--train-samples", "200", "--valid-samples", "16",
              "--test-samples", "16", "--output", "mix_test", "--quiet"], data_dir)
    return data_dir / "mix_test"


def config(data_dir: Path, mixture: Path, run: Path) -> Path:
    cfg = {"run_dir": str(run), "data": {"mixture": str(mixture), "tokenizer": str(data_dir / "tok")},
           "model": {"preset": "tiny", "hidden_size": 32, "ffn_hidden_size": 64, "max_seq_len": 64},
           "training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 32, "steps": 4,
                        "eval_interval": 2, "eval_iters": 3, "threads": 1},
           "logging": {"tensorboard": False}}
    path = run.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_test_split_is_evaluated_once_at_the_end_on_its_own_samples(data_dir, mixture_with_test, tmp_path, capsys):
    path = config(data_dir, mixture_with_test, tmp_path / "run")
    assert main(["--config", str(path), "--quiet"]) == 0
    assert "test  step      4 | test loss" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tests = [r for r in records if r["kind"] == "test"]
    assert [r["step"] for r in tests] == [4] and [r["step"] for r in records if r["kind"] == "eval"] == [2, 4]

    # The same loss, computed outside the trainer: the final weights on the first eval_iters global
    # batches of the test split (3 x 4 samples; the layout-free definition: under the old one, 3
    # micro-batches of 2 samples, this fails).
    cfg = load_config(TrainConfig, path, [])
    trainer = Trainer(cfg, check_inputs(cfg), init_runtime("cpu"), quiet=True)
    trainer.load(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    test = MixtureBatches(MixtureSplit(mixture_with_test, "test"), 32)
    with torch.no_grad():
        inputs, labels = test.batch(np.arange(3 * 4))
        logits = trainer.engine.model(inputs)
        want = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).item()
    assert tests[0]["test_loss"] == pytest.approx(want, rel=1e-5)
    valid = [r for r in records if r["kind"] == "eval"][-1]["valid_loss"]
    assert tests[0]["test_loss"] != pytest.approx(valid, rel=1e-6)  # really another split


def test_no_test_split_or_disabled_means_no_test_record(data_dir, mixture_with_test, tmp_path):
    path = config(data_dir, mixture_with_test, tmp_path / "off")
    assert main(["--config", str(path), "--quiet", "data.test_split=null"]) == 0
    path = config(data_dir, data_dir / "mix", tmp_path / "none")  # this mixture's test split is empty
    assert main(["--config", str(path), "--quiet"]) == 0
    for run in ("off", "none"):
        kinds = {json.loads(line)["kind"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()}
        assert kinds == {"train", "eval"}


def test_eval_only_reports_the_checkpoints_losses_and_writes_nothing(data_dir, mixture_with_test, tmp_path, capsys):
    path = config(data_dir, mixture_with_test, tmp_path / "run")
    assert main(["--config", str(path), "--quiet"]) == 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    trained = [json.loads(line) for line in metrics.read_text().splitlines()]
    config_yaml = (tmp_path / "run" / "config.yaml").read_text()
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    capsys.readouterr()

    # --resume --eval-only: the same losses the run logged at its last step, appended; nothing else written.
    assert main(["--config", str(path), "--quiet", "--resume", "--eval-only"]) == 0
    after = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert after[:len(trained)] == trained and [r["kind"] for r in after[len(trained):]] == ["eval", "test"]
    for kind, key in (("eval", "valid_loss"), ("test", "test_loss")):
        logged = [r for r in trained if r["kind"] == kind][-1]
        again = [r for r in after[len(trained):] if r["kind"] == kind][0]
        assert again["step"] == 4 and again[key] == logged[key]
    assert (tmp_path / "run" / "config.yaml").read_text() == config_yaml
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == checkpoints

    # init_from + --eval-only in a new run directory: step 0, the source's weights.
    fresh = config(data_dir, mixture_with_test, tmp_path / "eval")
    assert main(["--config", str(fresh), "--quiet", "--eval-only", f"checkpoint.init_from={tmp_path / 'run'}"]) == 0
    evals = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in evals] == [("eval", 0), ("test", 0)]
    assert evals[0]["valid_loss"] == [r for r in trained if r["kind"] == "eval"][-1]["valid_loss"]
    assert not (tmp_path / "eval" / "checkpoints").exists()


def test_eval_only_with_nothing_to_evaluate_is_one_line(data_dir, tmp_path, capsys):
    from test_bad_input import run_expect_usage_error

    path = config(data_dir, data_dir / "mix", tmp_path / "run")  # no test samples; valid switched off
    err = run_expect_usage_error(["--config", str(path), "--eval-only", "data.valid_split=null"], capsys)
    assert "training.eval_only has nothing to evaluate" in err
