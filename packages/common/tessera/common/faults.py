"""Named fault points for crash tests (the failpoints databases use).

    TESSERA_FAULT=<name>[@<n>][:hang]   SIGKILL (or, with :hang, sleep forever) the n-th time
                                        (default the first) execution passes fault_point(<name>)
    TESSERA_FAULT_RANK=<r>              only on this global rank (RANK), default every rank

A fault stands for one failure: it fires only in the first attempt of a torchrun job
(TORCHELASTIC_RESTART_COUNT 0 or unset), so a restarted job runs through. Unset, as in
production, a call is one comparison.

Instrumented: the checkpoint save sequence (tessera.trainer.components.checkpoint.storage: a test kills a run at
every step of a synchronous and a background save) and the training step (`train.step`: a test
kills one rank to exercise torchrun restarts, and hangs one to exercise the step watchdog).
"""

from __future__ import annotations

import os
import signal
import time

_SPEC = os.environ.get("TESSERA_FAULT") or None
_NAME, _, _REST = (_SPEC or "").partition("@")
_NAME = _NAME.partition(":")[0]
_NTH, _, _ACTION = _REST.partition(":") if _REST else ("1", "", (_SPEC or "").partition(":")[2])
_AT = int(_NTH or 1)
_HANG = _ACTION == "hang"
_RANK = os.environ.get("TESSERA_FAULT_RANK")
_ARMED = (_SPEC is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0
          and (_RANK is None or _RANK == os.environ.get("RANK", "0")))
_seen = 0


def fault_point(name: str) -> None:
    """Kill (or hang) this process here if TESSERA_FAULT names this point and this is the n-th pass."""
    global _seen
    if not _ARMED or name != _NAME:
        return
    _seen += 1
    if _seen != _AT:
        return
    if _HANG:
        while True:  # a rank stuck outside any collective: its peers wait in theirs
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)
