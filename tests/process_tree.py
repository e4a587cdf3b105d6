"""Which processes a test (or the whole session) left behind, found by pid, never by timing: the
test helpers (LiveServer.stop, the tessera-serve signal tests) and tests/conftest.py's session-end
guard use it, so a leaked serving process fails the test that leaked it instead of hanging
pytest's exit (multiprocessing's exit handler joins every daemon child it started)."""

from __future__ import annotations

import time

import psutil

# Helpers that live until the interpreter that started them exits, and that it then ends itself:
# multiprocessing's resource tracker (started with the first spawned process) and torch inductor's
# compile-worker pool (started by the first compile). Not a server's.
_HELPERS = ("multiprocessing.resource_tracker", "_inductor/compile_worker")


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {p.pid}: (gone)"


def descendants(pid: int | None = None) -> list[psutil.Process]:
    """Every running process below `pid` (default: this one), multiprocessing's own helpers left out."""
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for p in below:
        try:
            if _running(p) and not any(h in " ".join(p.cmdline()) for h in _HELPERS):
                out.append(p)
        except psutil.Error:
            continue
    return out


def still_running(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of `procs` still running after waiting up to `timeout` s for them to end (a loaded
    machine can take seconds to reap a process that has been told to stop)."""
    deadline = time.monotonic() + timeout
    left = [p for p in procs if _running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if _running(p)]
    return left


def kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def assert_gone(procs: list[psutil.Process], what: str, timeout: float = 20.0) -> None:
    """Fail, naming each pid and its command line, if any of `procs` outlives `timeout` s; kill
    those first, so the leak fails this test alone."""
    left = still_running(procs, timeout)
    if left:
        names = "; ".join(describe(p) for p in left)
        kill(left)
        raise AssertionError(f"{what} left {len(left)} process(es) running {timeout:.0f} s after it stopped "
                             f"(killed now): {names}")
