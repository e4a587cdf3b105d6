"""Graceful stop on SIGTERM/SIGINT: the loop finishes its current step, saves, and exits 0.

A preempted job (SLURM and Kubernetes send SIGTERM) thus loses nothing. A second SIGINT raises
KeyboardInterrupt at once (the handlers in place before are restored first), so Ctrl-C twice still
interrupts a run that hangs.
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

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
