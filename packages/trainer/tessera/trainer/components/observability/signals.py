"""Graceful stop on SIGTERM/SIGINT: the loop finishes its current step, saves, and exits 0.

A preempted job (SLURM and Kubernetes send SIGTERM) thus loses nothing. A second SIGINT raises
KeyboardInterrupt at once (the handlers in place before are restored first), so Ctrl-C twice still
interrupts a run that hangs (exit 130, one line, also when it lands inside a checkpoint write).
Once a stop was requested and its save is done, the loop's exit leaves SIGTERM and SIGINT ignored
to the end of the process: schedulers repeat SIGTERM before the kill, and a second Ctrl-C that
arrives while the process is already tearing down must not turn the finished stop (exit 0) into a
death by signal (-15, -2).
"""

from __future__ import annotations

import signal
from types import FrameType


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            self.restore()
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def install(self) -> StopRequest:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self, after_stop: bool = False) -> None:
        """Put the previous handlers back. `after_stop` (the training loop's exit): when a stop was
        requested, both signals stay ignored until the process exits instead (module docstring)."""
        for sig, handler in self._previous.items():
            keep_ignoring = after_stop and self.signal_name is not None
            signal.signal(sig, signal.SIG_IGN if keep_ignoring else handler)
        self._previous.clear()
