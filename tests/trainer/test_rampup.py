"""training.rampup_batch_size (Megatron's --rampup-batch-size): the batch schedule, exact resume in
the middle of the ramp, parity with a fixed-batch run, and parallel layouts (a pipeline whose
micro-batch count changes between steps) against one process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from trainer_fixtures import run_tool

from tessera.common.config import load_config
from tessera.common.errors import UserError
from tessera.trainer.cli import main
from tessera.trainer.config import TrainConfig
from tessera.trainer.inputs import check_inputs
from tessera.trainer.objectives.batches import global_batch_size_at

BIN = Path(sys.executable).parent
RAMP = {"global_batch_size": 8, "rampup_batch_size": [2, 2, 12], "steps": 6}


def records(run_dir: Path, kind: str = "train") -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == kind}


def test_batch_sizes_follow_megatrons_ramp():
    # (8 - 2) / 2 = 3 increments over 12 samples: one every 4 consumed samples; full size past 12.
    ramp = (2, 2, 12)
    assert [global_batch_size_at(c, 8, ramp) for c in (0, 2, 3, 4, 7, 8, 11, 12, 13, 100)] == \
        [2, 2, 2, 4, 4, 6, 6, 8, 8, 8]
    assert global_batch_size_at(5, 8, None) == 8


def test_ramp_run_logs_its_batches_and_resumes_exactly(make_config, tmp_path):
    """One process: batches 2, 2, 4, 6, 8, 8 (consumed 0, 2, 4, 8, 14, 22); stopped after step 3 and
    resumed, the run logs bit-identical losses to the uninterrupted one; its first step is the
    first step of a plain run at global batch 2 (same data, weights and learning rate)."""
    straight = make_config("straight", training=RAMP)
    assert main(["--config", str(straight), "--quiet"]) == 0
    want = records(tmp_path / "straight")
    assert [want[s]["global_batch_size"] for s in range(1, 7)] == [2, 2, 4, 6, 8, 8]
    assert [want[s]["consumed_samples"] for s in range(1, 7)] == [2, 4, 8, 14, 22, 30]
    assert want[6]["consumed_tokens"] == 30 * 32

    interrupted = make_config("interrupted", training={**RAMP, "exit_after_steps": 3})
    assert main(["--config", str(interrupted), "--quiet"]) == 0
    assert main(["--config", str(interrupted), "--quiet", "--resume", "training.exit_after_steps=null"]) == 0
    got = records(tmp_path / "interrupted")
    assert [got[s]["loss"] for s in range(1, 7)] == [want[s]["loss"] for s in range(1, 7)]
    assert [got[s]["grad_norm"] for s in range(1, 7)] == [want[s]["grad_norm"] for s in range(1, 7)]

    plain = make_config("plain", training={"global_batch_size": 2, "steps": 6})
    assert main(["--config", str(plain), "--quiet"]) == 0
    assert records(tmp_path / "plain")[1]["loss"] == want[1]["loss"]


def test_ramp_sizes_must_suit_the_layout(make_config):
    """Each ramp size is checked like the global batch: data-parallel multiples, and the interleaved
    pipeline's micro-batch rule (12 sequences = 3 micro-batches per rank, not a multiple of 2 stages)."""
    pipeline = {"pipeline": 2}
    cfg = load_config(TrainConfig, make_config(training={"global_batch_size": 16, "rampup_batch_size": [8, 4, 16]},
                                               model={"num_layers": 4}, parallel=pipeline))
    check_inputs(cfg, world_size=4)  # DP=2 x PP=2 (1F1B): 8, 12, 16 = 2, 3, 4 micro-batches of 2 per rank
    interleaved = load_config(TrainConfig, make_config(
        training={"global_batch_size": 16, "rampup_batch_size": [8, 4, 16]}, model={"num_layers": 4},
        parallel={**pipeline, "virtual_stages": 2}))
    with pytest.raises(UserError, match="rampup_batch_size: at global batch 12: interleaved pipeline"):
        check_inputs(interleaved, world_size=4)
    odd = load_config(TrainConfig, make_config(training={"global_batch_size": 8, "rampup_batch_size": [2, 2, 8]},
                                               parallel=pipeline))
    with pytest.raises(UserError, match=r"batch sizes \[2, 6\] are not multiples"):
        check_inputs(odd, world_size=4)
    with pytest.raises(Exception, match="minus start must be a multiple of the increment"):
        load_config(TrainConfig, make_config(training={"global_batch_size": 8, "rampup_batch_size": [2, 4, 8]}))


@pytest.mark.slow
@pytest.mark.distributed
def test_dp2_pp2_ramp_matches_one_process(make_config, tmp_path):
    """DP=2 x PP=2 (1F1B) through batches 8, 12, 16, 16: 2, 3, 4 micro-batches per rank, a pipeline
    schedule per count; the per-step losses, grad norms and batch sizes equal one process's."""
    training = {"global_batch_size": 16, "rampup_batch_size": [8, 4, 16], "steps": 4}
    reference = make_config("reference", training=training, model={"num_layers": 4})
    assert main(["--config", str(reference), "--quiet"]) == 0
    want = records(tmp_path / "reference")
    assert [want[s]["global_batch_size"] for s in range(1, 5)] == [8, 12, 16, 16]
    config = make_config("dp2pp2", training=training, model={"num_layers": 4})
    run_tool([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=4", "-m", "tessera.trainer",
              "--config", str(config), "--quiet", "--pipeline-parallel", "2"], tmp_path, timeout=300,
             env={**os.environ, "OMP_NUM_THREADS": "1"})
    got = records(tmp_path / "dp2pp2")
    assert sorted(got) == [1, 2, 3, 4]
    for s in got:
        assert got[s]["global_batch_size"] == want[s]["global_batch_size"]
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-5), s
        assert got[s]["grad_norm"] == pytest.approx(want[s]["grad_norm"], rel=1e-4), s
