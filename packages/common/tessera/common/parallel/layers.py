"""Tensor-parallel layers: column/row-parallel linear and vocab-parallel embedding.

They subclass nn.Linear / nn.Embedding with the *local* shapes, so the model's own
`init_weights` and parameter names work on them unchanged. Each parameter carries two tags
read by the data-parallel, clipping and checkpoint code:

    tp_shard_dim            dim along which the global tensor is split over tensor ranks
                            (None: replicated on every tensor rank)
    sequence_parallel_partial  True when each tensor rank computes only part of its gradient
                            (norms and row biases under sequence parallel): the gradient is
                            all-reduced over the tensor group before the data-parallel reduce

The Column/Row layers run their local matmul through `self.local_linear` (F.linear's signature,
default F.linear), between their collectives. FP8 training (tessera.trainer.components.precision.torchao_float8) sets it to a
float8 matmul; the class, parameters and tags stay, so state dicts and checkpoints do not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.common.parallel.mappings import copy_to_tp, reduce_from_tp, reduce_scatter_seq

# Every attribute the parallel code reads off a parameter (carried over by `keep_tags` when
# parameters are re-created, e.g. by Module.to_empty). `tied_embedding` is set by the pipeline code, `ep_shard`
# (an MoE layer's experts, split along dim 0 over the expert-parallel group) by shard_experts.
PARALLEL_TAGS = ("tp_shard_dim", "sequence_parallel_partial", "tied_embedding", "ep_shard")


def tag(param: torch.Tensor, shard_dim: int | None, partial: bool = False) -> None:
    param.tp_shard_dim = shard_dim  # type: ignore[attr-defined]
    param.sequence_parallel_partial = partial  # type: ignore[attr-defined]


def shard_dim_of(param: torch.Tensor) -> int | None:
    return getattr(param, "tp_shard_dim", None)


@contextlib.contextmanager
def keep_tags(module: nn.Module) -> Iterator[None]:
    """Carry the parallel tags of `module`'s parameters, by name, over code that replaces its
    parameter objects (to_empty, fully_shard's DTensors, float8 all-gather's wrapped weights)."""
    tags = {n: {k: getattr(p, k) for k in PARALLEL_TAGS if hasattr(p, k)} for n, p in module.named_parameters()}
    yield
    after = dict(module.named_parameters())
    if after.keys() != tags.keys():  # a renamed parameter would silently lose its tags
        raise RuntimeError(f"keep_tags: parameter names changed: {sorted(tags.keys() ^ after.keys())[:4]}")
    for n, p in after.items():
        for k, v in tags[n].items():
            setattr(p, k, v)


def allocate(module: nn.Module, device: torch.device) -> None:
    """`to_empty` on `module`, keeping the parallel tags (to_empty makes new parameter objects)."""
    with keep_tags(module):
        module.to_empty(device=device)


def _copy_local_shards(new: nn.Module, full: nn.Module, group: dist.ProcessGroup) -> None:
    """Fill `new`'s parameters with this rank's pieces of `full`'s same-named global ones, each cut
    along its `tp_shard_dim` tag (whole when None); nothing to copy from a meta module."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    with torch.no_grad():
        for name, p in new.named_parameters(recurse=False):
            value = getattr(full, name)
            if not value.is_meta:
                dim = shard_dim_of(p)
                p.copy_(value if dim is None else value.chunk(world, dim=dim)[rank])


_L = TypeVar("_L", bound="_TensorParallelLinear")


class _TensorParallelLinear(nn.Linear):
    """What the column- and row-parallel layers share: building one from a full nn.Linear."""

    @classmethod
    def from_linear(cls: type[_L], lin: nn.Linear, group: dist.ProcessGroup, sequence_parallel: bool) -> _L:
        """This rank's layer of `lin` (its slices of the weights; a meta `lin` gives a meta layer)."""
        new = cls(lin.in_features, lin.out_features, lin.bias is not None, group, sequence_parallel,  # type: ignore[call-arg]
                  device=lin.weight.device, dtype=lin.weight.dtype)
        _copy_local_shards(new, lin, group)
        return new


class ColumnParallelLinear(_TensorParallelLinear):
    """y = x A^T with A split by output rows; each rank produces its slice of the features.

    Input: replicated [B, T, in]. Without sequence parallel it enters through `copy_to_tp`
    (backward: all-reduce of the partial input gradients). With sequence parallel the caller has
    already all-gathered the sequence once for all projections reading it (see
    the kind's parallel plan, e.g. causal_lm.parallelize), and that gather's backward reduce-scatters the partial
    gradients, so the input is used as is.
    Output: [B, T, out/tp], not gathered (the next row-parallel layer consumes it).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, group: dist.ProcessGroup,
                 sequence_parallel: bool = False, device=None, dtype=None):
        world = dist.get_world_size(group)
        if out_features % world:
            raise ValueError(f"output features {out_features} not divisible by tensor-parallel size {world}")
        super().__init__(in_features, out_features // world, bias=bias, device=device, dtype=dtype)
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.local_linear = F.linear
        tag(self.weight, 0)
        if self.bias is not None:
            tag(self.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            x = copy_to_tp(x, self.group)
        return self.local_linear(x, self.weight, self.bias)


class RowParallelLinear(_TensorParallelLinear):
    """y = x A^T with A split by input columns; partial sums are reduced across tensor ranks.

    Input: [B, T, in/tp] (a column-parallel output). Output: replicated [B, T, out] after an
    all-reduce, or sequence-parallel [B, T/tp, out] after a reduce-scatter. The bias is added
    after the reduction, once.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, group: dist.ProcessGroup,
                 sequence_parallel: bool = False, device=None, dtype=None):
        world = dist.get_world_size(group)
        if in_features % world:
            raise ValueError(f"input features {in_features} not divisible by tensor-parallel size {world}")
        super().__init__(in_features // world, out_features, bias=bias, device=device, dtype=dtype)
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.local_linear = F.linear
        tag(self.weight, 1)
        if self.bias is not None:
            tag(self.bias, None, partial=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local_linear(x, self.weight)
        y = reduce_scatter_seq(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Embedding):
    """Embedding with the vocabulary split in contiguous row ranges across tensor ranks.

    Each rank looks up the tokens in its range (others give zero rows) and the partial results
    are summed: all-reduce, or reduce-scatter onto sequence shards under sequence parallel.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: dist.ProcessGroup,
                 sequence_parallel: bool = False, device=None, dtype=None):
        world = dist.get_world_size(group)
        if num_embeddings % world:
            raise ValueError(f"vocab size {num_embeddings} not divisible by tensor-parallel size {world}")
        super().__init__(num_embeddings // world, embedding_dim, device=device, dtype=dtype)
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.vocab_start = dist.get_rank(group) * (num_embeddings // world)
        tag(self.weight, 0)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group: dist.ProcessGroup,
                       sequence_parallel: bool) -> VocabParallelEmbedding:
        new = cls(emb.num_embeddings, emb.embedding_dim, group, sequence_parallel,
                  device=emb.weight.device, dtype=emb.weight.dtype)
        _copy_local_shards(new, emb, group)
        return new

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_seq(out, self.group) if self.sequence_parallel else reduce_from_tp(out, self.group)
