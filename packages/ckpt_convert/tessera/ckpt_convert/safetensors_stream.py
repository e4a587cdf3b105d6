"""Write safetensors files one tensor at a time, so memory holds one tensor, not one shard.

`safetensors.torch.save_file` needs every tensor of a file in memory at once. The format is
simple and fixed (u64 little-endian header length, a JSON header with dtype/shape/byte offsets
per tensor, then the raw bytes), and every shape and dtype is known before conversion starts,
so the header is written first and tensors are appended as they are produced. The result is
read back by `safetensors.safe_open` in the tests.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

import torch

ST_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


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

    def __init__(self, f: BinaryIO, plan: list[PlannedTensor], metadata: dict[str, str] | None = None):
        self.f = f
        self.plan = plan
        self.next = 0
        header: dict[str, object] = {"__metadata__": dict(metadata or {})} if metadata else {}
        offset = 0
        for t in plan:
            header[t.name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors itself writes
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want = self.plan[self.next]
        if name != want.name or tuple(tensor.shape) != want.shape or tensor.dtype != want.dtype:
            raise AssertionError(f"safetensors writer expected {want}, got {name} {tuple(tensor.shape)} {tensor.dtype}")
        flat = tensor.detach().contiguous().reshape(-1)
        self.f.write(memoryview(flat.view(torch.uint8).numpy()))
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.plan):
            raise AssertionError(f"safetensors writer: {len(self.plan) - self.next} planned tensors never written")


def fsync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())
