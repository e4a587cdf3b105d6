"""The hybrid kind's parallel plan: what tensor (and sequence) parallelism splits, applied in place,
and where pipeline stages cut.

Mamba-2 mixers split as Megatron-Core's MambaMixer does: each tensor rank holds num_heads / tp
whole heads and num_groups / tp whole groups (heads h*H/tp.. on rank h use exactly groups
h*G/tp.., since a group's heads are consecutive), so
* in_proj.{z, x, dt} are column-parallel over heads (z and x: head_dim channels per head) and
  in_proj.{b, c} over groups (state_size channels per group): each rank's slice of every part is
  its own heads' or groups' block, a contiguous one since the parts are stored split;
* the convolutions conv.{x, b, c} (depthwise: one filter per channel), dt_bias, A_log and D are
  cut to the rank's channels and heads (`tp_shard_dim` 0);
* the gated RMSNorm normalises per group of inner_size / num_groups channels: a rank holds whole
  groups, so it normalises its own channels alone, its weight cut like the channels;
* out_proj is row-parallel (partial sums over heads, all-reduced or reduce-scattered).
The mixer's `m` becomes the rank's view (num_heads / tp heads, num_groups / tp groups), so its
forward, decoding step and states run unchanged on the rank's share. `validate_layout` refuses a
tensor size that does not divide mamba.num_heads or mamba.num_groups.

Attention (`*`), MLP (`-`) and MoE (`E`) layers are split by the causal LM's plan
(causal_lm.parallelize: split_attention, split_mlp), as are the embedding, final norm and head;
sequence parallel as there: the residual stream is [B, T/tp, d] between layers, each layer's
norm output is all-gathered once for the projections reading it (the mixer's five, q/k/v, up),
row layers reduce-scatter back; an MoE routes its own chunk (no gather).

Pipeline stages cut between any two entries of `layers` (global layer numbers, any pattern
symbols); the first stage keeps the embedding, the last the final norm and head.
"""

from __future__ import annotations

from torch import nn

from tessera.common.models.causal_lm.parallelize import split_attention, split_ends, split_mlp, split_norm
from tessera.common.models.hybrid.mamba import MambaMixer
from tessera.common.models.hybrid.model import HybridModel
from tessera.common.models.kind import ParallelPlan
from tessera.common.parallel.layers import ColumnParallelLinear, RowParallelLinear, tag
from tessera.common.parallel.random import TensorParallelRNG
from tessera.common.parallel.state import ParallelGroups

# Per-head or per-channel parameters of a mixer, cut along dim 0 to the rank's heads / channels.
_MIXER_SLICED = ("dt_bias", "A_log", "D")


def _keep_rows(module: nn.Module, name: str, tp: int, rank: int) -> None:
    """Replace parameter `name` by this rank's dim-0 chunk (meta stays meta), tagged as split."""
    full = getattr(module, name)
    if full is None:
        return
    part = nn.Parameter(full.detach().chunk(tp, dim=0)[rank].clone(), requires_grad=full.requires_grad)
    tag(part, 0)
    setattr(module, name, part)


def split_mixer(mixer: MambaMixer, groups: ParallelGroups, sp: bool) -> None:
    """A Mamba-2 mixer's tensor-parallel split, in place (see the module docstring)."""
    tp, rank, group = groups.tp, groups.tp_rank, groups.tp_group
    m = mixer.m
    for part, lin in list(mixer.in_proj.items()):
        mixer.in_proj[part] = ColumnParallelLinear.from_linear(lin, group, sp)
    for conv in mixer.conv.values():
        _keep_rows(conv, "weight", tp, rank)
        _keep_rows(conv, "bias", tp, rank)
    for name in _MIXER_SLICED:
        _keep_rows(mixer, name, tp, rank)
    _keep_rows(mixer.norm, "weight", tp, rank)
    mixer.out_proj = RowParallelLinear.from_linear(mixer.out_proj, group, sp)
    mixer.m = m.model_copy(update={"num_heads": m.num_heads // tp, "num_groups": m.num_groups // tp})


def parallelize_model(model: HybridModel, groups: ParallelGroups, sequence_parallel: bool = False,
                      rng: TensorParallelRNG | None = None) -> HybridModel:
    """Swap in tensor-parallel layers (slicing existing weights; meta stays meta). Returns `model`.

    Works on a pipeline stage (absent modules are skipped) and at tp == 1 (every parameter is
    tagged, so checkpoint and gradient code need no cases), as the causal LM's."""
    sp = sequence_parallel and groups.tp > 1
    for block in model.layers.values():
        if block.symbol == "M":
            split_mixer(block.mixer, groups, sp)
            gather = sp
        elif block.symbol == "*":
            split_attention(block.mixer, groups, sp, rng)
            gather = sp
        else:
            gather = split_mlp(block.mixer, groups, sp)
        split_norm(block.norm, groups, sp, gather=gather)
    split_ends(model, groups, sp)
    return model


PLAN = ParallelPlan(
    column=("in_proj.z", "in_proj.x", "in_proj.b", "in_proj.c", "in_proj.dt", "q_proj", "k_proj", "v_proj",
            "gate_proj", "up_proj"),
    row=("out_proj", "o_proj", "down_proj"),
    vocab=("embed_tokens", "lm_head"),
    layers="layers",
    first_stage=("embed_tokens",),
    last_stage=("final_norm", "lm_head"),
    tensor=parallelize_model,
)
