"""tests/conftest.py's session-end guard, through a real pytest run (in-process and under an xdist worker): a test that leaves a daemon
child ignoring SIGTERM (what once hung two full-suite runs at exit, multiprocessing's exit handler
joining it forever) makes pytest name the child, kill it, fail the run and exit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

LEAKY = '''
import multiprocessing as mp
import signal
import time


def _stubborn():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)


def test_leaves_a_child_behind():
    mp.get_context("fork").Process(target=_stubborn, daemon=True, name="stubborn").start()
'''


@pytest.mark.parametrize("workers", [[], ["-n", "1"]], ids=["in-process", "xdist-worker"])
def test_a_process_left_running_by_a_test_is_named_killed_and_fails_the_run_instead_of_hanging_its_exit(
        tmp_path, workers):
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                          "--rootdir", ".", *workers, "test_leaky.py"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert "1 passed" in out, out
    assert "1 process(es) started by the tests were still running at the end (killed)" in out, out
    named = out.split("(killed):", 1)[1]
    if not workers:  # a forked child bears its parent's command line: pytest's here, an xdist worker's there
        assert "test_leaky.py" in named, out
    pid = int(re.search(r"pid (\d+):", named).group(1))
    assert not _running(pid), out  # killed, not only named
    assert run.returncode == 1, out


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
