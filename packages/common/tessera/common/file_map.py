"""Regions of files as tensors without copies: private memory maps that live as long as their views.

`map_bytes` / `map_tensor`: a region of a file as a private (copy-on-write) memory map: the pages
are the page cache's own, nothing is allocated or copied, and code that wrote into an input tensor
would change only its private copy, never the file. The map lives as long as the tensor over it
(then it is unmapped), so resident memory follows the live tensors. Every live map is remembered,
so `file_region` can say which file bytes a buffer shows (tessera-ckpt copies those file to file
in the kernel: tessera.ckpt_convert.mapped.write_bytes).

Why here, in common: the one reader of Hugging Face safetensors weights (tessera.common.hf.directory)
maps its tensors, for `tessera-ckpt import` and for the server loading an HF directory alike.
"""

from __future__ import annotations

import math
import mmap
import os
import weakref
from typing import Any

import numpy as np
import torch


def map_bytes(path: str | os.PathLike, offset: int, length: int) -> memoryview:
    """Bytes [offset, offset + length) of a file as a private memory map (ValueError if the file
    is shorter). The map is unmapped when the last view of it goes away."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        if offset + length > os.fstat(f.fileno()).st_size:
            raise ValueError(f"{path}: bytes {offset}..{offset + length} lie past the end of the file")
        mapped = mmap.mmap(f.fileno(), length + offset - start, offset=start, access=mmap.ACCESS_COPY)
    view = memoryview(mapped)
    base = _address(view)
    _MAPS[base] = (len(view), os.fspath(path), start)
    weakref.finalize(mapped, _MAPS.pop, base, None)  # forgotten when unmapped
    return view[offset - start:]


# Live maps made by map_bytes: start address -> (length, file path, file offset of the start).
_MAPS: dict[int, tuple[int, str, int]] = {}


def file_region(data: Any) -> tuple[str, int] | None:
    """(path, offset) of the file bytes that `data` (a buffer) shows, if it lies in a live map."""
    view = memoryview(data)
    if not view.contiguous or view.nbytes == 0:
        return None
    address = np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data
    for base, (length, path, file_offset) in _MAPS.items():
        if base <= address and address + view.nbytes <= base + length:
            return path, file_offset + (address - base)
    return None


def map_tensor(path: str | os.PathLike, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous tensor stored raw at `offset` of a file (e.g. a safetensors entry), mapped."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    data = map_bytes(path, offset, nbytes)
    if (_address(data) % dtype.itemsize) != 0:  # misaligned elements: copy rather than risk it
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0
