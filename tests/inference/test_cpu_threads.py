"""tessera-serve's default CPU threads (cpu_threads.py), as vLLM's CPU build picks them: a core left
to the HTTP process, one torch thread bound to each other physical core, split among
tensor-parallel workers, never more compute threads than free cores; --torch-threads wins."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from ports import start_serve

from tessera.inference.worker.cpu_threads import Binding, ThreadPlan, physical_cores, plan_threads


def test_two_cores_leave_one_to_the_http_server_and_bind_one_thread_to_the_other():
    plan = plan_threads([0, 1])
    assert plan == ThreadPlan(Binding(1, (0,)), reserved=(1,))
    assert plan.describe() == "1 torch thread on CPU 0; CPU 1 left to the HTTP server"


def test_a_single_core_is_shared_with_the_http_server():
    assert plan_threads([3]) == ThreadPlan(Binding(1, (3,)))


def test_smt_siblings_count_as_one_core():
    core_of = {cpu: cpu % 4 for cpu in range(8)}  # 0 and 4 share a core, and so on
    plan = plan_threads(range(8), core_of=core_of)
    assert plan == ThreadPlan(Binding(3, (0, 1, 2)), reserved=(3,))
    assert plan.describe() == "3 torch threads on CPUs 0-2; CPU 3 left to the HTTP server"


def test_only_the_cpus_this_process_may_use_are_planned():
    assert plan_threads([2, 5, 7]) == ThreadPlan(Binding(2, (2, 5)), reserved=(7,))


def test_tensor_parallel_workers_each_get_their_share_and_the_driver_one_thread():
    plan = plan_threads(range(9), tensor_parallel=2)  # a core per rank is left, as vLLM does
    assert plan == ThreadPlan(Binding(1), (Binding(4, (0, 1, 2, 3)), Binding(3, (4, 5, 6))), reserved=(7, 8))
    assert plan.describe() == ("tensor-parallel workers: 4 torch threads on CPUs 0-3; 3 torch threads on "
                               "CPUs 4-6; CPUs 7-8 left to the HTTP server and the driver")


def test_fewer_cores_are_reserved_when_a_worker_would_go_without_one():
    assert plan_threads([0, 1], tensor_parallel=2) == ThreadPlan(Binding(1), (Binding(1, (0,)), Binding(1, (1,))))
    assert plan_threads(range(3), tensor_parallel=2) == ThreadPlan(
        Binding(1), (Binding(1, (0,)), Binding(1, (1,))), reserved=(2,))
    # More workers than cores: one thread each, placed by the kernel.
    assert plan_threads([0, 1], tensor_parallel=4) == ThreadPlan(Binding(1), (Binding(1),) * 4)


def test_the_engine_thread_mode_gets_the_count_but_no_binding():
    plan = plan_threads(range(4), engine_process=False)
    assert plan == ThreadPlan(Binding(3), reserved=(3,))
    assert plan.describe() == "3 torch threads, a core left to the event loop"


def test_an_explicit_torch_threads_wins_everywhere_unbound():
    assert plan_threads(range(8), explicit=4) == ThreadPlan(Binding(4), explicit=True)
    assert plan_threads(range(8), tensor_parallel=2, explicit=1) == ThreadPlan(
        Binding(1), (Binding(1), Binding(1)), explicit=True)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_never_more_bound_threads_than_free_cores_and_never_on_the_reserved_one(tp):
    for n in range(1, 17):
        plan = plan_threads(range(n), tensor_parallel=tp)
        bound = [b for b in (plan.engine, *plan.workers) if b.cpus is not None]
        used = [c for b in bound for c in b.cpus]
        assert all(b.threads == len(b.cpus) for b in bound)
        assert len(used) == len(set(used)) and not set(used) & set(plan.reserved)
        assert len(used) + len(plan.reserved) <= n and len(plan.workers) == (tp if tp > 1 else 0)
        assert plan.reserved == tuple(range(n - max(0, min(tp, n - tp)), n))


def test_physical_cores_reads_sysfs_and_falls_back_to_one_core_per_cpu(tmp_path):
    for cpu, core in [(0, 0), (1, 0)]:
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    cores = physical_cores([0, 1, 2], tmp_path)
    assert cores[0] == cores[1] != cores[2]


def _cpu_list(text: str) -> frozenset[int]:
    """/proc's '0-2,5' -> {0, 1, 2, 5}."""
    out: set[int] = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return frozenset(out)


def _engine_threads_line(ckpt: Path, cpus: list[int]) -> tuple[str, set[frozenset[int]]]:
    """Start tessera-serve confined to `cpus` (as taskset would) and return its startup line."""
    code = f"import os; os.sched_setaffinity(0, {cpus!r}); from tessera.inference.entrypoints.serve_cli import entry; entry()"
    proc, _, lines = start_serve([sys.executable, "-c", code], "--checkpoint", ckpt, "--quiet", "--num-kv-blocks", "64")
    try:
        line = lines[-1]
        pid = int(re.search(r"engine process (\d+)", line).group(1))
        # Every thread of the engine process (torch's pool included) runs where the plan says.
        allowed = {_cpu_list(Path(t, "status").read_text().split("Cpus_allowed_list:")[1].split()[0])
                   for t in Path(f"/proc/{pid}/task").iterdir()}
        return line, allowed
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU affinity is Linux's")
def test_the_served_engine_runs_with_the_chosen_threads_on_the_chosen_cpus(tiny_ckpt):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    plan = plan_threads(cpus, core_of=physical_cores(cpus))
    line, allowed = _engine_threads_line(tiny_ckpt, cpus)
    assert plan.describe() in line, line  # the thread count as measured inside the engine process
    assert allowed == {frozenset(plan.engine.cpus)}, allowed
