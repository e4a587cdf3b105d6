"""Parsing of command-line values shared by the verbs: dtypes and byte sizes; the durability choice."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from tessera.common.errors import UserError

if TYPE_CHECKING:
    import torch

# Names only: torch is imported when a dtype is parsed, so `--help` answers without loading it.
DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}
DTYPE_CHOICES = ("bf16", "fp16", "fp32")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


# Every writing verb takes `sync: bool` (default True) in its typed options or signature, and the
# CLI's --no-sync sets it False. True: every output file is fsynced (with early writeback while it
# is written), then the output directory is renamed into place and its parent fsynced: the output
# survives a power loss once the command returns. False: no fsync, no early writeback, no directory
# fsync (what torch.distributed.checkpoint's FileSystemWriter(sync_files=False) and `cp` do); the
# output is still built under a temporary name and renamed only when whole, so a crash or kill of
# the process never leaves a partial output under the final name, but a power loss or kernel crash
# in the next seconds (until the kernel writes the pages back) can lose or truncate it.
NO_SYNC_HELP = ("do not fsync the output (faster; as cp or DCP's sync_files=False): it is still renamed into "
                "place only when complete, so a crash of this process never leaves a partial output, but a "
                "power loss or OS crash shortly after can lose it. Default: fsync every file before the rename")


def parse_dtype(value: str | None, flag: str = "--dtype") -> torch.dtype | None:
    if value is None:
        return None
    if value.lower() not in DTYPES:
        raise UserError(f"{flag} {value!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    import torch

    return getattr(torch, DTYPES[value.lower()])


def parse_size(value: str, flag: str = "--max-shard-size") -> int:
    """'5GB' (10^9, as transformers counts), '500MiB', '1048576' -> bytes."""
    m = _SIZE_RE.match(value)
    unit = (m.group(2) or "").upper() if m else ""
    if not m or unit not in _UNITS:
        raise UserError(f"{flag} {value!r}: expected a size such as 5GB, 500MB or 2GiB")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise UserError(f"{flag} {value!r}: must be positive")
    return size
