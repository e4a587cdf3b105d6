"""DeepSeek-V3 against transformers itself: the group-limited sigmoid router and the MoE block on
the same inputs, and whole random tiny models (latent attention with and without the query
bottleneck, interleaved and rotate-half RoPE rows, YaRN with DeepSeek's mscale, a dense first
layer) imported through the HF adapter give transformers' logits (fp32)."""

from __future__ import annotations

import pytest
import torch
from deepseek_hf import BASE, YARN, build_hf

from tessera.common.hf.directory import load_hf_weights, read_hf_config
from tessera.common.layers.moe import MoE
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.model import build_model

CASES = {
    "q-lora-grouped-routing-yarn-mscale": {"rope_parameters": YARN},
    "no-q-lora-rotate-half-rows": dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1),
    "two-dense-layers-unnormalised-weights": dict(first_k_dense_replace=2, norm_topk_prob=False, n_group=2,
                                                  topk_group=1, num_experts_per_tok=2),
}
TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(CASES))
def test_deepseek_v3_logits_equal_transformers(tmp_path, name):
    hf = build_hf(**CASES[name])
    hf.save_pretrained(tmp_path)
    cfg, _ = read_hf_config(tmp_path)
    assert cfg.arch == "deepseek_v3" and cfg.mla is not None and cfg.moe is not None
    ours = build_model(cfg, seed=None).eval()
    ours.load_state_dict(load_hf_weights(tmp_path, cfg), strict=True)
    assert cfg.num_params() == sum(p.numel() for p in ours.parameters())
    with torch.no_grad():
        theirs = hf(TOKENS).logits
        diff = (ours(TOKENS) - theirs).abs().max().item()
    assert diff < 1e-5 * theirs.abs().max().item(), diff


def test_the_rope_row_order_and_the_mscale_really_matter(tmp_path):
    """Dropping the interleave permutation or the YaRN attention scale changes the logits."""
    hf = build_hf(rope_parameters=YARN)
    hf.save_pretrained(tmp_path)
    cfg, _ = read_hf_config(tmp_path)
    weights = load_hf_weights(tmp_path, cfg)
    assert cfg.mla is not None and cfg.mla.rope_interleave
    plain = cfg.model_copy(update={"rope_scaling": cfg.rope_scaling.model_copy(update={"mscale_all_dim": None})})
    for twin_cfg, tensors in ((cfg, {k: v for k, v in weights.items()}), (plain, weights)):
        if twin_cfg is cfg:  # the rows as transformers stores them, unpermuted
            hf_rows = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
            tensors["layers.0.attn.kv_a_proj.weight"] = hf_rows["layers.0.self_attn.kv_a_proj_with_mqa.weight"]
        twin = build_model(ModelConfig.model_validate(twin_cfg.model_dump()), seed=None).eval()
        twin.load_state_dict(tensors, strict=True)
        with torch.no_grad():
            assert (twin(TOKENS) - hf(TOKENS).logits).abs().max().item() > 1e-3


def test_router_and_moe_block_equal_transformers_on_the_same_inputs():
    import transformers

    torch.manual_seed(1)
    config = transformers.DeepseekV3Config(**BASE)
    theirs = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.3)
        theirs.gate.e_score_correction_bias.normal_(0.0, 0.1)
    cfg = ModelConfig(arch="deepseek_v3", vocab_size=320, hidden_size=48, num_layers=2, num_heads=4,
                      ffn_hidden_size=64, moe=dict(num_experts=8, top_k=3, ffn_hidden_size=16, score="sigmoid",
                                                   routed_scaling_factor=2.5, num_shared_experts=1, num_groups=4,
                                                   topk_groups=2))
    ours = MoE(cfg).eval()
    e = 8
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        ours.expert_bias.copy_(theirs.gate.e_score_correction_bias)
        gate, up = theirs.experts.gate_up_proj.chunk(2, dim=1)
        ours.experts.gate_proj.copy_(gate)
        ours.experts.up_proj.copy_(up)
        ours.experts.down_proj.copy_(theirs.experts.down_proj)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            getattr(ours.shared, proj).weight.copy_(getattr(theirs.shared_experts, proj).weight)
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, their_w, their_idx = theirs.gate(x)
        idx, weights, _ = ours.route(x)
        # transformers picks with sorted=False: compare per token as expert -> weight maps
        dense = torch.zeros(64, e).scatter_(1, idx, weights)
        their_dense = torch.zeros(64, e).scatter_(1, their_idx, their_w)
        assert torch.equal(dense != 0, their_dense != 0)
        torch.testing.assert_close(dense, their_dense, rtol=1e-6, atol=1e-7)
        # the bias changed some choices (it selects) but weighs nothing
        bias = ours.expert_bias.clone()
        ours.expert_bias.zero_()
        unbiased, unbiased_w, _ = ours.route(x)
        ours.expert_bias.copy_(bias)
        assert not torch.equal(unbiased.sort(-1).values, idx.sort(-1).values)
        kept = (unbiased.sort(-1).values == idx.sort(-1).values).all(-1)  # same choice: same weights
        assert kept.any()
        torch.testing.assert_close(unbiased_w.sort(-1).values[kept], weights.sort(-1).values[kept])
        torch.testing.assert_close(ours(x.view(4, 16, 48)), theirs(x.view(4, 16, 48)).view(4, 16, 48),
                                   rtol=1e-5, atol=1e-6)
