"""User-facing errors and the CLI wrapper that turns them into one line and an exit code.

A `UserError` is a problem the user can fix (bad argument, missing or corrupt file, wrong
tokenizer). CLIs print its message on one line to stderr, without a traceback, and exit 2.
A `RunError` is a run that had to stop (training diverged): one line, exit 1.
A full disk or quota (ENOSPC, EDQUOT) or a read-only file system, however deep it is raised
(DCP wraps each rank's error), is one line naming the file, exit 1: every writer writes under a
temporary name, so nothing half-written is left under a final name.
Out of memory (device or host) is one line, exit 1 (tessera-train's names what to change).
Anything else is a bug or an environment failure: exit 1 with the traceback.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from typing import NoReturn

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class UserError(Exception):
    """A problem with the user's input: message names the file or field and what to do."""


class ArtifactError(UserError):
    """An artifact on disk is missing, malformed, corrupt, or incompatible with another."""


class RunError(Exception):
    """A run that cannot go on for a reason the user must act on (e.g. training diverged): the
    message says what happened and what to do; CLIs print it on one line and exit 1."""


def fail(message: str) -> NoReturn:
    raise UserError(message)


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> NoReturn:
    """Run a CLI entry point: a UserError is one stderr line and exit 2, a RunError one line and exit 1."""
    prog = sys.argv[0].rsplit("/", 1)[-1] if sys.argv else "tessera"
    try:
        code = main(argv)
    except (UserError, RunError) as exc:
        message = " ".join(str(exc).split("\n")).strip()
        print(f"{prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE if isinstance(exc, UserError) else EXIT_FAILURE)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    except BaseException as exc:
        if _find(exc, lambda e: isinstance(e, KeyboardInterrupt)) is not None:  # e.g. inside a DCP save
            print(f"{prog}: interrupted", file=sys.stderr)
            sys.exit(130)
        full = storage_exhausted(exc)
        if full is None:
            oom = out_of_memory(exc)
            if oom is None:
                raise
            # A stage without its own account of it (tessera-train gives one): still no traceback.
            print(f"{prog}: error: {describe_out_of_memory(oom)}", file=sys.stderr)
            sys.exit(EXIT_FAILURE)
        where = full.filename or "writing output"
        print(f"{prog}: error: {where}: {os.strerror(full.errno or 0)}; nothing half-written was left under a final "
              "name; free space (or fix the mount) and run again", file=sys.stderr)
        sys.exit(EXIT_FAILURE)
    sys.exit(int(code or 0))


_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def out_of_memory(exc: BaseException) -> BaseException | None:
    """The out-of-memory error inside `exc`, if there is one: torch.OutOfMemoryError (a device's
    allocator), the CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory",
    the same condition in host memory, which torch raises as a plain RuntimeError), Python's
    MemoryError, or an OSError ENOMEM (a fork, an mmap, a pinned buffer the kernel refused). Found
    through causes and DCP's per-rank failures, as storage_exhausted is."""
    def oom(e: BaseException) -> bool:
        return (type(e).__name__ == "OutOfMemoryError" or isinstance(e, MemoryError)
                or (isinstance(e, OSError) and e.errno == errno.ENOMEM)
                or (isinstance(e, RuntimeError) and "DefaultCPUAllocator" in str(e) and "allocate" in str(e)))

    return _find(exc, oom)


def storage_exhausted(exc: BaseException) -> OSError | None:
    """The OSError meaning "the disk is full / read-only" inside `exc`, if there is one; of several
    (a close() that fails again while cleaning up after the first), one that names its file."""
    def full(e: BaseException) -> bool:
        return isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS

    found = _find(exc, lambda e: full(e) and getattr(e, "filename", None) is not None) or _find(exc, full)
    return found if isinstance(found, OSError) else None


_SIZE = r"([0-9.]+ [KMGTP]?i?B)"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def describe_out_of_memory(oom: BaseException, device_index: int | None = None) -> str:
    """"out of device memory: tried to allocate 2.00 GiB, 1.23 GiB free of 79.11 GiB" from an error
    out_of_memory found: what was asked from the error's message, what was free from it or, when
    the message lacks it, from torch.cuda.mem_get_info (device) or the host's available memory."""
    import re

    text = str(oom)
    host = not (type(oom).__name__ == "OutOfMemoryError")
    asked = free = total = None
    if host:
        m = re.search(r"tried to allocate (\d+) bytes", text)
        asked = _gib(int(m.group(1))) if m else None
        try:
            import psutil

            memory = psutil.virtual_memory()
            free, total = _gib(memory.available), _gib(memory.total)
        except (ImportError, OSError):
            pass
    else:
        asked, free, total = (m.group(1) if (m := re.search(pattern, text)) else None for pattern in (
            r"Tried to allocate " + _SIZE, r"of which " + _SIZE + " is free", r"total capacity of " + _SIZE))
        torch = sys.modules.get("torch")
        if free is None and torch is not None and torch.cuda.is_available():
            try:
                got = torch.cuda.mem_get_info(device_index if device_index is not None else torch.cuda.current_device())
                free, total = _gib(got[0]), _gib(got[1])
            except RuntimeError:
                pass
    line = f"out of {'host' if host else 'device'} memory"
    if asked is not None:
        line += f": tried to allocate {asked}"
    if free is not None:
        line += ("," if asked is not None else ":") + f" {free} {'available' if host else 'free'}"
        line += f" of {total}" if total is not None else ""
    return line


def _find(exc: BaseException | None, wanted: Callable[[BaseException], bool], depth: int = 0) -> BaseException | None:
    """`exc` itself, its cause or context, or one of the per-rank failures DCP's CheckpointException
    carries, whichever first satisfies `wanted`."""
    if depth > 8 or exc is None:
        return None
    if wanted(exc):
        return exc
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException) and (found := _find(inner, wanted, depth + 1)) is not None:
                return found
    for linked in (exc.__cause__, exc.__context__):
        if (found := _find(linked, wanted, depth + 1)) is not None:
            return found
    return None
