"""Write safetensors files one tensor at a time, without staging copies.

The format is simple and fixed: u64 little-endian header length, a JSON header with dtype, shape
and byte offsets (relative to the end of the header) per tensor, then the raw bytes.

Writing: `safetensors.torch.save_file` needs every tensor of a file in memory at once. Every shape
and dtype is known before conversion starts, so the header is written first and tensors are
appended as they are produced, each straight from its memory (an input's memory map when it
needs no change) or, when it must be materialised (a non-contiguous slice, another dtype),
through one reused staging buffer. A tensor may be given as parts to be concatenated along dim 0
(e.g. TensorRT-LLM's per-rank [Q; K; V]), which are then written one after the other instead of
being concatenated in memory. The result is read back by `safetensors` itself in the tests.

Reading is tessera.common.hf.directory's (SafetensorsFile: each tensor a memory map of its bytes).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

import torch

from tessera.ckpt_convert.mapped import Staging, raw, write_bytes
from tessera.common.hf.directory import SAFETENSORS_DTYPES

ST_DTYPES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}  # torch -> safetensors name


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
