"""The causal LM's parallel plan: what tensor (and sequence) parallelism splits, applied in place, and
where pipeline stages cut.

Per block: q/k/v, gate and up become column-parallel (split by output rows: whole query heads,
and the key/value heads of the same query groups, go to one rank), o and down row-parallel. The
token embedding and an untied head are split by vocabulary rows. Norms stay replicated; the
per-head q/k norms (Qwen3) too: each rank normalises whole heads, so only their weight gradients
are partial (summed over the tensor group like sequence-parallel norms').

Mixture-of-experts MLPs are not split over tensor ranks (experts' own tensor size is 1; expert
parallel shards them instead). Without sequence parallel every tensor rank runs the MoE on the
full (replicated) sequence; with it, on its own sequence chunk (routing is per token), so the
norm's output is not gathered and the MoE's weight gradients are partial.

Multi-head latent attention (DeepSeek-V3, `split_mla`): q_proj / q_b_proj and kv_b_proj column-
parallel by heads, o_proj row-parallel, the down projections and latent norms replicated.

Grouped-query attention: query heads h*H/tp..(h+1)*H/tp-1 on rank h use exactly key/value heads
h*KV/tp..(h+1)*KV/tp-1, so contiguous slices of q_proj and k_proj/v_proj rows line up. This needs
`tp` to divide the number of key/value heads; tensor-parallel sizes above the kv-head count are
refused (replicating kv heads would store them in a layout-dependent way).

With sequence parallel, the residual stream between blocks is split along the sequence
([B, T/tp, d]); each norm's output is all-gathered once for the column layers reading it, row
layers reduce-scatter back, and norms run on the local chunk (their weight gradients are then
partial and all-reduced over the tensor group by the gradient code, which reads the
`sequence_parallel_partial` tag).

Pipeline stages cut between the entries of `layers` (global layer numbers); the first stage keeps
the embeddings, the last the final norm and the head (tessera.trainer.parallel.pipeline).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.common.layers.mla import MLA
from tessera.common.layers.moe import MoE
from tessera.common.models.causal_lm.model import Transformer
from tessera.common.models.kind import ParallelPlan
from tessera.common.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    tag,
)
from tessera.common.parallel.loss import vocab_parallel_cross_entropy
from tessera.common.parallel.mappings import copy_to_tp, gather_seq, scatter_seq
from tessera.common.parallel.random import TensorParallelRNG
from tessera.common.parallel.state import ParallelGroups
from tessera.common.parallel.tensor_parallel import parallel_logits


class _ForkedDropout(nn.Dropout):
    """Dropout drawn from the tensor-parallel generator (activations differ across tensor ranks)."""

    def __init__(self, p: float, rng: TensorParallelRNG):
        super().__init__(p)
        self.rng = rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with self.rng.fork():
            return super().forward(x)


def _forked_core(core, rng: TensorParallelRNG):
    def run(q, k, v, attn_mask=None):
        with rng.fork():
            return core(q, k, v, attn_mask)
    return run


def _tag_replicated(module: nn.Module, partial: bool) -> None:
    for p in module.parameters(recurse=False):
        tag(p, None, partial=partial)


def split_attention(attn: nn.Module, groups: ParallelGroups, sp: bool, rng: TensorParallelRNG | None) -> None:
    """Self-attention's tensor-parallel split, in place: q/k/v column-, o row-parallel, per-head
    q/k norms replicated (their gradients partial over the tensor group), dropout forked. Shared
    with every kind built on the same attention layer (the hybrid's `*`)."""
    group = groups.tp_group
    attn.q_proj = ColumnParallelLinear.from_linear(attn.q_proj, group, sp)
    attn.k_proj = ColumnParallelLinear.from_linear(attn.k_proj, group, sp)
    attn.v_proj = ColumnParallelLinear.from_linear(attn.v_proj, group, sp)
    attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, group, sp)
    for norm in (attn.q_norm, attn.k_norm):
        if norm is not None:
            _tag_replicated(norm, groups.tp > 1)
    if rng is not None and groups.tp > 1:
        attn.core = _forked_core(attn.core, rng)  # attention dropout acts on this rank's heads


