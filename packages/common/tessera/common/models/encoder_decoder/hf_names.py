"""Tessera's T5 tensor names as transformers' T5ForConditionalGeneration names them (the base of
the HF adapter, which is not built yet)."""

from __future__ import annotations

import re

_BLOCK = re.compile(r"(encoder|decoder)\.blocks\.(\d+)\.(.+)")


def hf_name(name: str) -> str:
    m = _BLOCK.fullmatch(name)
    if m is None:
        return name.replace("final_norm", "final_layer_norm")
    stack, i, rest = m.groups()
    dec = stack == "decoder"
    mlp_layer = 2 if dec else 1
    for ours, theirs in (("self_attn.", "layer.0.SelfAttention."), ("self_norm.", "layer.0.layer_norm."),
                         ("cross_attn.", "layer.1.EncDecAttention."), ("cross_norm.", "layer.1.layer_norm."),
                         ("mlp.", f"layer.{mlp_layer}.DenseReluDense."), ("mlp_norm.", f"layer.{mlp_layer}.layer_norm.")):
        if rest.startswith(ours):
            return f"{stack}.block.{i}.{theirs}{rest[len(ours):]}"
    raise KeyError(name)
