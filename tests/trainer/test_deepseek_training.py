"""Training DeepSeek-V3 (latent attention, sigmoid group-limited routing with the balancing bias,
a dense first layer, a multi-token-prediction depth) through `tessera-train`: the loss falls, the
router statistics and the MTP loss are logged (apart from the main loss), and a resumed run is
bit-identical to an uninterrupted one, MTP modules included."""

from __future__ import annotations

import json

import torch
from test_checkpoint import final_weights, losses

from tessera.common.checkpoint import read_pointer
from tessera.trainer.cli import main

DEEPSEEK = {"preset": "tiny", "arch": "deepseek_v3", "hidden_size": 32, "ffn_hidden_size": 64, "max_seq_len": 64,
            "num_layers": 3, "num_heads": 4, "num_kv_heads": 4,
            "mla": {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                    "v_head_dim": 8},
            "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 16, "first_k_dense": 1, "score": "sigmoid",
                    "routed_scaling_factor": 2.5, "num_shared_experts": 1, "num_groups": 4, "topk_groups": 2,
                    "bias_balancing": True, "bias_update_rate": 0.01},
            "mtp": {"depth": 1, "loss_scaling_factor": 0.3}}


def test_deepseek_v3_trains_and_resumes_bit_identically(make_config, tmp_path):
    sections = dict(training={"steps": 8}, model=DEEPSEEK)
    straight = make_config("straight", **sections)
    assert main(["--config", str(straight), "--quiet"]) == 0
    split = make_config("split", **sections)
    assert main(["--config", str(split), "--quiet", "training.exit_after_steps=4"]) == 0
    assert read_pointer(tmp_path / "split" / "checkpoints") == 4
    assert main(["--config", str(split), "--quiet", "--resume"]) == 0
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "split")
    assert a.keys() == b.keys() and "layers.0.attn.kv_b_proj.weight" in a and "layers.1.mlp.expert_bias" in a
    assert a["layers.1.mlp.expert_bias"].abs().sum() > 0  # the balancing bias moved
    assert a["mtp.layers.0.mlp.expert_bias"].abs().sum() > 0  # the MTP layer is MoE, balanced too
    for name in a:
        assert torch.equal(a[name], b[name]), name
    run = losses(tmp_path / "straight")
    assert run == losses(tmp_path / "split")
    steps = sorted(run)
    assert run[steps[-1]] < run[steps[0]]
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert train and all(r["moe_max_load"] >= 1.0 for r in train)
    mtp = [r["mtp_loss"] for r in train]
    assert all(m > 0 and m != r["loss"] for m, r in zip(mtp, train)) and mtp[-1] < mtp[0]
    from tessera.trainer.components.observability.metrics import format_record

    assert f"mtp loss {mtp[-1]:.4f}" in format_record(train[-1])  # the console line, beside the main loss
