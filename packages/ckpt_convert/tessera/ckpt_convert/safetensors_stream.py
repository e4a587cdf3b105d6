"""Read and write safetensors files one tensor at a time, without staging copies.

The format is simple and fixed: u64 little-endian header length, a JSON header with dtype, shape
and byte offsets (relative to the end of the header) per tensor, then the raw bytes.

Writing: `safetensors.torch.save_file` needs every tensor of a file in memory at once. Every shape
and dtype is known before conversion starts, so the header is written first and tensors are
appended as they are produced, each straight from its memory (an input's memory map when it
needs no change) or, when it must be materialised (a non-contiguous slice, another dtype),
through one reused staging buffer. A tensor may be given as parts to be concatenated along dim 0
(e.g. TensorRT-LLM's per-rank [Q; K; V]), which are then written one after the other instead of
being concatenated in memory. The result is read back by `safetensors` itself in the tests.

Reading: each tensor is a memory map of its bytes (mapped.py), not a copy.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from tessera.ckpt_convert.mapped import Staging, map_tensor, raw, write_bytes
from tessera.common.errors import ArtifactError

ST_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES_BY_NAME = {v: k for k, v in ST_DTYPES.items()}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class SafetensorsStreamWriter:
    """Writes exactly the planned tensors, in plan order, to an open binary file."""

    def __init__(self, f: BinaryIO, plan: list[PlannedTensor], metadata: dict[str, str] | None = None,
                 staging: Staging | None = None, sync: bool = True):
        """`sync`: the file will be fsynced by the caller, so start early writeback while writing."""
        self.f = f
        self.sync = sync
        self.plan = plan
        self.next = 0
        self.staging = staging or Staging()
        header: dict[str, object] = {"__metadata__": dict(metadata or {})} if metadata else {}
        offset = 0
        for t in plan:
            header[t.name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw_header = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw_header += b" " * (-len(raw_header) % 8)  # data starts 8-byte aligned, as safetensors itself writes
        f.write(struct.pack("<Q", len(raw_header)))
        f.write(raw_header)

    def write(self, name: str, tensor: torch.Tensor | list[torch.Tensor]) -> None:
        """Append the next planned tensor: one tensor, or parts that concatenate along dim 0 to it.
        Parts are converted to the planned dtype on the way (through the staging buffer)."""
        want = self.plan[self.next]
        parts = tensor if isinstance(tensor, list) else [tensor]
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:]) if parts[0].dim() else tuple(parts[0].shape)
        if name != want.name or tuple(shape) != want.shape or any(p.shape[1:] != parts[0].shape[1:] for p in parts):
            raise AssertionError(f"safetensors writer expected {want}, got {name} {[tuple(p.shape) for p in parts]}")
        for part in parts:
            if part.numel():
                # Bytes of a mapped input go file to file in the kernel; the rest with write().
                write_bytes(self.f, raw(self.staging.ready(part.detach(), want.dtype)), writeback=self.sync)
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.plan):
            raise AssertionError(f"safetensors writer: {len(self.plan) - self.next} planned tensors never written")


def fsync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


@dataclass(frozen=True)
class StoredTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """The index of one safetensors file (parsed and checked once), and its tensors, mapped."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 0 < n <= min(_MAX_HEADER, size - 8):
                    raise ValueError("header length out of range")
                header = json.loads(f.read(n))
            base = 8 + n
            self.tensors: dict[str, StoredTensor] = {}
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                dtype = DTYPES_BY_NAME.get(entry["dtype"])
                if dtype is None:
                    raise ValueError(f"tensor {name!r} has dtype {entry['dtype']}, which tessera-ckpt does not read")
                shape = tuple(int(d) for d in entry["shape"])
                start, end = (int(x) for x in entry["data_offsets"])
                if end - start != math.prod(shape) * dtype.itemsize or start < 0:
                    raise ValueError(f"tensor {name!r}: data_offsets {start}..{end} do not fit its shape and dtype")
                if base + end > size:
                    raise ValueError(f"tensor {name!r} ends at byte {base + end}, past the end of the file "
                                     f"({size} bytes): truncated")
                self.tensors[name] = StoredTensor(dtype, shape, base + start, end - start)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
            raise ArtifactError(f"{path}: not a readable safetensors file ({str(exc).splitlines()[0][:200]}); "
                                "it is corrupt or truncated") from None

    def get(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        return map_tensor(self.path, t.offset, t.dtype, t.shape)
