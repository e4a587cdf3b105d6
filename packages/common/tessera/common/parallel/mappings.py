"""Autograd-aware collectives between tensor-parallel ranks.

Each function is a pair (forward op, backward op) that are adjoint to each other:

    copy_to_tp         identity        | all-reduce      (input to a column-parallel layer)
    reduce_from_tp     all-reduce      | identity        (output of a row-parallel layer)
    gather_seq         all-gather seq  | reduce-scatter  (sequence parallel -> column-parallel)
    reduce_scatter_seq reduce-scatter  | all-gather seq  (row-parallel -> sequence parallel)
    scatter_seq        take own chunk  | all-gather seq  (replicated -> sequence parallel)
    all_to_all_rows    all-to-all      | all-to-all back (expert dispatch; context <-> head parallel)

Sequence-parallel tensors are [B, T/tp, ...] (dim 1 split, rank r holding chunk r).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

SEQ_DIM = 1

# Flat (dim-0) all-gather / reduce-scatter: the current names where this torch has them (the
# older ones warn as deprecated on every first call site), else the older ones; same signature.
all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if torch.compiler.is_compiling():
        # Traced: the functional collective, whose all-gather -> split -> cat (one split feeding
        # the cat) is the form inductor's micro-pipeline TP pass fuses with the matmuls reading
        # it (async-TP). The in-place one below traces into a copy into `out` whose chunks are
        # re-split separately, which the pass does not match.
        return funcol.all_gather_tensor(x.contiguous(), gather_dim=SEQ_DIM, group=group)
    # Eager only (compile traces the branch above, so nothing here reaches inductor's passes): the
    # flat all-gather concatenates along dim 0 ([world * B, T/tp, ...]) and the rank chunks are
    # then concatenated along the sequence, as split + cat: one copy, where moving the sequence
    # to dim 0 and back took two.
    xc = x.contiguous()
    out = torch.empty((world * xc.shape[0],) + tuple(xc.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, xc, group=group)
    return torch.cat(out.chunk(world, dim=0), dim=SEQ_DIM)


def _reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if x.shape[SEQ_DIM] % world:
        raise ValueError(f"sequence length {x.shape[SEQ_DIM]} is not divisible by the tensor-parallel size {world}")
    if torch.compiler.is_compiling():
        # Traced: the functional form, whose reduce-scatter along the sequence is what the
        # micro-pipeline TP pass fuses with the matmul producing `x` (see _all_gather_seq).
        return funcol.reduce_scatter_tensor(x.contiguous(), "sum", scatter_dim=SEQ_DIM, group=group)
    # Eager only (never traced): the flat reduce-scatter splits along dim 0, so the rank chunks of
    # the sequence are stacked along dim 0 first (split + cat, one copy).
    stacked = torch.cat(x.chunk(world, dim=SEQ_DIM), dim=0)
    out = torch.empty((stacked.shape[0] // world,) + tuple(stacked.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, stacked, group=group)
    return out


def _split_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    return x.chunk(world, dim=SEQ_DIM)[dist.get_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_seq(g, ctx.group), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_seq(g, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_seq(g, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with uneven splits; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Rows of `x` (dim 0) in consecutive slices of `send[r]` rows to rank r; returns the `recv[r]`
    rows from each rank r, in rank order. Differentiable."""
    return _AllToAll.apply(x, send, recv, group)


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _GatherSeq.apply(x, group)


def reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceScatterSeq.apply(x, group)


def scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ScatterSeq.apply(x, group)
