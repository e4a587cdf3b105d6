"""The vision-language (LLaVA) parallel plan: what tensor (and sequence) parallelism splits, applied
in place, and where pipeline stages cut. Built from the causal LM's splits, not beside them.

Vision tower: each block's attention and MLP split as the causal LM's (`split_attention`,
`split_mlp`: q/k/v and up column-parallel by whole heads, o and down row-parallel); its patch
convolution, class and position embeddings, LayerNorms and SigLIP's pooling head are replicated.
The tower never runs sequence parallel: its sequence (the patches, plus CLIP's class token, e.g.
577) rarely divides the tensor size and is short, so its residual stream stays whole on every
rank and its replicated weights' gradients are whole too (not partial).

Projector: column then row (linear_1 split by output rows, the activation on this rank's slice,
linear_2 by input columns, all-reduced), the split of an MLP: each rank stores and multiplies
1/tp of it for one all-reduce, where replicating it would keep the whole projector (d_vision x
d_text + d_text²) on every rank. Its input is the tower's whole output, so it never runs SP.

Language model: the causal LM's own plan (causal_lm.parallelize.parallelize_model), except that
its token embedding is vocabulary-parallel without the sequence scatter: the image features must
be written over the image tokens of the whole sequence first. Under sequence parallel the merged
embeddings are then scattered along the sequence where they enter the language model (and the
default positions span the whole sequence), so its blocks, final norm and head run sequence
parallel as the causal LM's do.

Pipeline: the tower and the projector live on the first stage with the text embedding
(`first_stage`); the language model's layers are cut by the pipeline (`layers`, global layer
numbers), its final norm and head on the last stage.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.common.models.causal_lm.parallelize import (
    _tag_replicated,
    split_attention,
    split_mlp,
)
from tessera.common.models.causal_lm.parallelize import parallelize_model as parallelize_language_model
from tessera.common.models.kind import ParallelPlan
from tessera.common.models.vision_language.model import VisionLanguageModel
from tessera.common.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tessera.common.parallel.mappings import scatter_seq
from tessera.common.parallel.random import TensorParallelRNG
from tessera.common.parallel.state import ParallelGroups


def split_tower(tower: nn.Module, groups: ParallelGroups, rng: TensorParallelRNG | None) -> None:
    """The vision tower's blocks split like the causal LM's (never sequence parallel); every other
    tower weight replicated with whole gradients."""
    for block in tower.layers.values():
        split_attention(block.attn, groups, False, rng)
        split_mlp(block.mlp, groups, False)
    split = {id(p) for block in tower.layers.values() for m in (block.attn, block.mlp) for p in m.parameters()}
    for module in tower.modules():
        if not any(id(p) in split for p in module.parameters(recurse=False)):
            _tag_replicated(module, False)


def split_projector(projector: nn.Module, groups: ParallelGroups) -> None:
    group = groups.tp_group
    projector.linear_1 = ColumnParallelLinear.from_linear(projector.linear_1, group, False)
    projector.linear_2 = RowParallelLinear.from_linear(projector.linear_2, group, False)


def _scatter_embeddings(group):
    """Pre-hook of the language model under SP: the merged whole-sequence embeddings (float input)
    to this rank's sequence chunk, and default positions over the whole sequence."""
    def hook(module: nn.Module, args: tuple) -> tuple | None:
        h = args[0]
        # Only the merged embeddings of the stage that embeds (the tied head's stage drops its
        # embedding after the cut and receives hidden states already scattered).
        if not h.is_floating_point() or module.embed_tokens is None:
            return None
        positions = args[1] if len(args) > 1 and args[1] is not None else torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        return (scatter_seq(h, group), positions, *args[2:])
    return hook


def parallelize_model(model: VisionLanguageModel, groups: ParallelGroups, sequence_parallel: bool = False,
                      rng: TensorParallelRNG | None = None) -> VisionLanguageModel:
    """Swap in tensor-parallel layers (slicing existing weights; meta stays meta). Returns `model`.
    Works on a pipeline stage (an absent tower, projector or embedding is skipped); every parameter
    is tagged with its shard dimension, also at tp == 1."""
    sp = sequence_parallel and groups.tp > 1
    lm = model.language_model
    embed = lm.embed_tokens
    lm.embed_tokens = None  # split below without the sequence scatter (the features go in first)
    parallelize_language_model(lm, groups, sequence_parallel, rng)
    if embed is not None:
        lm.embed_tokens = VocabParallelEmbedding.from_embedding(embed, groups.tp_group, False)
        if sp:
            lm.register_forward_pre_hook(_scatter_embeddings(groups.tp_group))
    if model.vision is not None:
        split_tower(model.vision, groups, rng)
    if model.projector is not None:
        split_projector(model.projector, groups)
    model.sequence_parallel = sp  # type: ignore[attr-defined]
    model.tp_group = groups.tp_group  # type: ignore[attr-defined]
    return model


PLAN = ParallelPlan(
    column=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "linear_1"),
    row=("o_proj", "down_proj", "linear_2"),
    vocab=("embed_tokens", "lm_head"),
    layers="language_model.layers",
    first_stage=("vision", "projector", "language_model.embed_tokens", "language_model.pos_embed"),
    last_stage=("language_model.final_norm", "language_model.lm_head"),
    tensor=parallelize_model,
)
