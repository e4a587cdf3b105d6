"""The distributed optimizer: AdamW over data-parallel shards of flat buckets (ZeRO stage 1).

Each data-parallel rank keeps fp32 master weights (for fp32 models: the parameters themselves)
and Adam moments only for its slice of each gradient bucket (1/DP of the model's optimizer
state), steps them with torch.optim.AdamW (one
flat tensor per bucket slice: AdamW is elementwise, so this is the same arithmetic as per
parameter), writes the result into its slice of the parameters and all-gathers the slices.
With `shard=False` the same class is plain data parallel: all-reduced gradients, full state on
every rank.

Under expert parallel each bucket is sharded over its own replicas: dense parameters over data x
expert ranks, MoE expert weights over data ranks (GradientBuckets).

The gradient norm for clipping is computed over every distinct element exactly once across
tensor, pipeline, data and expert ranks (expert shards summed over the expert group once) (see Bucket.norm_ranges), matching
torch.nn.utils.clip_grad_norm_ on the single-process model.

Overlap (GradientBuckets): gradient reductions start from backward hooks (`overlap_grad_reduce`);
with `overlap_param_gather` the all-gather after `step()` is left in flight and the next forward
waits for each bucket in a pre-hook of the modules using it (`register_param_gather_hooks`).
Whatever reads whole weights outside a forward calls `wait_param_gather()` first; this class's
norms and checkpoint state read only this rank's slices, which are current right after the step.

Checkpoint state is layout-free: per parameter, under its global name, as global tensors
(DTensor over the tensor mesh) whatever the data-parallel sharding: see `state_dict`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tessera.common.parallel.mappings import all_gather_flat
from tessera.common.parallel.state import ParallelGroups
from tessera.common.parallel.state_dict import to_global
from tessera.trainer.components.optimizer.optim import adamw_with_decay
from tessera.trainer.parallel.data_parallel import BUCKET_NUMEL, Bucket, GradientBuckets

OPTIM_PREFIX = "optimizer."


class DistributedOptimizer:
    """AdamW on data-parallel shards. Call `step()` after the backward passes of a step."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        groups: ParallelGroups,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        shard: bool = True,
        bucket_numel: int = BUCKET_NUMEL,
        no_decay: Callable[[str, nn.Parameter], bool] | None = None,
        overlap_grad_reduce: bool = True,
        overlap_param_gather: bool = False,
    ):
        self.groups = groups
        self.max_grad_norm = max_grad_norm
        self.buckets = GradientBuckets(named_params, groups, shard=shard, bucket_numel=bucket_numel,
                                       no_decay=no_decay, overlap_grad_reduce=overlap_grad_reduce,
                                       overlap_param_gather=overlap_param_gather)
        self.masters: list[nn.Parameter] = []
        for b in self.buckets.buckets:
            shard = b.param_shard(b.rank).detach()
            # fp32 parameters are their own master weights: the optimizer updates this rank's
            # slice of the flat parameter buffer in place (no copy). Lower precision keeps an
            # fp32 master shard and copies back after each step.
            self.masters.append(nn.Parameter(shard if shard.dtype == torch.float32 else shard.clone().float()))
        decay = [m for m, b in zip(self.masters, self.buckets.buckets) if b.weight_decay]
        nodecay = [m for m, b in zip(self.masters, self.buckets.buckets) if not b.weight_decay]
        self.inner = adamw_with_decay(decay, nodecay, weight_decay, lr, betas, eps)

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups: set `lr` here (or wrap `self.inner` in an LR scheduler)."""
        return self.inner.param_groups

    def register_param_gather_hooks(self, stages: list[nn.Module], own_forward: bool = False) -> None:
        """overlap_param_gather: forward pre-hooks on each stage, its top-level modules (embedding,
        final norm) and each transformer block, waiting for the gathers of the buckets they use;
        the output head (untied `lm_head`, or a pipeline stage's `tied_head`), which the stage
        applies to the model's output without calling it, in a post-hook of the model.

        `own_forward`: the objective runs its own `stage_forward` (vision-language, masked LM,
        span corruption), which reads weights outside the modules above (LLaVA's text embedding
        inside `embed()`, the tower through `hidden_states()`, the head by `output_weight()`; the
        model's forward and its post-hook never run). Then only the blocks the model runs
        (`model.layers`, called as modules, each reading its own weights) wait in their pre-hooks,
        and every other weight in the stage's pre-hook, before the objective reads any."""
        units: list[nn.Module] = []
        after: list[tuple[nn.Module, list[nn.Parameter]]] = []
        for stage in stages:
            units.append(stage)
            model = getattr(stage, "model", stage)
            if own_forward:
                units += list(model.layers.values())
                continue
            containers = [m for m in model.children() if isinstance(m, (nn.ModuleDict, nn.ModuleList))]
            units += [m for m in model.children() if m not in containers]
            units += [block for c in containers for block in c.children()]
            head = [p for p in (getattr(stage, "tied_head", None),) if p is not None]
            if getattr(model, "lm_head", None) is not None:
                head += list(model.lm_head.parameters())
            if head and model is not stage:
                after.append((model, head))
        self.buckets.register_param_gather_hooks(units, after)

    def wait_param_gather(self) -> None:
        """Wait for the parameter all-gathers an overlapped step left in flight (no-op otherwise)."""
        self.buckets.wait_param_gather()

    def zero_grad(self, num_microbatches: int = 1) -> None:
        """Zero gradients and arm the bucket hooks for a step of `num_microbatches` micro-batches."""
        self.buckets.start_step(num_microbatches)

    @torch.no_grad()
    def clip_grad_norm(self, inv_scale: float = 1.0) -> float:
        """Finish the reductions, unscale (fp16 loss scaling), compute the global L2 norm, and clip
        (if max_grad_norm is set). A non-finite norm (overflow) is returned without clipping."""
        self.buckets.finish()
        if inv_scale != 1.0:
            for b in self.buckets.buckets:
                b.grad_shard.mul_(inv_scale)
        sq = torch.zeros((), dtype=torch.float32, device=self.groups.device)
        for b in self.buckets.buckets:
            for a, z in b.norm_ranges:
                sq += b.grad_shard[a:z].pow(2).sum()
        dist.all_reduce(sq)  # world group: every distinct element was counted on exactly one rank
        norm = math.sqrt(sq.item()) if math.isfinite(sq.item()) else float(sq.item())
        if self.max_grad_norm is not None and math.isfinite(norm):
            coef = self.max_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                for b in self.buckets.buckets:
                    b.grad_shard.mul_(coef)
        return norm

    @torch.no_grad()
    def param_norm(self) -> float:
        """Global L2 norm of the fp32 master parameters (the parameters themselves when they are fp32),
        every distinct element counted once across tensor, pipeline and data ranks (the grad norm's
        ranges over this rank's shards). Collective. Reads only this rank's slices, which the step
        wrote itself: it does not wait for pending parameter all-gathers (overlap_param_gather)."""
        sq = torch.zeros((), dtype=torch.float32, device=self.groups.device)
        for master, b in zip(self.masters, self.buckets.buckets):
            for a, z in b.norm_ranges:
                sq += master[a:z].float().pow(2).sum()
        dist.all_reduce(sq)
        return math.sqrt(sq.item())

    @torch.no_grad()
    def step(self, inv_scale: float = 1.0, skip_nonfinite: bool = False) -> float:
        """Unscale, clip, update the local shards, all-gather the parameters. Returns the pre-clip
        norm. With `skip_nonfinite`, a non-finite norm (the same on every rank: it is global)
        skips the update, leaving parameters and optimizer state untouched."""
        norm = self.clip_grad_norm(inv_scale)
        if skip_nonfinite and not math.isfinite(norm):
            return norm
        for m, b in zip(self.masters, self.buckets.buckets):
            m.grad = b.grad_shard  # fp32 (GradientBuckets keeps main grads in fp32)
        self.inner.step()
        for m, b in zip(self.masters, self.buckets.buckets):
            shard = b.param_shard(b.rank)
            if m.data_ptr() != shard.data_ptr():
                shard.copy_(m)
            m.grad = None
        self.buckets.all_gather_params()
        return norm

    # ---- checkpoint state -------------------------------------------------------------------
    def _full_bucket(self, b: Bucket, shard: torch.Tensor) -> torch.Tensor:
        if b.shards == 1:
            return shard
        full = torch.empty(b.numel, dtype=shard.dtype, device=shard.device)
        all_gather_flat(full, shard.contiguous(), group=b.group)
        return full

    def _state_keys(self, dtype: torch.dtype) -> list[str]:
        keys = ["exp_avg", "exp_avg_sq"]
        if dtype != torch.float32:
            keys.append("master")
        return keys

    def state_dict(self, global_names: dict[int, str]) -> dict[str, object]:
        """{'optimizer.state.<global name>.<exp_avg|exp_avg_sq|step|master>': tensor}.

        The same keys as the single-process trainer's checkpoints (tessera.trainer.components.checkpoint.storage),
        so either can resume the other. Moments are global DTensors over the tensor mesh whatever
        the data-parallel sharding; `step` a scalar. `global_names` maps id(parameter) to its
        checkpoint name (tied copies share a name; DCP stores it once). Collective over the
        data-parallel group. (Reads this rank's slices and optimizer state only, current whether
        or not parameter all-gathers are pending.)
        """
        out: dict[str, object] = {}
        for m, b in zip(self.masters, self.buckets.buckets):
            st = self.inner.state.get(m, {})
            step = float(st["step"]) if "step" in st else 0.0
            for key in self._state_keys(b.param_buf.dtype):
                if key == "master":
                    shard = m.detach()
                else:
                    shard = st[key] if key in st else torch.zeros_like(m)
                full = self._full_bucket(b, shard)
                for p, o in zip(b.params, b.offsets):
                    local = full[o:o + p.numel()].view(p.shape).clone()
                    out[f"{OPTIM_PREFIX}state.{global_names[id(p)]}.{key}"] = to_global(local, p, self.groups)
            for p in b.params:
                out[f"{OPTIM_PREFIX}state.{global_names[id(p)]}.step"] = torch.tensor(step, dtype=torch.float32)
        return out

    def load_state_dict(self, state: dict[str, object], global_names: dict[int, str]) -> None:
        """Inverse of `state_dict` (same keys, filled by DCP). Masters are re-read from parameters
        when the checkpoint has none (fp32 models: the parameters are the masters)."""
        self.wait_param_gather()
        with torch.no_grad():
            for m, b in zip(self.masters, self.buckets.buckets):
                lo, hi = b.shard_range(b.rank)
                step = float(state[f"{OPTIM_PREFIX}state.{global_names[id(b.params[0])]}.step"])  # type: ignore[arg-type]
                st: dict[str, torch.Tensor] = {"step": torch.tensor(step, dtype=torch.float32)}
                if m.data_ptr() != b.param_buf[lo:hi].data_ptr():
                    m.copy_(b.param_buf[lo:hi].float())
                for key in self._state_keys(b.param_buf.dtype):
                    full = torch.zeros(b.numel, dtype=torch.float32, device=b.param_buf.device)
                    for p, o in zip(b.params, b.offsets):
                        t = state[f"{OPTIM_PREFIX}state.{global_names[id(p)]}.{key}"]
                        local = t.to_local() if hasattr(t, "to_local") else t
                        full[o:o + p.numel()].copy_(local.reshape(-1))
                    if key == "master":
                        m.copy_(full[lo:hi])
                    else:
                        st[key] = full[lo:hi].clone()
                self.inner.state[m] = st
