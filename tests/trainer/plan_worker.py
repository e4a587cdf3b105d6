"""torchrun worker for tests/trainer/test_plan_validation.py: the measured per-rank peak of real
training steps under each layout, counted by torch's MemTracker.

    torchrun --nproc-per-node W tests/trainer/plan_worker.py SPEC.json

For each job of the spec: the parallel runtime (tessera.trainer.parallel.runtime) is built on the
meta device as `tessera-train` builds it (sharded initialisation; recompute applied by the
trainer's own function) inside `PeakBytes`, then trains `steps` steps. PeakBytes (MemTracker's
method without its per-module bookkeeping, which refuses a module called once per micro-batch)
sees every storage an op creates (tensor subclasses such as FSDP's DTensors through their local
tensors) or resizes (FSDP2 frees and re-allocates unsharded parameters by `resize_`), and its
free through a weak reference; its peak over build and steps, in bytes, is what each rank reports,
with the bytes of fp32 parameters + grads + Adam state it holds after the last step (for the
FSDP 1/N check) and the largest number of bytes alive at any time during the build (what
sharded initialisation ever materialised).
"""

from __future__ import annotations

import json
import sys
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from tessera.common.layout import ParallelLayout
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.model import Transformer
from tessera.common.parallel.state import build_groups, init_distributed
from tessera.trainer.components.model_setup import apply_recompute
from tessera.trainer.config import OptimConfig, ParallelConfig, TrainingConfig
from tessera.trainer.parallel.runtime import ParallelRuntime


class PeakBytes(TorchDispatchMode):
    """Bytes of live storages created while active, and their peak. With a `budget` (bytes), an
    op that brings the live bytes above it raises MemoryError, as an allocator with that limit
    would refuse it: the run fails."""

    def __init__(self, budget: int | None = None):
        super().__init__()
        self.budget = budget
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        self._resize = torch.UntypedStorage.resize_

    def _track(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):
            for attr in t.__tensor_flatten__()[0]:
                inner = getattr(t, attr)
                if isinstance(inner, torch.Tensor):
                    self._track(inner)
            return
        st = t.untyped_storage()
        key = StorageWeakRef(st).cdata
        if key in self.live:
            return
        self.live[key] = st.nbytes()
        self._add(st.nbytes())
        weakref.finalize(st, self._free, key)

    def _add(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)
        if self.budget is not None and self.current > self.budget:
            raise MemoryError(f"{self.current} bytes alive exceed the budget of {self.budget}")

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out

    def __enter__(self):
        tracker, orig = self, self._resize

        def resize_(st, size):
            key = StorageWeakRef(st).cdata
            orig(st, size)
            if key in tracker.live:
                tracker._add(st.nbytes() - tracker.live[key])
                tracker.live[key] = st.nbytes()
            else:
                tracker.live[key] = st.nbytes()
                tracker._add(st.nbytes())
                weakref.finalize(st, tracker._free, key)

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        return super().__exit__(*exc)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _state_bytes(rt: ParallelRuntime) -> int:
    """Bytes of parameters + gradients + optimizer state this rank holds (distinct storages)."""
    seen: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        if t is None or not isinstance(t, torch.Tensor) or t.ndim == 0:
            return
        st = _local(t).untyped_storage()
        seen[st.data_ptr()] = st.nbytes()

    for s in rt.stages:
        for p in s.parameters():
            add(p)
            add(p.grad)
    opt = rt.optimizer
    for st in opt.inner.state.values():
        for t in st.values():
            add(t)
    for b in getattr(getattr(opt, "buckets", None), "buckets", []):
        add(b.grad_buf)
    for m in getattr(opt, "masters", []):
        add(m)
    return sum(seen.values())


def run_job(job: dict, cfg: ModelConfig) -> dict:
    layout = ParallelLayout(**job["layout"])
    groups = build_groups(layout)
    p = job["parallel"]
    training = TrainingConfig(seq_length=p["seq_len"], global_batch_size=p["global_batch"],
                              micro_batch_size=p["micro_batch"], precision=p.get("precision", "fp32"), seed=0)
    parallel = ParallelConfig(**layout.model_dump(exclude={"data"}), sequence_parallel=p.get("sequence_parallel", True),
                              distributed_optimizer=p.get("distributed_optimizer", True))

    def builder() -> Transformer:
        with torch.device("meta"):
            module = Transformer(cfg)
        apply_recompute(module, job.get("recompute", "none"))
        return module

    g = torch.Generator().manual_seed(0)
    rows = training.global_batch_size // groups.dp
    sl = slice(groups.dp_rank * rows, (groups.dp_rank + 1) * rows)
    inputs = None
    if "documents" in p:  # packed documents of these lengths in every row (attention per document)
        ids = torch.repeat_interleave(torch.arange(len(p["documents"])), torch.tensor(p["documents"]))
        inputs = {"document_ids": ids.expand(training.global_batch_size, -1)[sl].contiguous()}
    mt = PeakBytes(job.get("budget"))
    with mt:
        rt = ParallelRuntime.build(cfg, groups, training, parallel, OptimConfig(lr=1e-3), builder)
        build_peak = mt.peak
        for _ in range(job["steps"]):
            x = torch.randint(0, cfg.vocab_size, (training.global_batch_size, training.seq_length + 1), generator=g)
            rt.train_step(x[sl, :-1], x[sl, 1:], model_inputs=inputs)
        peak = mt.peak
    state = _state_bytes(rt)
    if hasattr(rt.optimizer, "buckets"):
        rt.optimizer.buckets.remove_hooks()
    return dict(peak=peak, build_peak=build_peak, state=state, pp_rank=groups.pp_rank)


def main(spec_path: str) -> None:
    torch.set_num_threads(1)
    spec = json.load(open(spec_path))
    init_distributed()
    cfg = ModelConfig(**spec["model"])
    results = []
    for job in spec["jobs"]:
        mine = run_job(job, ModelConfig(**job["model"]) if "model" in job else cfg)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results.append(dict(name=job["name"], ranks=gathered))
        dist.barrier()
    if dist.get_rank() == 0:
        json.dump(results, open(spec["out"], "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
