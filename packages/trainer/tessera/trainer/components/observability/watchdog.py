"""training.step_timeout_minutes: a rank that makes no progress for that long dumps the Python stack
of every thread and exits 1, instead of waiting out the process group's timeout in silence.

A hung job is usually one rank stuck (a dead NFS mount, a deadlock, a GPU fault) while every other
rank waits for it inside a collective; each rank runs its own watchdog, so within the timeout
every rank prints where it is: the stuck one its own frame, the others the collective they wait
in (the frame names it, e.g. `all_reduce` in the optimizer step). Exiting non-zero lets torchrun
tear the job down, and restart it from the last checkpoint under --max-restarts.

The loop reports progress (`beat`) at the start of each step, before each evaluation and before
each save, so the timeout must cover the longest of those. It is armed after the first step (which
may compile). A Python thread does the watching; as a backstop for a hang that holds the GIL,
faulthandler's own C thread dumps and exits a minute later.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time


class StepWatchdog:
    def __init__(self, timeout_minutes: float | None, rank: int):
        self.timeout = None if timeout_minutes is None else 60.0 * timeout_minutes
        self.rank = rank
        self.doing = "starting"
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, doing: str) -> None:
        """Progress: what the rank does next. Arms the watchdog on first call."""
        if self.timeout is None:
            return
        self.doing, self._last = doing, time.monotonic()
        faulthandler.dump_traceback_later(self.timeout + 60, exit=True, file=sys.stderr)
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="tessera-watchdog", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        assert self.timeout is not None
        while not self._stop.wait(min(1.0, self.timeout / 10)):
            idle = time.monotonic() - self._last
            if idle >= self.timeout:
                print(f"tessera-train: rank {self.rank}: no progress for {idle:.0f}s (training.step_timeout_minutes="
                      f"{self.timeout / 60:g}) while {self.doing}; Python stacks of every thread follow, then exit 1",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(1)

    def stop(self) -> None:
        if self.timeout is None:
            return
        faulthandler.cancel_dump_traceback_later()
        self._stop.set()
