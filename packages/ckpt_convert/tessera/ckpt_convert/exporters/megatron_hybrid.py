"""Megatron-Core's hybrid `MambaModel` <-> Tessera's hybrid kind: tensor names and layouts of its
`torch_dist` checkpoints, both directions (used by `export --format megatron` and `import --format
megatron`).

Megatron's MambaStack saves one entry per layer under its global number (`decoder.layers.<i>.`,
not stacked along a layer axis as GPTModel's), with the layer's norm fused into its first linear
layer as Transformer Engine does (Megatron's mamba_stack_spec). Its MambaMixer saves the fused
in_proj and conv1d split into their parts (its sharded_state_dict's `_split_tensor_factory`), so a
torch_dist checkpoint holds them exactly as Tessera stores them. Per layer symbol:

    M  mixer.in_proj.layer_norm_weight          layers.i.norm.weight
       mixer.in_proj.weight.{z,x,B,C,dt}       layers.i.mixer.in_proj.{z,x,b,c,dt}.weight
       mixer.conv1d.{weight,bias}.{x,B,C}      layers.i.mixer.conv.{x,b,c}.{weight,bias}
       mixer.{dt_bias,A_log,D}, mixer.norm.weight, mixer.out_proj.weight   the same under layers.i.mixer.
    *  self_attention.linear_qkv.layer_norm_weight   layers.i.norm.weight
       self_attention.linear_qkv.weight        q/k/v_proj, rows grouped per query group (as GPTModel's)
       self_attention.linear_proj.weight       o_proj
    -  mlp.linear_fc1.layer_norm_weight        layers.i.norm.weight
       mlp.linear_fc1.{weight,bias}, mlp.linear_fc2.{weight,bias}   up_proj, down_proj
    E  pre_mlp_layernorm.weight                layers.i.norm.weight
       mlp.router.weight, mlp.router.expert_bias    router.weight, expert_bias
       mlp.experts.experts.linear_fc{1,2}.weight    experts.up_proj [E, f, d], experts.down_proj [E, d, f]
       mlp.shared_experts.linear_fc{1,2}.weight     shared.up_proj.weight, shared.down_proj.weight
    embedding.word_embeddings.weight, decoder.final_norm.weight, output_layer.weight (absent when tied)

The expert keys are those of Megatron's SequentialMLP, which its TEGroupedMLP's checkpoints share.
Megatron builds no projection biases in its mixer and always a convolution bias: other settings
are refused. Megatron pads the vocabulary (embedding and output rows) to a multiple of 128 x its
tensor-parallel size; Tessera's hybrid models are unpadded, so export adds zero rows and import
drops them.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.common.errors import UserError
from tessera.common.hf.rules import Rule, rows
from tessera.common.models.hybrid.config import HybridConfig

VOCAB_MULTIPLE = 128  # Megatron's --make-vocab-size-divisible-by default
# A stacked transformer layer's linear layers with `_extra_state` (GPTModel's and BertModel's).
EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
_MAMBA_PARTS = {"z": "z", "x": "x", "b": "B", "c": "C", "dt": "dt"}
_CONV_PARTS = {"x": "x", "b": "B", "c": "C"}


def padded_rows(cfg: HybridConfig, tp: int) -> int:
    """Megatron's padded vocabulary at tensor-parallel size `tp`."""
    multiple = VOCAB_MULTIPLE * tp
    return -(-cfg.vocab_size // multiple) * multiple


def check_megatron(cfg: HybridConfig, where: str = "model config") -> None:
    """Refuse what Megatron's MambaModel cannot hold, in one line naming the field."""
    m = cfg.mamba
    if m is not None and "M" in cfg.pattern:
        if m.bias:
            raise UserError(f"{where}: mamba.bias=true has no Megatron-Core equivalent (its MambaMixer builds no "
                            "projection biases)")
        if not m.conv_bias:
            raise UserError(f"{where}: mamba.conv_bias=false has no Megatron-Core equivalent (its MambaMixer always "
                            "has a convolution bias)")


def _qkv(cfg: HybridConfig) -> tuple[int, int, int]:
    hd, kv = cfg.attention_head_dim, cfg.kv_heads
    assert hd is not None and kv is not None and cfg.num_heads is not None
    return kv, cfg.num_heads // kv, hd


def fuse_qkv(kv_heads: int, per_group: int, head_dim: int):
    """Combine: q, k, v -> Megatron's linear_qkv rows (GPTModel's and MambaModel's attention): per
    query group g, [the group's per_group query heads | k_g | v_g], head_dim rows each."""
    def fuse(ts: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = ts
        rest = q.shape[1:]
        return torch.cat([q.reshape(kv_heads, per_group * head_dim, *rest), k.reshape(kv_heads, head_dim, *rest),
                          v.reshape(kv_heads, head_dim, *rest)], dim=1).reshape(-1, *rest)
    return fuse


def split_qkv(kv_heads: int, per_group: int, head_dim: int, part: int):
    """Combine: the inverse of fuse_qkv for one of q (0), k (1), v (2)."""
    bounds = [0, per_group * head_dim, (per_group + 1) * head_dim, (per_group + 2) * head_dim]

    def take(ts: list[torch.Tensor]) -> torch.Tensor:
        w = ts[0]
        groups = w.reshape(kv_heads, (per_group + 2) * head_dim, *w.shape[1:])
        return groups[:, bounds[part]:bounds[part + 1]].reshape(-1, *w.shape[1:])
    return take


def export_rules(cfg: HybridConfig, shapes: dict[str, tuple[int, ...]], vocab_rows: int) -> list[Rule]:
    """Megatron tensor <- Tessera tensors, one rule per Megatron tensor. `shapes`: the Tessera
    model's tensors (every one must be read by some rule: checked)."""
    check_megatron(cfg)
    d = cfg.hidden_size
    out: list[Rule] = []

    def rename(theirs: str, ours: str) -> None:
        out.append(Rule(theirs, (ours,), shapes[ours]))

    def pad(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([ts[0], ts[0].new_zeros(vocab_rows - cfg.vocab_size, d)])

    out.append(Rule("embedding.word_embeddings.weight", ("embed_tokens.weight",), (vocab_rows, d), pad,
                    ((cfg.vocab_size, d),)))
    for i, symbol in enumerate(cfg.pattern):
        t, m = f"layers.{i}.", f"decoder.layers.{i}."
        x = t + "mixer."
        if symbol == "M":
            rename(m + "mixer.in_proj.layer_norm_weight", t + "norm.weight")
            for ours, theirs in _MAMBA_PARTS.items():
                rename(m + f"mixer.in_proj.weight.{theirs}", x + f"in_proj.{ours}.weight")
            for ours, theirs in _CONV_PARTS.items():
                for kind in ("weight", "bias"):
                    rename(m + f"mixer.conv1d.{kind}.{theirs}", x + f"conv.{ours}.{kind}")
            for name in ("dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"):
                rename(m + f"mixer.{name}", x + name)
        elif symbol == "*":
            rename(m + "self_attention.linear_qkv.layer_norm_weight", t + "norm.weight")
            sources = tuple(x + f"{p}_proj.weight" for p in "qkv")
            rows_ = sum(shapes[s][0] for s in sources)
            out.append(Rule(m + "self_attention.linear_qkv.weight", sources, (rows_, d), fuse_qkv(*_qkv(cfg)),
                            tuple(shapes[s] for s in sources)))
            rename(m + "self_attention.linear_proj.weight", x + "o_proj.weight")
        elif symbol == "-":
            rename(m + "mlp.linear_fc1.layer_norm_weight", t + "norm.weight")
            for theirs, ours in (("linear_fc1", "up_proj"), ("linear_fc2", "down_proj")):
                for kind in ("weight", "bias"):
                    if x + f"{ours}.{kind}" in shapes:
                        rename(m + f"mlp.{theirs}.{kind}", x + f"{ours}.{kind}")
        else:
            rename(m + "pre_mlp_layernorm.weight", t + "norm.weight")
            rename(m + "mlp.router.weight", x + "router.weight")
            if x + "expert_bias" in shapes:
                rename(m + "mlp.router.expert_bias", x + "expert_bias")
            rename(m + "mlp.experts.experts.linear_fc1.weight", x + "experts.up_proj")
            rename(m + "mlp.experts.experts.linear_fc2.weight", x + "experts.down_proj")
            if x + "shared.up_proj.weight" in shapes:
                rename(m + "mlp.shared_experts.linear_fc1.weight", x + "shared.up_proj.weight")
                rename(m + "mlp.shared_experts.linear_fc2.weight", x + "shared.down_proj.weight")
    rename("decoder.final_norm.weight", "final_norm.weight")
    if not cfg.tie_embeddings:
        out.append(Rule("output_layer.weight", ("lm_head.weight",), (vocab_rows, d), pad, ((cfg.vocab_size, d),)))
    unread = sorted(set(shapes) - {s for r in out for s in r.sources})
    if unread:
        raise UserError(f"model config: tensor {unread[0]!r} has no place in Megatron-Core's MambaModel "
                        f"({len(unread)} such)")
    return out


def import_rules(cfg: HybridConfig, shapes: dict[str, tuple[int, ...]], vocab_rows: int) -> list[Rule]:
    """Tessera tensor <- Megatron tensor: the inverse of export_rules (padding rows dropped)."""
    out = []
    for r in export_rules(cfg, shapes, vocab_rows):
        if r.combine is None:
            out.append(Rule(r.sources[0], (r.target,), r.shape))
        elif len(r.sources) == 3:  # linear_qkv
            out.extend(Rule(s, (r.target,), shapes[s], split_qkv(*_qkv(cfg), part), (r.shape,))
                       for part, s in enumerate(r.sources))
        else:  # the vocabulary's padded rows
            out.append(Rule(r.sources[0], (r.target,), shapes[r.sources[0]], rows(0, cfg.vocab_size, False),
                            (r.shape,)))
    return out


def extra_state_keys(cfg: HybridConfig) -> list[str]:
    """The `_extra_state` entries Megatron writes for its linear layers (an empty [None] each for
    local, non-FP8 layers); its loader expects them."""
    keys = []
    for i, symbol in enumerate(cfg.pattern):
        m = f"decoder.layers.{i}."
        modules: dict[str, Any] = {
            "M": ("mixer.in_proj", "mixer.out_proj"), "*": ("self_attention.linear_proj", "self_attention.linear_qkv"),
            "-": ("mlp.linear_fc1", "mlp.linear_fc2")}
        if symbol in modules:
            keys += [f"{m}{name}._extra_state/shard_0_1" for name in modules[symbol]]
            continue
        assert cfg.moe is not None
        e = cfg.moe.num_experts
        keys += [f"{m}mlp.experts.experts.{fc}._extra_state/shard_{j}_{e}" for j in range(e)
                 for fc in ("linear_fc1", "linear_fc2")]
        if cfg.moe.shared_size:
            keys += [f"{m}mlp.shared_experts.{fc}._extra_state/shard_0_1" for fc in ("linear_fc1", "linear_fc2")]
    if not cfg.tie_embeddings:
        keys.append("output_layer._extra_state/shard_0_1")
    return keys
