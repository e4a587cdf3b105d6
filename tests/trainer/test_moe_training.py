"""Training a mixture of experts: router statistics are logged with the loss, the balancing bias
moves and is part of the checkpoint, and a resumed run is bit-identical to an uninterrupted one,
in one process and under expert parallel."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from test_checkpoint import final_weights, losses
from trainer_fixtures import run_tool

from tessera.common.checkpoint import read_pointer
from tessera.trainer.cli import main

MOE = {"preset": "tiny", "hidden_size": 32, "ffn_hidden_size": 64, "max_seq_len": 64, "num_layers": 3,
       "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32, "first_k_dense": 1, "aux_loss_coef": 0.01,
               "bias_balancing": True, "bias_update_rate": 0.01, "num_shared_experts": 1}}


def test_resumed_moe_run_is_bit_identical_router_bias_included(make_config, tmp_path):
    sections = dict(training={"steps": 6}, model=MOE)
    straight = make_config("straight", **sections)
    assert main(["--config", str(straight), "--quiet"]) == 0
    split = make_config("split", **sections)
    assert main(["--config", str(split), "--quiet", "training.exit_after_steps=3"]) == 0
    assert read_pointer(tmp_path / "split" / "checkpoints") == 3
    assert main(["--config", str(split), "--quiet", "--resume"]) == 0
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "split")
    assert a.keys() == b.keys() and "layers.1.mlp.expert_bias" in a
    assert a["layers.1.mlp.expert_bias"].abs().sum() > 0  # the bias moved
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert losses(tmp_path / "straight") == losses(tmp_path / "split")
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert train and all(r["moe_aux_loss"] > 0 and r["moe_max_load"] >= 1.0 and r["moe_dropped"] == 0 for r in train)


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_run_logs_the_one_process_losses_and_resumes_bit_identically(make_config, tmp_path):
    """`tessera-train --expert-parallel 2` under torchrun: the one-process losses (1e-5; aux loss
    off, see tests/parallel/test_moe_parity.py), router statistics logged; stopped after 2 steps
    and resumed, bit-identical to the uninterrupted EP2 run, balancing bias included."""
    sections = dict(training={"steps": 4}, model={**MOE, "moe": {**MOE["moe"], "aux_loss_coef": 0.0}})
    assert main(["--config", str(make_config("one", **sections)), "--quiet"]) == 0

    def torchrun(config, *args: str) -> None:
        run_tool([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2", "-m",
                  "tessera.trainer", "--config", str(config), "--quiet", "--expert-parallel", "2", *args],
                 tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})

    torchrun(make_config("ep2", **sections))
    split = make_config("ep2_split", **sections)
    torchrun(split, "training.exit_after_steps=2")
    assert read_pointer(tmp_path / "ep2_split" / "checkpoints") == 2
    torchrun(split, "--resume")
    one, ep2 = losses(tmp_path / "one"), losses(tmp_path / "ep2")
    assert ep2.keys() == one.keys() and all(ep2[s] == pytest.approx(one[s], rel=1e-5) for s in one)
    assert losses(tmp_path / "ep2_split") == ep2
    a, b = final_weights(tmp_path / "ep2"), final_weights(tmp_path / "ep2_split")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # The balancing bias moved, and moved exactly as in the one process.
    plain = final_weights(tmp_path / "one")
    biases = [n for n in a if n.endswith("expert_bias")]
    assert biases and any(a[n].abs().sum() > 0 for n in biases)
    assert all(torch.equal(a[n], plain[n]) for n in biases)
    records = [json.loads(line) for line in (tmp_path / "ep2" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert train and all(r["moe_max_load"] >= 1.0 and r["moe_dropped"] == 0 for r in train)