def split_mla(attn: MLA, groups: ParallelGroups, sp: bool, rng: TensorParallelRNG | None) -> None:
    """Multi-head latent attention split as Megatron splits it, in place: q_proj (or q_b_proj) and
    kv_b_proj column-parallel by heads, o_proj row-parallel; the down projections q_a_proj and
    kv_a_proj and the latent norms replicated. The shared RoPE key (kv_a_proj's last rows) feeds
    only this rank's heads, so without sequence parallel its gradient is all-reduced where it leaves
    the replicated part (copy_to_tp), as the column layers do for their inputs; with it every
    gradient into the replicated part is partial, so are its weights' (summed over the group)."""
    group = groups.tp_group
    if attn.q_proj is not None:
        attn.q_proj = ColumnParallelLinear.from_linear(attn.q_proj, group, sp)
    else:
        attn.q_b_proj = ColumnParallelLinear.from_linear(attn.q_b_proj, group, sp)
        for module in (attn.q_a_proj, attn.q_a_norm):
            _tag_replicated(module, sp)
    attn.kv_b_proj = ColumnParallelLinear.from_linear(attn.kv_b_proj, group, sp)
    attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, group, sp)
    for module in (attn.kv_a_proj, attn.kv_a_norm):
        _tag_replicated(module, sp)
    if groups.tp > 1 and not sp:
        latent = attn.latent

        def tp_latent(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            c, k_rot = latent(x)
            return c, copy_to_tp(k_rot, group)
        attn.latent = tp_latent  # type: ignore[method-assign]
    if rng is not None and groups.tp > 1:
        attn.core = _forked_core(attn.core, rng)  # type: ignore[method-assign]


def split_mtp(model: Transformer, groups: ParallelGroups, sp: bool, rng: TensorParallelRNG | None) -> None:
    """The multi-token-prediction depths: each block split as the model's, enorm / hnorm / eh_proj /
    head_norm replicated (partial gradients under sequence parallel: they see this rank's chunk),
    and the depth's loss through the vocabulary-parallel head (the hidden gathered along the
    sequence under sequence parallel, as for the main head)."""
    assert model.mtp is not None
    for layer in model.mtp.layers.values():
        split_mla(layer.attn, groups, sp, rng) if isinstance(layer.attn, MLA) else split_attention(layer.attn, groups, sp, rng)
        gather_mlp = split_mlp(layer.mlp, groups, sp)
        split_norm(layer.attn_norm, groups, sp, gather=sp)
        split_norm(layer.mlp_norm, groups, sp, gather=gather_mlp)
        for module in (layer.enorm, layer.hnorm, layer.eh_proj, layer.head_norm):
            _tag_replicated(module, sp)
    group = groups.tp_group

    def token_loss(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = parallel_logits(hidden, model.output_weight(), model)
        counted = target != -100
        per_token = vocab_parallel_cross_entropy(logits, target.masked_fill(~counted, 0), group)
        return (per_token * counted).sum() / counted.sum()
    model.mtp.token_loss = token_loss


def split_mlp(mlp: nn.Module, groups: ParallelGroups, sp: bool) -> bool:
    """A dense MLP's split (gate/up column-, down row-parallel) or an MoE's (not split over tensor
    ranks; its weights' gradients partial under sequence parallel), in place. Returns whether
    the input must be gathered along the sequence first (dense under SP; an MoE routes its own
    chunk)."""
    group = groups.tp_group
    if isinstance(mlp, MoE):
        for p in mlp.parameters():
            tag(p, None, partial=sp)
        return False
    if mlp.gated:
        mlp.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, group, sp)
    mlp.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, group, sp)
    mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, group, sp)
    return sp


def split_norm(norm: nn.Module, groups: ParallelGroups, sp: bool, gather: bool) -> None:
    """A pre-norm feeding tensor-parallel layers: replicated (gradients partial under SP) and,
    with `gather`, its sequence-sharded output all-gathered once for every column layer reading
    it (one collective and one saved full-sequence activation instead of one per projection)."""
    _tag_replicated(norm, sp)
    if gather:
        group = groups.tp_group
        norm.register_forward_hook(lambda _m, _i, out: gather_seq(out, group))


def split_ends(model: nn.Module, groups: ParallelGroups, sp: bool) -> None:
    """The token embedding (vocab-parallel), the final norm (replicated) and an untied head
    (column-parallel), whichever this stage holds; records the choice of sequence parallel and
    the tensor group on `model` for `parallel_logits` and the pipeline stage."""
    group = groups.tp_group
    model.sequence_parallel = sp  # type: ignore[attr-defined]
    model.tp_group = group  # type: ignore[attr-defined]
    if model.embed_tokens is not None:
        model.embed_tokens = VocabParallelEmbedding.from_embedding(model.embed_tokens, group, sp)
    if model.final_norm is not None:
        _tag_replicated(model.final_norm, sp)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, group, sp)


def parallelize_model(model: Transformer, groups: ParallelGroups, sequence_parallel: bool = False,
                      rng: TensorParallelRNG | None = None) -> Transformer:
    """Swap in tensor-parallel layers (slicing existing weights; meta stays meta). Returns `model`.

    Works on a pipeline stage too (absent modules are skipped). Every parameter is tagged with
    its shard dimension, including when tp == 1, so checkpoint and gradient code need no cases.
    `model.sequence_parallel` records the choice for `parallel_logits` and the pipeline stage.
    """
    group = groups.tp_group
    sp = sequence_parallel and groups.tp > 1
    for block in model.layers.values():
        if isinstance(block.attn, MLA):
            split_mla(block.attn, groups, sp, rng)
        else:
            split_attention(block.attn, groups, sp, rng)
        gather_mlp = split_mlp(block.mlp, groups, sp)
        split_norm(block.attn_norm, groups, sp, gather=sp)
        split_norm(block.mlp_norm, groups, sp, gather=gather_mlp)
        if rng is not None and groups.tp > 1 and sp:
            block.dropout = _ForkedDropout(block.dropout.p, rng)  # residual dropout on its chunk
    if model.mtp is not None:
        split_mtp(model, groups, sp, rng)
    split_ends(model, groups, sp)
    if model.pos_embed is not None:
        _tag_replicated(model.pos_embed, False)
        if sp:
            # The token embedding already comes out sequence-sharded; shard positions to match.
            model.pos_embed.register_forward_hook(lambda _m, _i, out: scatter_seq(out, group))
    if sp and rng is not None:
        model.dropout = _ForkedDropout(model.dropout.p, rng)
    return model


PLAN = ParallelPlan(
    column=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj"),
    row=("o_proj", "down_proj"),
    vocab=("embed_tokens", "lm_head"),
    layers="layers",
    first_stage=("embed_tokens", "pos_embed"),
    last_stage=("final_norm", "lm_head", "mtp"),
    tensor=parallelize_model,
)
