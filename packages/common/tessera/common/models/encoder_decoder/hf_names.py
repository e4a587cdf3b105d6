"""Tessera's T5 tensor names as transformers' T5ForConditionalGeneration names them."""

from __future__ import annotations

import re

_BLOCK = re.compile(r"(encoder|decoder)\.blocks\.(\d+)\.(.+)")
_BIAS = re.compile(r"(encoder|decoder)\.relative_attention_bias\.weight")
_PARTS = (("self_attn.q_proj.", "layer.0.SelfAttention.q."), ("self_attn.k_proj.", "layer.0.SelfAttention.k."),
          ("self_attn.v_proj.", "layer.0.SelfAttention.v."), ("self_attn.o_proj.", "layer.0.SelfAttention.o."),
          ("self_norm.", "layer.0.layer_norm."),
          ("cross_attn.q_proj.", "layer.1.EncDecAttention.q."), ("cross_attn.k_proj.", "layer.1.EncDecAttention.k."),
          ("cross_attn.v_proj.", "layer.1.EncDecAttention.v."), ("cross_attn.o_proj.", "layer.1.EncDecAttention.o."),
          ("cross_norm.", "layer.1.layer_norm."))
_MLP = (("mlp.gate_proj.", "DenseReluDense.wi_0."), ("mlp.up_proj.", "DenseReluDense.{wi}."),
        ("mlp.down_proj.", "DenseReluDense.wo."), ("mlp_norm.", "layer_norm."))


def hf_name(name: str, gated: bool) -> str:
    """The transformers name of Tessera tensor `name`. `gated`: whether the MLP has a gate (v1.1:
    its up projection is then `wi_1`, else `wi`)."""
    if (m := _BIAS.fullmatch(name)) is not None:
        return f"{m.group(1)}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    m = _BLOCK.fullmatch(name)
    if m is None:
        return name.replace("final_norm", "final_layer_norm")
    stack, i, rest = m.groups()
    for ours, theirs in _PARTS:
        if rest.startswith(ours):
            return f"{stack}.block.{i}.{theirs}{rest[len(ours):]}"
    mlp_layer = 2 if stack == "decoder" else 1
    for ours, theirs in _MLP:
        if rest.startswith(ours):
            theirs = theirs.format(wi="wi_1" if gated else "wi")
            return f"{stack}.block.{i}.layer.{mlp_layer}.{theirs}{rest[len(ours):]}"
    raise KeyError(name)
