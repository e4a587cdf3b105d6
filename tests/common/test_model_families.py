"""Every model family against transformers itself: our logits from the HF adapter's import of a
random tiny model equal transformers' logits (fp32), and the features are really exercised
(a sliding window changes the result, and so on)."""

from __future__ import annotations

import pytest
import torch
from hf_families import CASES, build

from tessera.common.hf.directory import load_hf_weights, read_hf_config
from tessera.common.models.causal_lm.config import ModelConfig, preset
from tessera.common.models.causal_lm.model import build_model


def ours_from(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    cfg, _ = read_hf_config(tmp_path)
    model = build_model(cfg, seed=None)
    model.load_state_dict(load_hf_weights(tmp_path, cfg), strict=False)
    return model.eval(), cfg


def max_diff(ours, hf, tokens):
    with torch.no_grad():
        return (ours(tokens) - hf(tokens).logits).abs().max().item()


TOKENS = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers(tmp_path, name):
    family, over = CASES[name]
    hf = build(family, **over)
    ours, cfg = ours_from(hf, tmp_path)
    assert cfg.arch == family
    assert max_diff(ours, hf, TOKENS) < 1e-5 * hf(TOKENS).logits.abs().max().item()


def test_sliding_window_matters_and_is_per_layer(tmp_path):
    """With the window dropped (or put on every layer) the same weights give other logits."""
    hf = build("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1)
    ours, cfg = ours_from(hf, tmp_path)
    assert cfg.sliding_window_layers == [1] and cfg.window(0) is None and cfg.window(1) == 5
    for other in (cfg.model_copy(update={"sliding_window": None, "sliding_window_layers": None}),
                  cfg.model_copy(update={"sliding_window_layers": None})):
        twin = build_model(ModelConfig.model_validate(other.model_dump()), seed=None).eval()
        twin.load_state_dict(ours.state_dict())
        assert max_diff(twin, hf, TOKENS) > 1e-2


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
     "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
], ids=["dynamic", "yarn-mscale", "llama3"])
def test_rope_scalings_equal_transformers(tmp_path, rope):
    """Dynamic NTK past its original length too: 40 tokens against max_position_embeddings 24."""
    hf = build("llama", rope_parameters=rope, max_position_embeddings=24 if rope["rope_type"] == "dynamic" else 64)
    ours, cfg = ours_from(hf, tmp_path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == rope["rope_type"]
    assert max_diff(ours, hf, TOKENS) < 1e-5 * hf(TOKENS).logits.abs().max().item()
    plain = build_model(cfg.model_copy(update={"rope_scaling": None}), seed=None).eval()
    plain.load_state_dict(ours.state_dict())
    assert max_diff(plain, hf, TOKENS) > 1e-2


def test_qk_norm_and_head_dim_are_counted_and_tensor_parallel_keeps_norms_whole():
    cfg = preset("tiny", vocab_size=300, head_dim=24, qk_norm=True, attention_bias=["q", "k", "v"])
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    attn = model.layers["0"].attn
    assert attn.q_proj.weight.shape == (4 * 24, 64) and attn.q_norm.weight.shape == (24,)
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None


def test_bad_feature_configs_are_refused():
    with pytest.raises(ValueError, match="sliding_window_layers needs sliding_window"):
        preset("tiny", sliding_window_layers=[0])
    with pytest.raises(ValueError, match="layer 5"):
        preset("tiny", sliding_window=4, sliding_window_layers=[5])
    with pytest.raises(ValueError, match="unless head_dim is given"):
        preset("tiny", hidden_size=66)
    assert preset("tiny", hidden_size=66, head_dim=16).q_size == 64
