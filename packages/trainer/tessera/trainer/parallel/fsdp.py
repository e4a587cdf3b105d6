"""Fully sharded data parallel (ZeRO-3) with torch's FSDP2 `fully_shard`, composed with Tessera's
tensor parallel, and the AdamW that steps its sharded parameters.

Why FSDP2 composes here: Tessera's tensor-parallel layers hold plain tensors (their local TP
shards) and issue their own collectives on the tensor group, so `fully_shard` sees ordinary
parameters and shards them over the data ranks (`ParallelGroups.fsdp_mesh`: `dp_shard`, flattened
with the expert and context ranks when there are any, or `dp_replicate` x that for HSDP). No DTensor tensor parallel (2-D parameter DTensors) is
needed; the checkpoint alone presents parameters as 2-D global tensors (`state_dict.to_global`).

* Units: each transformer block the stage runs (`model.layers`: a vision-language model's tower
  blocks too) is one `fully_shard` group (one all-gather in forward, one in backward, one
  reduce-scatter); the stage root holds embedding, final norm and head (and a projector). The next
  block's all-gather is issued before the current block runs, forward and backward (explicit
  prefetch, as torchtitan sets it); after forward each block's parameters are freed
  (`reshard_after_forward`).
* Shard dimension (`_placement`): under tensor parallel (> 1), a tensor-parallel weight split
  along dim d over tensor ranks is sharded along the other dim over data ranks (so each rank's piece is a rectangle of the global
  matrix and the checkpoint placement is (Shard(1-d), Shard(d))); replicated and 1-D
  parameters along dim 0 (a tensor-sharded bias: TP chunk first, then the FSDP chunk, which
  the checkpoint expresses with `_StridedShard`). Over one tensor rank everything is sharded
  along dim 0, unevenly when the shards do not divide it (FSDP2 refuses that on another dim).
* Precision: the sharded parameters are fp32 and are the optimizer's master weights;
  `param_dtype=bfloat16` all-gathers bf16 copies for compute (bf16 parameters with fp32 master
  weights, Megatron's --bf16 with the distributed optimizer); `reduce_dtype` picks the
  gradient reduce-scatter precision (fp32 by default).
* CPU offload (GPU only): sharded parameters, gradients and optimizer state live in host
  memory and AdamW steps there (FSDP2's CPUOffloadPolicy).
* Gradients: FSDP averages over all data ranks (reduce-scatter over shards, all-reduce over
  replicas). Then, as in the bucketed path, sequence-parallel-partial gradients (norms under
  SP) are summed over the tensor group, a tied embedding's two copies (first and last pipeline
  stage) over the embedding group, and the global norm counts each element once: on tensor rank
  0 for tensor-replicated parameters, on replica 0 for data replicas, on the first stage for the
  tied embedding.
* Context parallel: context ranks run the same parameters on their parts of the sequence, so
  they shard them too (the FSDP mesh is data shards x context ranks flattened, torchtitan's
  dp_shard_cp: parameters and optimizer state divided by the context size as well), and the sum
  of their gradients happens inside FSDP's reduce-scatter, overlapped with backward. Each context
  rank's loss is its share of the sum (mean / C), so the reduction is a sum over the mesh divided
  by the batch readers (data x expert ranks), not FSDP's mean over the mesh (`_sum_then_divide`).
  The bucketed (ZeRO-1) path instead all-reduces its buckets over the context group.
* Expert parallel: dense parameters are sharded over data x expert (x context) ranks (`fsdp_mesh`
  is then dp_shard x ep (x cp) flattened: expert ranks are their replicas), each MoE layer's experts are their
  own unit over the data shards (x context ranks) of their expert group (`_shard_experts`), as
  torchtitan does.
* Pipeline: each stage (chunk) is its own FSDP root, blocks inside it units, as torchtitan
  composes them; the pipeline schedule runs FSDP's gradient sync on the last micro-batch only.
  Under pipeline parallel `reshard_after_forward` is off (torchtitan's default for PP): with
  1F1B a block's forward and backward of different micro-batches interleave, and re-gathering
  its parameters for every micro-batch would multiply the all-gathers by the micro-batch count.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from tessera.common.errors import UserError
from tessera.common.layers.moe import MoE
from tessera.common.parallel.layers import keep_tags, shard_dim_of
from tessera.common.parallel.state import ParallelGroups
from tessera.common.parallel.state_dict import to_global
from tessera.trainer.components.optimizer.optim import adamw_with_decay

OPTIM_PREFIX = "optimizer."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _placement(p: nn.Parameter, tp: int) -> Shard:
    """FSDP's shard dim for `p` (see the module docstring). Over one tensor rank the tags are still
    there (the kind's tensor-parallel plan sets them at any size) but nothing is split along them, so everything
    is sharded along dim 0, which FSDP2 cuts unevenly if need be (a non-leading dim only evenly:
    hidden 64 over data shards x context 2 x 3 would be refused)."""
    d = shard_dim_of(p)
    return Shard(1 - d) if tp > 1 and d is not None and p.ndim == 2 else Shard(0)


def shard_stages(stages: list[nn.Module], groups: ParallelGroups, *, param_dtype: str = "float32",
                 reduce_dtype: str = "float32", cpu_offload: bool = False,
                 reshard_after_forward: bool = True) -> None:
    """Apply `fully_shard` to every block and to each stage (the root), in place, keeping the
    parallel tags on the new (sharded DTensor) parameters."""
    for st in stages:
        bad = [n for n, p in st.named_parameters() if p.dtype != torch.float32]
        if bad:
            raise UserError(f"fully sharded data parallel keeps fp32 parameters as master weights, but {bad[0]} is "
                            f"{next(p for p in st.parameters() if p.dtype != torch.float32).dtype}; build fp32 "
                            "and set fsdp_param_dtype=bfloat16 for bf16 compute")
    if cpu_offload and groups.device.type != "cuda":
        raise UserError("fsdp_cpu_offload: offloading to host memory needs a GPU run (on CPU the state already "
                        "lives in host memory); unset it")
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    kw = dict(mesh=groups.fsdp_mesh, shard_placement_fn=lambda p: _placement(p, groups.tp), mp_policy=mp, offload_policy=offload)
    reshard_after_forward = reshard_after_forward and groups.pp == 1
    for st in stages:
        with keep_tags(st):  # fully_shard replaces each parameter by a DTensor
            blocks = list(st.model.layers.values())  # the blocks it runs (a vision tower's too)
            for block in blocks:
                if groups.ep > 1:
                    _shard_experts(block, groups, mp, offload, reshard_after_forward)
                fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
            fully_shard(st, reshard_after_forward=False, **kw)
        if groups.cp > 1:  # context ranks' gradients are summed, not averaged (without them: the mean over dp_ep)
            for unit in (*blocks, st):
                _sum_then_divide(unit, groups.dp_ep, groups.device)
        for i, block in enumerate(blocks):  # explicit prefetch of the neighbouring block's all-gather
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])


def _shard_experts(block: nn.Module, groups: ParallelGroups, mp: MixedPrecisionPolicy, offload: OffloadPolicy,
                   reshard_after_forward: bool) -> None:
    """Under expert parallel, each MoE layer's experts are their own FSDP unit over the data shards
    (x context ranks) of their expert group (`fsdp_expert_mesh`), inside the block's unit over data
    x expert (x context) shards.

    Shard dim 1 (an expert's output rows), not 0: the global tensor is then split over expert
    ranks along dim 0 and over data shards along dim 1, so every rank's piece is a rectangle and
    the checkpoint placement a plain (Shard(1), Shard(0)); sharding dim 0 again would need a strided
    placement and experts per rank divisible by the data shards (validate_layout checks dim 1).
    Gradients: the dispatch's backward already summed every routed token's gradient over the
    expert group, so the reduction is a sum over data ranks (and context ranks) divided by data x
    expert ranks (the dense units' mean over dp_ep)."""
    for m in block.modules():
        if isinstance(m, MoE):
            fully_shard(m.experts, mesh=groups.fsdp_expert_mesh, shard_placement_fn=lambda _p: Shard(1),
                        mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard_after_forward)
            _sum_then_divide(m.experts, groups.dp_ep, groups.device)


def _sum_then_divide(unit: nn.Module, factor: int, device: torch.device) -> None:
    """Make FSDP unit `unit`'s gradient reduction the sum over its mesh divided by `factor` (the
    batch readers), instead of the mean over its mesh. On CUDA FSDP2 does it with NCCL's
    PREMUL_SUM (one op); elsewhere (gloo has no PREMUL_SUM) as a sum and a post-division."""
    unit.set_gradient_divide_factor(float(factor))
    if device.type != "cuda":
        unit.set_force_sum_reduction_for_comms(True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FullyShardedOptimizer:
    """AdamW over FSDP-sharded parameters, with the DistributedOptimizer's interface (step with
    unscale/clip/skip, param_groups, norms, layout-free state dict)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], groups: ParallelGroups, *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: float | None = 1.0):
        self.groups = groups
        self.max_grad_norm = max_grad_norm
        self.params = [p for _, p in named_params if p.requires_grad]  # frozen ones: no gradient, no state
        decay = [p for p in self.params if p.ndim >= 2]
        nodecay = [p for p in self.params if p.ndim < 2]
        self.inner = adamw_with_decay(decay, nodecay, weight_decay, lr, betas, eps)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, num_microbatches: int = 1) -> None:
        self.inner.zero_grad(set_to_none=True)

    def _counted(self, p: torch.Tensor) -> bool:
        """Whether this rank counts `p`'s local shard in global norms (each element once)."""
        g = self.groups
        if getattr(p, "tied_embedding", False) and not g.is_first_stage:
            return False  # the last stage's copy of a tied embedding (the first stage counts it)
        # Context (and expert) ranks hold different shards of the same parameter: all count.
        return (shard_dim_of(p) is not None or g.tp_rank == 0) and g.dp_replicate_rank == 0

    def _global_sq(self, tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        sq = torch.zeros((), dtype=torch.float32, device=self.groups.device)
        for p, t in tensors:
            if self._counted(p):
                sq += _local(t).float().pow(2).sum().to(sq.device)
        dist.all_reduce(sq)
        return sq.item()

    @torch.no_grad()
    def clip_grad_norm(self, inv_scale: float = 1.0) -> float:
        g = self.groups
        grads = [(p, p.grad) for p in self.params if p.grad is not None]
        if g.tp > 1:
            for p, grad in grads:
                if getattr(p, "sequence_parallel_partial", False):
                    dist.all_reduce(_local(grad), group=g.tp_group)
        if g.embedding_group is not None:  # tied embedding under pipeline: the two copies' gradients
            for p, grad in grads:  # (same shape and FSDP chunk on both stages) are summed
                if getattr(p, "tied_embedding", False):
                    dist.all_reduce(_local(grad), group=g.embedding_group)
        if inv_scale != 1.0:
            for _, grad in grads:
                _local(grad).mul_(inv_scale)
        total = self._global_sq(grads)
        norm = math.sqrt(total) if math.isfinite(total) else total
        if self.max_grad_norm is not None and math.isfinite(norm):
            coef = self.max_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                for _, grad in grads:
                    _local(grad).mul_(coef)
        return norm

    @torch.no_grad()
    def step(self, inv_scale: float = 1.0, skip_nonfinite: bool = False) -> float:
        norm = self.clip_grad_norm(inv_scale)
        if skip_nonfinite and not math.isfinite(norm):
            return norm
        self.inner.step()
        return norm

    @torch.no_grad()
    def param_norm(self) -> float:
        return math.sqrt(self._global_sq([(p, p) for p in self.params]))

    # ---- checkpoint state -------------------------------------------------------------------
    def state_dict(self, global_names: dict[int, str]) -> dict[str, object]:
        """The single-process keys; moments as global tensors (tensor x data-shard placements)."""
        out: dict[str, object] = {}
        for p in self.params:
            name = global_names[id(p)]
            st = self.inner.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                local = _local(st[key]).clone() if key in st else torch.zeros_like(_local(p))
                out[f"{OPTIM_PREFIX}state.{name}.{key}"] = to_global(local, p, self.groups)
            step = float(st["step"]) if "step" in st else 0.0
            out[f"{OPTIM_PREFIX}state.{name}.step"] = torch.tensor(step, dtype=torch.float32)
        return out

    def load_state_dict(self, state: dict[str, object], global_names: dict[int, str]) -> None:
        with torch.no_grad():
            for p in self.params:
                name = global_names[id(p)]
                st: dict[str, torch.Tensor] = {
                    "step": torch.tensor(float(state[f"{OPTIM_PREFIX}state.{name}.step"]), dtype=torch.float32)}  # type: ignore[arg-type]
                for key in ("exp_avg", "exp_avg_sq"):
                    moment = torch.zeros_like(p)
                    _local(moment).copy_(_local(state[f"{OPTIM_PREFIX}state.{name}.{key}"]))  # type: ignore[arg-type]
                    st[key] = moment
                self.inner.state[p] = st
