"""Training a mixture of experts: router statistics are logged with the loss, the balancing bias
moves and is part of the checkpoint, and a resumed run is bit-identical to an uninterrupted one."""

from __future__ import annotations

import json

import torch
from test_checkpoint import final_weights, losses

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
