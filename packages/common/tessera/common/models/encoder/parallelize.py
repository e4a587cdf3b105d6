"""The encoder's parallel plan: what tensor (and sequence) parallelism splits, applied in place, and
where pipeline stages cut. The causal LM's splits (causal_lm/parallelize.py), for post-norm blocks.

Per block: q/k/v and up become column-parallel (whole heads to one rank), o and down
row-parallel; the word embedding is split by vocabulary rows, and so are the MLM decoder's bias
(and its weight when untied), so a rank's logits are its vocabulary slice plus its bias slice.
Position and token-type embeddings, LayerNorms, the pooler, the MLM transform and the binary head
are replicated (as Megatron's BERT keeps them).

With sequence parallel the residual stream is split along the sequence ([B, T/tp, d]). A post-norm
block reads the residual itself, so the block's input is all-gathered in front of the attention
and in front of the MLP (each feeding column layers, whose partial input gradients the gather's
backward reduce-scatters); row layers reduce-scatter back; the norms, the MLM transform and the
embeddings' sum run on the local chunk (their weight gradients then partial, summed over the
tensor group by the gradient code). The pooler reads the first token, which one rank holds: its
input is gathered with a backward that keeps each rank's own slice of the (replicated) gradient.

Pipeline stages cut between the entries of `layers`; the first stage keeps the embeddings, the
last the heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.common.models.causal_lm.parallelize import (
    _ForkedDropout,
    _tag_replicated,
    split_attention,
    split_mlp,
)
from tessera.common.models.encoder.model import EncoderModel
from tessera.common.models.kind import ParallelPlan
from tessera.common.parallel.layers import VocabParallelEmbedding, tag
from tessera.common.parallel.mappings import gather_seq, scatter_seq
from tessera.common.parallel.random import TensorParallelRNG
from tessera.common.parallel.state import ParallelGroups


class _GatherReplicated(torch.autograd.Function):
    """All-gather along the sequence whose backward takes this rank's slice of the gradient, for a
    computation every tensor rank repeats (its gradient is the same on each: not to be summed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return gather_seq(x, group).detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(world, dim=1)[rank].contiguous(), None


def _gather_input(group: dist.ProcessGroup):
    def hook(_module: nn.Module, args: tuple) -> tuple:
        return (gather_seq(args[0], group), *args[1:])
    return hook


def parallelize_model(model: EncoderModel, groups: ParallelGroups, sequence_parallel: bool = False,
                      rng: TensorParallelRNG | None = None) -> EncoderModel:
    """Swap in tensor-parallel layers (slicing existing weights; meta stays meta). Returns `model`.
    Works on a pipeline stage (absent modules skipped); every parameter is tagged with its shard
    dimension, also at tp == 1."""
    group = groups.tp_group
    sp = sequence_parallel and groups.tp > 1
    model.sequence_parallel = sp  # type: ignore[attr-defined]
    model.tp_group = group  # type: ignore[attr-defined]
    for block in model.layers.values():
        split_attention(block.attn, groups, sp, rng)
        split_mlp(block.mlp, groups, sp)
        _tag_replicated(block.attn_norm, sp)
        _tag_replicated(block.mlp_norm, sp)
        if sp:
            block.attn.register_forward_pre_hook(_gather_input(group))
            block.mlp.register_forward_pre_hook(_gather_input(group))
            if rng is not None:
                block.dropout = _ForkedDropout(block.dropout.p, rng)
    if model.embed_tokens is not None:
        model.embed_tokens = VocabParallelEmbedding.from_embedding(model.embed_tokens, group, sp)
    for emb in (model.pos_embed, model.token_type_embed):
        if emb is not None:
            # Not partial: with SP the scatter below gathers its gradient back whole on every rank.
            _tag_replicated(emb, False)
            if sp:  # the word embedding comes out sequence-sharded; shard these to match
                emb.register_forward_hook(lambda _m, _i, out: scatter_seq(out, group))
    if model.embed_norm is not None:
        _tag_replicated(model.embed_norm, sp)
    if getattr(model, "final_norm", None) is not None:  # pre-LN: runs on the local chunk, as the block norms
        _tag_replicated(model.final_norm, sp)
    if sp and rng is not None:
        model.dropout = _ForkedDropout(model.dropout.p, rng)
    if model.pooler is not None:
        _tag_replicated(model.pooler.dense, False)
        if sp:
            model.pooler.register_forward_pre_hook(lambda _m, args: (_GatherReplicated.apply(args[0], group),))
    if model.mlm_head is not None:
        head = model.mlm_head
        _tag_replicated(head.dense, sp)
        _tag_replicated(head.norm, sp)
        head.decoder.bias = _vocab_slice(head.decoder.bias, group)
        if head.decoder.weight is not None:
            head.decoder.weight = _vocab_slice(head.decoder.weight, group)
    if model.binary_head is not None:
        _tag_replicated(model.binary_head, False)
    return model


def _vocab_slice(param: nn.Parameter, group: dist.ProcessGroup) -> nn.Parameter:
    """This rank's rows of a vocabulary tensor (meta stays meta), tagged split along dim 0."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if param.shape[0] % world:
        raise ValueError(f"vocabulary rows {param.shape[0]} not divisible by tensor-parallel size {world}")
    rows = param.shape[0] // world
    new = nn.Parameter(param.detach()[rank * rows:(rank + 1) * rows].clone())
    tag(new, 0)
    return new


PLAN = ParallelPlan(
    column=("q_proj", "k_proj", "v_proj", "up_proj"),
    row=("o_proj", "down_proj"),
    vocab=("embed_tokens", "decoder"),
    layers="layers",
    first_stage=("embed_tokens", "pos_embed", "token_type_embed", "embed_norm"),
    last_stage=("final_norm", "pooler", "mlm_head", "binary_head"),
    tensor=parallelize_model,
)
