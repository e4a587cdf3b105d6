"""Data-parallel gradient reduction in buckets that overlap the backward pass.

Parameters are packed into flat per-bucket buffers (`param.data` and `param.grad` become views
into them), so one collective reduces a whole bucket. A post-accumulate-grad hook counts each
parameter's gradient contributions; when every parameter of a bucket has received all of this
step's micro-batches, the bucket's reduction is launched asynchronously while backward goes on
with earlier layers. Counting contributions (rather than asking the schedule which micro-batch
is last) works for any schedule, pipelined or not.

Two reductions:
  * sharded (ZeRO-1, used by the distributed optimizer): reduce-scatter, so data-parallel rank r
    receives the summed gradient of slice r of each bucket; after the optimizer step the
    updated slices are all-gathered back into the parameters.
  * replicated: all-reduce of the whole bucket.

Gradients are kept in fp32 whatever the parameter dtype. For fp32 parameters `param.grad` is
simply a view of the fp32 buffer (autograd accumulates into it); for bf16/fp16 parameters the
hook adds each micro-batch's gradient into the fp32 buffer and frees `param.grad` (Megatron's
"main grads"), so accumulation, reduction, clipping and the optimizer never round to 16 bits.

Under expert parallel the dense parameters have dp x ep replicas (expert ranks read their own
rows of the batch) and are reduced over the data x expert group; an MoE layer's expert weights
(tagged `ep_shard`) are distinct on each expert rank, already hold the gradient of every token
routed to them from the whole expert group (the dispatch's backward), and are reduced over the
data group only. Both are divided by dp x ep: the loss is the mean over all of those ranks'
rows. Each bucket holds one kind, and is sharded (ZeRO-1) over its own group.

Under context parallel every gradient is first summed over the context group (each context rank
saw only its chunks of the sequence), in the same launch.

Overlap, both directions (Megatron's overlap_grad_reduce / overlap_param_gather):
  * gradients (`overlap_grad_reduce`, default on): a bucket whose gradients are complete is
    launched from the hook, in bucket order (reverse layer order: a complete bucket waits until
    every bucket before it is launched, as torch DDP's reducer does, so every rank issues the
    collectives in the same order whatever order autograd finishes them in, provided every rank's
    backward reaches the same parameters: a bucket one rank never completes in backward is
    launched only in `finish()` there, and the ranks' collectives no longer pair up (hence the
    vision-language objective runs its tower on text-only micro-batches too); off, every bucket is
    launched in `finish()` after backward (the non-overlapped reference).
  * parameters (`overlap_param_gather`, default off): the all-gathers after the sharded
    optimizer step are launched asynchronously when the next step starts, in forward order, and
    `register_param_gather_hooks` puts a forward pre-hook on the modules that use each bucket
    (the embedding, each transformer block, the head...) that waits for that bucket's gather
    only; `wait_param_gather()` completes all of them (checkpoint save/load, `finish()` before
    the next optimizer step, anything else reading the weights outside a forward).
Both are exact: the same collectives on the same buffers, only issued earlier or waited later.
Each launch is a `torch.profiler.record_function` range (`tessera.dp.<collective> bucket <i>`),
so the trainer's profiler traces show where the collectives start; `events` records, per step,
the order in which buckets became ready and were launched (what the overlap tests read).

Some gradients need a tensor- or pipeline-group reduction first (norms and row biases under
sequence parallel; the tied embedding on the first and last pipeline stage). They go into
"deferred" buckets, reduced in `finish()` after those reductions, never from a hook: a hook
blocking on a pipeline peer while the schedule still owes that peer a message would deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tessera.common.parallel.expert_parallel import is_expert_shard
from tessera.common.parallel.mappings import all_gather_flat, reduce_scatter_flat
from tessera.common.parallel.state import ParallelGroups

# Default elements per gradient bucket (Megatron's ddp_bucket_size; the trainer's
# parallel.bucket_numel). Smaller buckets start the first reduction sooner and leave less
# reduction after the last gradient; larger ones amortise each collective's fixed cost. Measured
# 2026-11-24, gloo reduce-scatter of an fp32 bucket between 2 ranks on this 2-core EPYC (load
# average ~10, two runs, median of 4 calls): 62.5k elements 82-116 ns/element, 250k 17-24,
# 1M 14-17, 4M 7-12, 16M 15-25, 40M 13-28. gloo is latency-bound below ~1M and gains nothing
# past ~4M (cache-bound beyond), so on CPU 1M-4M is the range to pick (set bucket_numel).
# The default stays at Megatron's 40M, measured by Megatron on NCCL, the backend training runs
# on, where one collective needs far larger messages to reach peak bus bandwidth than gloo does;
# `benchmarks/parallel_scaling.py --overlap --bucket-numel ...` is the sweep to re-decide it on GPUs.
BUCKET_NUMEL = 40_000_000


def _needs_presync(p: nn.Parameter) -> bool:
    return bool(getattr(p, "sequence_parallel_partial", False) or getattr(p, "tied_embedding", False))


@dataclass
class Bucket:
    """A contiguous group of parameters with one flat parameter and one flat gradient buffer."""

    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int  # padded to a multiple of the shard count
    shards: int
    deferred: bool
    weight_decay: bool
    param_buf: torch.Tensor
    grad_buf: torch.Tensor
    grad_shard: torch.Tensor  # this rank's reduced slice: a view of grad_buf (all of it when not sharded)
    norm_ranges: list[tuple[int, int]]  # slices of grad_shard this rank counts in the global grad norm
    group: dist.ProcessGroup | None  # the replicas' group the gradient is reduced over (None: no replicas)
    group_size: int
    rank: int  # this rank's shard of the bucket (0 when not sharded)
    index: int = 0  # position in GradientBuckets.buckets (reverse layer order)
    ready: int = 0
    handle: object | None = None
    launched: bool = False
    counts: dict[int, int] = field(default_factory=dict)
    gather: object | None = None  # the in-flight parameter all-gather (overlap_param_gather)
    gather_src: torch.Tensor | None = None  # its send buffer, kept alive until it is waited on

    @property
    def shard_numel(self) -> int:
        return self.numel // self.shards

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def param_shard(self, rank: int) -> torch.Tensor:
        lo, hi = self.shard_range(rank)
        return self.param_buf[lo:hi]


class GradientBuckets:
    """Owns the flat buffers, the backward hooks and the data-parallel reductions."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        groups: ParallelGroups,
        *,
        shard: bool,
        bucket_numel: int = BUCKET_NUMEL,
        no_decay: Callable[[str, nn.Parameter], bool] | None = None,
        overlap_grad_reduce: bool = True,
        overlap_param_gather: bool = False,
    ):
        if overlap_param_gather and not shard:
            raise ValueError("overlap_param_gather needs the distributed optimizer (shard=True): "
                             "without it there is no parameter all-gather to overlap")
        self.groups = groups
        self.shard = shard
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.num_microbatches = 1
        self.launched_during_backward = 0
        # This step's order of ("param_wait", i) (a forward pre-hook waited for bucket i's
        # parameter all-gather), ("ready", i) (bucket i's gradients complete), ("launch", i) and
        # ("finish", -1) (backward is over: the caller asked for the reductions' results).
        self.events: list[tuple[str, int]] = []
        no_decay = no_decay or (lambda _n, p: p.ndim < 2)
        params = [(n, p) for n, p in named_params if p.requires_grad]
        # Gradients arrive roughly in reverse order of the forward pass: bucket in that order.
        params.reverse()
        self.buckets: list[Bucket] = []
        current: list[tuple[str, nn.Parameter]] = []
        key = None
        for n, p in params:
            k = (_needs_presync(p), not no_decay(n, p), is_expert_shard(p))
            size = sum(q.numel() for _, q in current)
            if current and (k != key or size + p.numel() > bucket_numel):
                self._add_bucket(current, key)
                current = []
            current.append((n, p))
            key = k
        if current:
            self._add_bucket(current, key)
        # Launch order of the buckets reduced from hooks; `_next` is the first not yet launched.
        self._order = [b for b in self.buckets if not b.deferred]
        self._next = 0
        self._gather_pending = False  # overlap_param_gather: the step's all-gathers are yet to launch
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for b in self.buckets for p in b.params]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._offset_of = {id(p): o for b in self.buckets for p, o in zip(b.params, b.offsets)}

    # ---- construction -----------------------------------------------------------------------
    def _replicas(self, expert: bool) -> tuple[dist.ProcessGroup | None, int, int]:
        """(group, size, rank) of the ranks holding copies of a parameter: data ranks for expert
        weights, data x expert ranks for dense ones."""
        g = self.groups
        if expert or g.ep == 1:
            return (g.dp_group if g.dp > 1 else None), g.dp, g.dp_rank
        return g.dp_ep_group, g.dp_ep, g.dp_ep_rank

    def _add_bucket(self, items: list[tuple[str, nn.Parameter]], key) -> None:
        deferred, decay, expert = key
        group, group_size, group_rank = self._replicas(expert)
        shards = group_size if self.shard and group_size > 1 else 1
        dtype, device = items[0][1].dtype, items[0][1].device
        offsets, off = [], 0
        for _, p in items:
            offsets.append(off)
            off += p.numel()
        numel = -(-off // shards) * shards
        param_buf = torch.zeros(numel, dtype=dtype, device=device)
        grad_buf = torch.zeros(numel, dtype=torch.float32, device=device)
        counted_ranges: list[tuple[int, int]] = []
        g = self.groups
        for (_, p), o in zip(items, offsets):
            n = p.numel()
            param_buf[o:o + n].copy_(p.data.reshape(-1))
            p.data = param_buf[o:o + n].view_as(p)
            if dtype == torch.float32:
                p.grad = grad_buf[o:o + n].view_as(p)
            # Count each distinct element once in the global norm: replicated tensor-parallel
            # parameters on tensor rank 0 only, the tied embedding on the first stage only,
            # replicated (unsharded) buckets on the first of their replicas only; expert weights
            # are distinct on each expert rank, dense ones counted on expert rank 0 when unsharded
            # (sharded over data x expert ranks, each slice is distinct).
            counted = True
            if getattr(p, "tp_shard_dim", None) is None and g.tp_rank != 0:
                counted = False
            if getattr(p, "tied_embedding", False) and not g.is_first_stage:
                counted = False
            if shards == 1 and group_rank != 0:
                counted = False
            if g.cp_rank != 0:  # replicated over context ranks
                counted = False
            if counted:
                counted_ranges.append((o, o + n))
        rank = group_rank if shards > 1 else 0
        lo, hi = rank * (numel // shards), (rank + 1) * (numel // shards)
        # The counted ranges that fall in this rank's shard, relative to the shard, merged.
        norm_ranges: list[tuple[int, int]] = []
        for a, z in counted_ranges:
            a, z = max(a, lo) - lo, min(z, hi) - lo
            if a >= z:
                continue
            if norm_ranges and norm_ranges[-1][1] == a:
                norm_ranges[-1] = (norm_ranges[-1][0], z)
            else:
                norm_ranges.append((a, z))
        # In-place reduce-scatter (NCCL documents it; gloo handles it): the reduced slice lands in
        # this rank's own slice of the bucket, so no second gradient buffer is needed.
        grad_shard = grad_buf[lo:hi]
        self.buckets.append(Bucket(
            names=[n for n, _ in items], params=[p for _, p in items], offsets=offsets, numel=numel,
            shards=shards, deferred=deferred, weight_decay=decay, param_buf=param_buf,
            grad_buf=grad_buf, grad_shard=grad_shard, norm_ranges=norm_ranges,
            group=group, group_size=group_size, rank=rank, index=len(self.buckets),
        ))

    # ---- per step ---------------------------------------------------------------------------
    def start_step(self, num_microbatches: int) -> None:
        """Zero the gradients and arm the hooks for a step of `num_microbatches` micro-batches."""
        self.num_microbatches = num_microbatches
        self.launched_during_backward = 0  # buckets whose reduction a hook started (overlap)
        self.events.clear()
        self._next = 0
        self.launch_param_gather()  # overlap_param_gather: the last step's all-gathers, waited on in forward
        for b in self.buckets:
            b.grad_buf.zero_()
            for p, o in zip(b.params, b.offsets):
                if p.dtype != torch.float32:
                    p.grad = None
                # Someone may have called module.zero_grad() (set_to_none): re-attach the views.
                elif p.grad is None or p.grad.data_ptr() != b.grad_buf[o:].data_ptr():
                    p.grad = b.grad_buf[o:o + p.numel()].view_as(p)
            b.ready, b.handle, b.launched = 0, None, False
            b.counts.clear()

    def _on_grad(self, p: nn.Parameter) -> None:
        b = self._bucket_of[id(p)]
        if p.dtype != torch.float32:
            o = self._offset_of[id(p)]
            b.grad_buf[o:o + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
        c = b.counts.get(id(p), 0) + 1
        b.counts[id(p)] = c
        if c == self.num_microbatches:
            b.ready += 1
            if b.ready == len(b.params):
                self.events.append(("ready", b.index))
                if self.overlap_grad_reduce and not b.deferred:
                    self._launch_in_order()

    def _launch_in_order(self) -> None:
        """Launch every complete bucket up to the first incomplete one (bucket order)."""
        while self._next < len(self._order):
            b = self._order[self._next]
            if b.ready < len(b.params):
                return
            self._launch(b)
            self.launched_during_backward += 1
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        b.launched = True
        self.events.append(("launch", b.index))
        kind = "reduce_scatter" if b.shards > 1 else "all_reduce"
        with torch.profiler.record_function(f"tessera.dp.{kind} bucket {b.index}"):
            self._reduce(b)

    def _reduce(self, b: Bucket) -> None:
        g = self.groups
        if g.cp > 1:
            # Context ranks hold the same parameters, each the gradient of its tokens' share of
            # the loss: sum them (blocking; context peers run identical backward passes, so the
            # hooks fire in the same order on each), then reduce over data ranks as usual.
            dist.all_reduce(b.grad_buf, group=g.cp_group)
        if g.dp_ep == 1:
            return
        # Average over the ranks reading the batch: each holds the mean over its own micro-batches
        # (expert weights: summed over the expert group's tokens by the dispatch already).
        b.grad_buf.div_(g.dp_ep)
        if b.group_size == 1:
            return
        if b.shards > 1:
            b.handle = reduce_scatter_flat(b.grad_shard, b.grad_buf, group=b.group, async_op=True)
        else:
            b.handle = dist.all_reduce(b.grad_buf, group=b.group, async_op=True)

    def finish(self) -> None:
        """Reduce the deferred buckets, then wait until every bucket's reduction is done."""
        g = self.groups
        self.events.append(("finish", -1))
        self.wait_param_gather()  # parameters no forward used (the optimizer step rewrites them)
        for b in self.buckets:
            if not b.deferred:
                continue
            for p, o in zip(b.params, b.offsets):
                grad = b.grad_buf[o:o + p.numel()]
                if getattr(p, "sequence_parallel_partial", False) and g.tp > 1:
                    dist.all_reduce(grad, group=g.tp_group)
                if getattr(p, "tied_embedding", False) and g.embedding_group is not None:
                    dist.all_reduce(grad, group=g.embedding_group)
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()  # type: ignore[attr-defined]
                b.handle = None

    def all_gather_params(self) -> None:
        """After the sharded optimizer updated its slices, give every replica the whole bucket:
        at once, or (overlap_param_gather) later: marked pending here, launched asynchronously
        when the next step starts (`start_step`) and waited on per bucket by the forward
        pre-hooks of the modules using it."""
        if self.overlap_param_gather:
            self._gather_pending = True
            return
        self._gather_buckets(async_op=False)

    def launch_param_gather(self) -> None:
        """Launch the pending all-gathers asynchronously; no-op when none is pending.

        Launched at the start of the next step, not at the end of this one: then no collective is
        in flight between steps, where the trainer starts and stops the profiler (seen: a
        profiler started while a gloo all-gather was in flight crashed the process, 1 run in 5)
        and saves checkpoints. Megatron too launches them from the next forward."""
        if not self._gather_pending:
            return
        self._gather_pending = False
        self._gather_buckets(async_op=True)

    def _gather_buckets(self, async_op: bool) -> None:
        """All-gather every sharded bucket's parameters from the replicas' updated slices, in forward
        order (the bucket the forward needs first goes first); `async_op` leaves each in flight on
        its bucket (`gather`, with the source slice kept alive in `gather_src`)."""
        for b in reversed(self.buckets):
            if b.shards == 1:
                continue
            own = b.param_shard(b.rank).clone()
            with torch.profiler.record_function(f"tessera.dp.all_gather bucket {b.index}"):
                work = all_gather_flat(b.param_buf, own, group=b.group, async_op=async_op)
            if async_op:
                b.gather, b.gather_src = work, own

    def _wait_gather(self, b: Bucket) -> None:
        self.launch_param_gather()  # a forward outside a training step (evaluation) launches them itself
        if b.gather is not None:
            b.gather.wait()  # type: ignore[attr-defined]
            b.gather, b.gather_src = None, None

    def wait_param_gather(self) -> None:
        """Complete every pending or in-flight parameter all-gather (no-op when there is none).
        Collective when one is pending: every rank reads the weights at the same point."""
        self.launch_param_gather()
        for b in reversed(self.buckets):
            self._wait_gather(b)

    def register_param_gather_hooks(self, units: Iterable[nn.Module],
                                    after: Iterable[tuple[nn.Module, list[nn.Parameter]]] = ()) -> None:
        """Forward hooks waiting for the gathers of the buckets a module uses.

        `units` are the modules whose forward is where their parameters are first read, outer
        ones before inner ones (a stage, then its embedding, each transformer block, final norm):
        each parameter is waited for in a pre-hook of the innermost unit holding it. Blocks are
        units as a whole, not their linears: under torch.compile a block's forward is one graph,
        and its own pre-hook runs outside it (a wait inside would break the graph). `after` lists
        (module, parameters) read right after that module's forward by its caller, not by a
        forward of their own (an output head applied as `logits(hidden, weight)`): they are
        waited for in the module's forward post-hook. (Found by the trainer test: an untied head
        waited for by its own never-called pre-hook read a stale weight.)
        """
        late = {id(p): module for module, params in after for p in params}
        owner: dict[int, nn.Module] = {}
        units = list(units)
        for unit in units:  # later (inner) units override earlier (outer) ones
            for p in unit.parameters():
                if id(p) in self._bucket_of and id(p) not in late:
                    owner[id(p)] = unit
        pre: dict[int, list[Bucket]] = {}
        post: dict[int, list[Bucket]] = {}
        for needs, where in ((pre, owner), (post, late)):
            for pid, module in where.items():
                b = self._bucket_of.get(pid)
                if b is not None and b.shards > 1 and b not in needs.setdefault(id(module), []):
                    needs[id(module)].append(b)
        for unit in units:
            if pre.get(id(unit)):
                self._hooks.append(unit.register_forward_pre_hook(self._gather_hook(pre[id(unit)])))
        for module in {id(m): m for m, _ in after}.values():
            if post.get(id(module)):
                self._hooks.append(module.register_forward_hook(self._gather_hook(post[id(module)])))

    def _gather_hook(self, buckets: list[Bucket]):
        buckets = sorted(buckets, key=lambda b: -b.index)  # forward order

        def hook(_module, *_args):
            self.launch_param_gather()
            for b in buckets:
                if b.gather is not None:
                    self.events.append(("param_wait", b.index))
                    self._wait_gather(b)
        return hook

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
