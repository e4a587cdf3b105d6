"""Random tiny transformers models of every family Tessera maps, built at test time (shared by the
logits, round-trip and serving tests)."""

from __future__ import annotations

import torch

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)


def separated(hf):
    """Random biases and norm weights (transformers initialises them to 0 / 1, which would hide a
    dropped one); sharp attention (q/k x10) so positions and windows matter; a scaled head so that
    greedy choices are well separated."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias") or name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10.0)
        hf.get_output_embeddings().weight.mul_(20.0)
    return hf.eval()


def build(kind: str, **over):
    import transformers

    torch.manual_seed(0)
    cfg = dict(BASE)
    cls = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe",
           "llama": "Llama"}[kind]
    if kind in ("qwen3", "qwen3_moe"):
        cfg["head_dim"] = 24  # not hidden / heads
    if kind == "mixtral":
        cfg.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    if kind == "qwen3_moe":
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                   mlp_only_layers=[0])
    cfg.update(over)
    config = getattr(transformers, cls + "Config")(**cfg)
    return separated(getattr(transformers, cls + "ForCausalLM")(config))


# name -> (family, config overrides): every feature at least once, windows shorter than the prompts.
CASES = {
    "mistral-sliding-window": ("mistral", dict(sliding_window=6, head_dim=32)),
    "qwen2-qkv-bias-window-from-layer-1": ("qwen2", dict(use_sliding_window=True, sliding_window=5,
                                                         max_window_layers=1)),
    "qwen3-qk-norm-head-dim-yarn": ("qwen3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                                   "factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen3-attention-bias-linear-rope": ("qwen3", dict(attention_bias=True, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "mixtral": ("mixtral", dict(sliding_window=7)),
    "qwen3-moe-first-layer-dense": ("qwen3_moe", {}),
}
