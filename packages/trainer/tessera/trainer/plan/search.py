"""Every layout of a GPU count that the trainer accepts, ranked by predicted step time among those
that fit the device's memory (then the rest, by peak memory)."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.common.errors import UserError
from tessera.common.layout import ParallelLayout, validate_layout
from tessera.trainer.kinds import refused_fields
from tessera.trainer.plan.devices import DeviceSpec
from tessera.trainer.plan.hybrid import is_hybrid
from tessera.trainer.plan.memory import MemoryPlan, plan_memory
from tessera.trainer.plan.spec import PlanSpec
from tessera.trainer.plan.timing import DEFAULT_EFFICIENCY, TimePlan, plan_time


@dataclass
class Candidate:
    spec: PlanSpec
    memory: MemoryPlan
    time: TimePlan
    fits: bool


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(spec: PlanSpec, gpus: int, max_virtual: int = 4) -> list[ParallelLayout]:
    """Layouts of `gpus` ranks that `validate_layout` accepts for this model and batch (with float8
    all-gather: only those it composes with, FSDP over one tensor rank)."""
    cfg = spec.model
    # Encoders have no context parallel; a hybrid's Mamba layers under it (a head split over the
    # whole sequence) are not measured by the planner's hybrid count, so it is not offered.
    context = "parallel.context" not in refused_fields(cfg) and not is_hybrid(cfg)
    out = []
    for tp in _divisors(gpus):
        for cp in _divisors(gpus // tp) if context else [1]:
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                for shard in _divisors(dp):
                    if spec.fp8_all_gather and (tp > 1 or shard == 1):
                        continue
                    for v in range(1, (max_virtual if pp > 1 else 1) + 1):
                        lay = ParallelLayout(tensor=tp, context=cp, pipeline=pp, virtual_stages=v, data=dp,
                                             data_shard=shard)
                        try:
                            validate_layout(cfg, lay, world_size=gpus, seq_len=spec.seq_len,
                                            global_batch=spec.global_batch, micro_batch=spec.micro_batch,
                                            sequence_parallel=spec.sequence_parallel)
                        except UserError:
                            continue
                        out.append(lay)
    return out


def rank_layouts(spec: PlanSpec, gpus: int, device: DeviceSpec,
                 efficiency: float = DEFAULT_EFFICIENCY) -> list[Candidate]:
    cands = []
    for lay in candidate_layouts(spec, gpus):
        s = spec.model_copy(update={"layout": lay})
        mem = plan_memory(s)
        cands.append(Candidate(s, mem, plan_time(s, device, efficiency), mem.peak <= device.memory_bytes))
    return sorted(cands, key=lambda c: (not c.fits, c.time.step_s if c.fits else c.memory.peak))
