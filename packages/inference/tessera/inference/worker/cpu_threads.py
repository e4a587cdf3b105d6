"""How many torch threads tessera-serve computes with, and on which CPUs, when --torch-threads is
not given: the defaults of vLLM's CPU build (VLLM_CPU_OMP_THREADS_BIND=auto).

vLLM (0.32, utils/ompmultiprocessing.py) keeps one core per rank for its frontend and scheduler
processes and binds one OpenMP thread to each other physical core (one logical CPU per core),
the cores split among tensor-parallel ranks. torch's own default (a thread per core, unbound)
instead spins the engine's threads against the HTTP process and any other job on the machine
(issue 28: 151 output tok/s at torch's default on 2 cores with one kept busy, 962 with one thread).

So: of the CPUs this process may use (sched_getaffinity: taskset and cgroup cpusets are
honoured), one per physical core; the last core (tensor parallel N: the last N) is left to the
HTTP process and the driver, as far as every tensor-parallel worker keeps a core of its own; the
engine process is bound to the rest with one torch thread per core (tensor parallel: each worker
to its share; the driver, which only schedules and samples, keeps one unbound thread). The
engine thread of --no-engine-process shares its process with the event loop, so it gets the
count, not a binding. An explicit --torch-threads wins: that many threads everywhere, unbound.
The plan does not look at load: several servers on one machine would all pick the same cores,
so give each its own with taskset, or pass --torch-threads.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Binding:
    """One process's torch threads and the CPUs it is bound to (None: not bound)."""

    threads: int
    cpus: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ThreadPlan:
    engine: Binding  # the engine process or thread (under tensor parallel: the driver)
    workers: tuple[Binding, ...] = ()  # tensor-parallel workers, by rank
    reserved: tuple[int, ...] = ()  # the cores left to the HTTP process (and the driver)
    explicit: bool = False  # --torch-threads

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict) -> ThreadPlan:
        def b(x: dict) -> Binding:
            return Binding(int(x["threads"]), None if x["cpus"] is None else tuple(int(c) for c in x["cpus"]))

        return cls(b(d["engine"]), tuple(b(w) for w in d["workers"]), tuple(int(c) for c in d["reserved"]),
                   bool(d["explicit"]))

    def describe(self) -> str:
        """The startup line's words for it."""
        if self.explicit:
            return f"{_threads(self.engine.threads)} per process (--torch-threads)"
        if not self.workers and self.engine.cpus is None:  # the engine thread of --no-engine-process
            return _threads(self.engine.threads) + (", a core left to the event loop" if self.reserved else "")
        parts = [_binding(w) for w in self.workers] if self.workers else [_binding(self.engine)]
        text = ("tensor-parallel workers: " if self.workers else "") + "; ".join(parts)
        if self.reserved:
            text += f"; {_cpus(self.reserved)} left to the HTTP server" + (" and the driver" if self.workers else "")
        return text


def plan_threads(cpus: Sequence[int], *, tensor_parallel: int = 1, engine_process: bool = True,
                 explicit: int | None = None, core_of: Mapping[int, Hashable] | None = None) -> ThreadPlan:
    """The plan for the logical CPUs `cpus` (`core_of`: each CPU's physical core; default: its own)."""
    tp = max(1, tensor_parallel)
    if explicit is not None:
        b = Binding(explicit)
        return ThreadPlan(b, (b,) * tp if tp > 1 else (), explicit=True)
    if not cpus:
        raise ValueError("no CPUs to run on")
    first: dict[Hashable, int] = {}
    for cpu in sorted(cpus):  # one logical CPU per physical core: SMT siblings share its units
        first.setdefault(core_of.get(cpu, cpu) if core_of else cpu, cpu)
    cores = sorted(first.values())
    # A core per rank, as many as leave every worker a core of its own.
    split = len(cores) - max(0, min(tp, len(cores) - tp))
    compute, reserved = cores[:split], tuple(cores[split:])
    if tp == 1:
        engine = Binding(len(compute), tuple(compute) if engine_process else None)
        return ThreadPlan(engine, reserved=reserved)
    if len(compute) < tp:  # fewer cores than workers: one thread each, left to the kernel to place
        return ThreadPlan(Binding(1), (Binding(1),) * tp, reserved)
    size, extra = divmod(len(compute), tp)
    workers, start = [], 0
    for rank in range(tp):
        n = size + (rank < extra)
        workers.append(Binding(n, tuple(compute[start:start + n])))
        start += n
    return ThreadPlan(Binding(1), tuple(workers), reserved)


def physical_cores(cpus: Sequence[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> dict[int, Hashable]:
    """Each CPU's (package, core) from sysfs; a CPU whose topology cannot be read is its own core."""
    out: dict[int, Hashable] = {}
    for cpu in cpus:
        topo = sysfs / f"cpu{cpu}" / "topology"
        try:
            out[cpu] = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            out[cpu] = ("cpu", cpu)
    return out


def plan_for_this_machine(tensor_parallel: int, engine_process: bool, explicit: int | None) -> ThreadPlan:
    cpus = sorted(os.sched_getaffinity(0))
    return plan_threads(cpus, tensor_parallel=tensor_parallel, engine_process=engine_process, explicit=explicit,
                        core_of=physical_cores(cpus))


def apply_binding(binding: Binding) -> None:
    """Bind every thread of this process (importing torch may already have started one; threads
    started later inherit their creator's CPUs) and size torch's pool."""
    import torch

    if binding.cpus is not None:
        for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
            try:
                os.sched_setaffinity(int(tid), binding.cpus)
            except ProcessLookupError:
                pass  # that thread has ended
    torch.set_num_threads(binding.threads)


def measure(engine) -> dict:
    """What the engine's process (and each tensor-parallel worker, as it reported) computes with."""
    import torch

    executor = getattr(engine.runner, "executor", None)
    return {"threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0)),
            "workers": [asdict(b) for b in executor.bindings] if executor is not None else []}


def describe_measured(measured: dict, plan: ThreadPlan | None) -> str:
    """The startup line's words: the measured threads, with CPUs where the plan binds them."""
    if plan is None:
        return f"{_threads(measured['threads'])} (torch's default)"

    def seen(m: dict, planned: Binding) -> Binding:
        return Binding(int(m["threads"]), tuple(m["cpus"]) if planned.cpus is not None else None)

    workers = tuple(seen(m, b) for m, b in zip(measured["workers"], plan.workers))
    return ThreadPlan(seen(measured, plan.engine), workers, plan.reserved, plan.explicit).describe()


def _threads(n: int) -> str:
    return f"{n} torch thread{'s' if n != 1 else ''}"


def _binding(b: Binding) -> str:
    return _threads(b.threads) + (f" on {_cpus(b.cpus)}" if b.cpus is not None else " (unbound)")


def _cpus(cpus: Sequence[int]) -> str:
    """'CPU 3', 'CPUs 0-2,5'."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("CPU " if len(cpus) == 1 else "CPUs ") + text
