"""Named fault points for crash tests (the failpoints databases use): `TESSERA_FAULT=<name>[@<n>]`
SIGKILLs the process the n-th time (default the first) execution passes `fault_point(<name>)`, as
a power cut or an OOM kill would. Unset, as in production, a call is one comparison.

The checkpoint save sequence is instrumented (tessera.trainer.checkpointing): a test kills a
training run at every step of a synchronous and a background save and checks that no directory
ever carries a final name before its sidecar is durable, and that resuming yields the
uninterrupted run's weights (tests/trainer/test_crash_during_save.py).
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("TESSERA_FAULT") or None
_NAME, _, _NTH = (_SPEC or "").partition("@")
_AT = int(_NTH) if _NTH else 1
_seen = 0


def fault_point(name: str) -> None:
    """Kill this process here if TESSERA_FAULT names this point (and this is the n-th pass)."""
    global _seen
    if _SPEC is None or name != _NAME:
        return
    _seen += 1
    if _seen == _AT:
        os.kill(os.getpid(), signal.SIGKILL)
