"""Shared fixtures: small deterministic artifacts built in temporary directories."""

from __future__ import annotations

import os

import pytest
import torch

# Tests are sized for 2 cores; one thread per process keeps parallel workers from thrashing.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# CPU engines serve eagerly in tests unless a test asks for compile (EngineConfig.cpu_compile): each
# compiled engine start takes tens of seconds (tessera.inference.config.CPU_COMPILE_ENV; set before any
# test starts a server or worker process, which inherit it).
os.environ.setdefault("TESSERA_CPU_COMPILE", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Under pytest-xdist the controller's children are the workers: each worker checks its own processes
# and hands what it found to the controller (workeroutput), which reports it and fails the run.
_LEFT_BY_WORKERS: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _LEFT_BY_WORKERS.extend(getattr(node, "workeroutput", {}).get("left_running", []))


def pytest_sessionfinish(session, exitstatus):
    """No process may outlive the tests: one still running here would hang pytest's exit
    (multiprocessing's exit handler joins its daemon children, and waits forever on one that
    ignores SIGTERM). Name each, kill it, and fail the run."""
    from process_tree import descendants, describe, kill, still_running

    config = session.config
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        left = still_running(descendants(), timeout=5)
        config.workeroutput["left_running"] = [describe(p) for p in left]
        kill(left)
        return
    if getattr(config.option, "numprocesses", None):
        names = list(_LEFT_BY_WORKERS)
    else:
        left = still_running(descendants(), timeout=5)
        names = [describe(p) for p in left]
        kill(left)
    if not names:
        return
    config.get_terminal_writer().line(
        f"\nERROR: {len(names)} process(es) started by the tests were still running at the end (killed):\n  "
        + "\n  ".join(names), red=True, bold=True)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
