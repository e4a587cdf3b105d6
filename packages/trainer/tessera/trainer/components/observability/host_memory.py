"""Keep freed host memory in the process, so CPU training steps stop page-faulting.

A training step allocates and frees the same large tensors every step (activations, logits,
gradients: megabytes each). glibc's malloc serves blocks above its mmap threshold (at most
32 MiB) with a fresh mmap and unmaps them on free, and trims the heap top back to the OS; either
way the next step touches new pages, and the kernel zero-fills each one on first touch. On 2 CPU
cores that was about a fifth of a step (benchmarks/results/trainer.md). Turning mmap off for
malloc and raising the trim threshold keeps those pages mapped and reused. The cost: the
process's resident memory stays at its peak instead of shrinking between steps.

Process-wide (it changes the C allocator), glibc-only; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt parameter numbers from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 1 << 30  # return free heap-top memory to the OS only above 1 GiB


@functools.cache
def retain_freed_memory() -> bool:
    """Configure glibc malloc to reuse freed memory; True when it took effect (idempotent)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - present only in glibc, whose mallopt numbers these are
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
