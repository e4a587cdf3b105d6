"""The encoder-decoder's parallel plan: what tensor (and sequence) parallelism splits, applied in
place. The causal LM's splits (causal_lm/parallelize.py) for every attention (self and cross) and
MLP, as Megatron's T5 splits them.

Per block: q/k/v and the MLP's gate/up column-parallel (whole heads to one rank), o and down
row-parallel; each stack's relative-bias table [buckets, heads] split by heads (dim 1), so a rank's
bias covers its own heads; the shared embedding and an own head split by vocabulary rows (the tied
head's logits are then this rank's vocabulary slice). Norms replicated.

Sequence parallel: the residual streams are split along the sequence. Each pre-norm's output is
all-gathered once for the column layers reading it, and the encoder's final output once for every
decoder block's cross-attention keys and values (the gather's backward reduce-scatters their
summed partial gradients); row layers reduce-scatter back. The masks are built for the full
length (`T5Stack.sequence_shards`).

Pipeline parallel is refused (tessera.common.layout): Megatron cuts an encoder-decoder into
encoder and decoder stages that exchange the encoder's output; Tessera's pipeline cuts one stack.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from tessera.common.models.causal_lm.parallelize import (
    _ForkedDropout,
    _tag_replicated,
    split_attention,
    split_mlp,
    split_norm,
)
from tessera.common.models.encoder_decoder.model import T5Model
from tessera.common.models.kind import ParallelPlan
from tessera.common.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding, tag
from tessera.common.parallel.mappings import copy_to_tp, gather_seq
from tessera.common.parallel.random import TensorParallelRNG
from tessera.common.parallel.state import ParallelGroups


def _head_slice(param: nn.Parameter, group: dist.ProcessGroup) -> nn.Parameter:
    """This rank's heads (columns) of a relative-bias table, tagged split along dim 1."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cols = param.shape[1] // world
    new = nn.Parameter(param.detach()[:, rank * cols:(rank + 1) * cols].clone())
    tag(new, 1)
    return new


def parallelize_model(model: T5Model, groups: ParallelGroups, sequence_parallel: bool = False,
                      rng: TensorParallelRNG | None = None) -> T5Model:
    """Swap in tensor-parallel layers (slicing existing weights; meta stays meta). Returns `model`;
    every parameter is tagged with its shard dimension, also at tp == 1."""
    group = groups.tp_group
    sp = sequence_parallel and groups.tp > 1
    model.sequence_parallel = sp  # type: ignore[attr-defined]
    model.tp_group = group  # type: ignore[attr-defined]
    for stack in (model.encoder, model.decoder):
        stack.sequence_shards = groups.tp if sp else 1
        stack.relative_attention_bias.weight = _head_slice(stack.relative_attention_bias.weight, group)
        _tag_replicated(stack.final_norm, sp)
        for blk in stack.blocks:
            split_attention(blk.self_attn, groups, sp, rng)
            split_norm(blk.self_norm, groups, sp, gather=sp)
            if blk.cross_attn is not None and blk.cross_norm is not None:
                split_attention(blk.cross_attn, groups, sp, rng)
                split_norm(blk.cross_norm, groups, sp, gather=sp)
            split_norm(blk.mlp_norm, groups, sp, gather=split_mlp(blk.mlp, groups, sp))
            if sp and rng is not None:
                blk.dropout = _ForkedDropout(blk.dropout.p, rng)
        if sp and rng is not None:
            stack.dropout = _ForkedDropout(stack.dropout.p, rng)
    if sp:  # the encoder's output, whole, for every cross-attention's keys and values
        model.encoder.register_forward_hook(lambda _m, _i, out: gather_seq(out, group))
    model.shared = VocabParallelEmbedding.from_embedding(model.shared, group, sp)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, group, sp)
    return model


def parallel_logits(model: T5Model, hidden):  # type: ignore[no-untyped-def]
    """This rank's vocabulary slice of the logits [B, T, V/tp] from the decoder's final hidden
    states (sequence-sharded under SP), for the vocab-parallel cross-entropy
    (tessera.common.parallel.loss). An own head is column-parallel (it copies or expects the
    gathered input itself); the tied head multiplies by this rank's rows of `shared`, so its input
    is copied to the tensor group here (its gradient summed over it in backward)."""
    group = model.tp_group  # type: ignore[attr-defined]
    if model.sequence_parallel:  # type: ignore[attr-defined]
        hidden = gather_seq(hidden, group)
    elif model.lm_head is None:
        hidden = copy_to_tp(hidden, group)
    return model.head(hidden)


PLAN = ParallelPlan(
    column=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
    row=("o_proj", "down_proj"),
    vocab=("shared", "lm_head"),
    layers="blocks",
    first_stage=("shared",),
    last_stage=("lm_head",),
    tensor=parallelize_model,
)
