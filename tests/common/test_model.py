"""The shared model: exact parameter accounting, meta-device build, and parity with transformers."""

from __future__ import annotations

import pytest
import torch

from tessera.common.models.causal_lm.config import PRESETS, ModelConfig, preset
from tessera.common.models.causal_lm.model import Transformer, build_model


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_param_count_matches_module(name):
    cfg = preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_flops_per_token_llama_matches_hand_count():
    cfg = preset("llama-160m")
    d, f, v, L, T = 768, 3072, 32000, 12, 2048
    matmul = L * (4 * d * d + 3 * d * f) + v * d  # q,k,v,o + gate,up,down + head
    assert cfg.flops_per_token(T) == pytest.approx(6 * matmul + 12 * L * d * T)


def test_build_on_meta_is_seeded_and_materialised():
    cfg = preset("tiny", vocab_size=128)
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    c = build_model(cfg, seed=4)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert not pa.is_meta
        assert torch.equal(pa, pb), n
    assert not torch.equal(a.layers["0"].attn.q_proj.weight, c.layers["0"].attn.q_proj.weight)


def test_bf16_model_keeps_fp32_rope_tables():
    cfg = preset("tiny", vocab_size=128)
    model = build_model(cfg, dtype=torch.bfloat16)
    assert model.rotary.cos.dtype == torch.float32
    ref = build_model(cfg).rotary.cos
    assert torch.equal(model.rotary.cos, ref)


def transformers_twin(cfg, ours, rope_scaling: dict | None = None):
    """LlamaForCausalLM with the same config and weights as our model (eval mode)."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        rope_scaling=dict(rope_type="llama3", **rope_scaling) if rope_scaling else None,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    rename = [("embed_tokens", "model.embed_tokens"), ("final_norm", "model.norm"), ("layers.", "model.layers."),
              ("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"), (".attn.", ".self_attn.")]
    state = {}
    for name, tensor in ours.state_dict().items():
        for old, new in rename:
            name = name.replace(old, new)
        state[name] = tensor
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True)
    return hf


@pytest.mark.parametrize("kv_heads,tied,scaling", [(2, False, True), (4, True, False), (1, False, False)])
def test_llama_logits_match_transformers(kv_heads, tied, scaling):
    rope_scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    cfg = preset("tiny", vocab_size=300, num_kv_heads=kv_heads, tie_embeddings=tied, rope_theta=50000.0,
                 rope_scaling=rope_scaling if scaling else None)
    ours = build_model(cfg, seed=1).eval()
    hf = transformers_twin(cfg, ours, rope_scaling if scaling else None)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < 1e-4


def test_packed_documents_match_transformers_packed_sequences():
    """document_ids + per-document positions vs transformers' packed-sequence training format
    (position_ids restarting per sequence, from which it builds a block-causal mask)."""
    cfg = preset("tiny", vocab_size=300, num_kv_heads=2)
    ours = build_model(cfg, seed=2).eval()
    hf = transformers_twin(cfg, ours)
    lengths = [[7, 12, 5, 16], [30, 10]]  # documents per row, 40 tokens each
    document_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    positions = torch.tensor([[i for n in row for i in range(n)] for row in lengths])
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours(tokens, positions=positions, document_ids=document_ids)
        want = hf(tokens, position_ids=positions, use_cache=False).logits
        unmasked = ours(tokens, positions=positions)
    assert (got - want).abs().max().item() < 1e-4
    assert (unmasked - want).abs().max().item() > 1e-2  # the mask, not just the positions, is compared


def test_positions_hook_equals_default_positions():
    cfg = preset("tiny", vocab_size=128)
    model = build_model(cfg).eval()
    tokens = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        full = model(tokens)
        # Second half evaluated alone at its true positions, attending only to itself, differs;
        # but explicit positions 0..T-1 must equal the default.
        explicit = model(tokens, positions=torch.arange(12).unsqueeze(0))
    assert torch.equal(full, explicit)


def test_invalid_shapes_are_refused():
    with pytest.raises(ValueError, match="num_heads"):
        ModelConfig(vocab_size=10, hidden_size=65, num_layers=1, num_heads=4, ffn_hidden_size=8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(vocab_size=10, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=3, ffn_hidden_size=8)
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.model_validate({"preset": "nope"})
