"""tests/conftest.py's session-end guard, through a real pytest run: a test that leaves a daemon
child ignoring SIGTERM (what once hung two full-suite runs at exit, multiprocessing's exit handler
joining it forever) makes pytest name the child, kill it, fail the run and exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_a_process_left_running_by_a_test_is_named_killed_and_fails_the_run_instead_of_hanging_its_exit(tmp_path):
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                          "--rootdir", ".", "test_leaky.py"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert "1 passed" in out, out
    assert "1 process(es) started by the tests were still running at the end (killed)" in out, out
    assert "test_leaky.py" in out.split("(killed):", 1)[1], out  # its command line names it
    assert run.returncode == 1, out
