"""Write a DCP checkpoint as the ranks of a parallel layout would, from one process, streaming.

`torch.distributed.checkpoint.save` writes one file per rank from a live process group. Offline we
have one process and want the same result: file `__{r}_0.distcp` holding exactly the chunks that
rank r owns, and a `.metadata` index that lists, for every global tensor, its chunks (offsets and
sizes in global coordinates) and where each is stored. Any DCP reader (a rank of the target
layout, or a single process loading full tensors) then reads it as if DCP had written it.

The bytes follow DCP's own FileSystemWriter exactly: each chunk is `torch.save`d at the current
end of its rank's file and recorded as a `_StorageInfo(relative_path, offset, length)`; the index
is written by `FileSystemWriter.finish`. Tensors arrive one at a time, so memory holds one global
tensor and one chunk copy.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo  # DCP's per-item storage record
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult


@dataclass(frozen=True)
class Chunk:
    """The block of a global tensor that `rank` stores: `sizes` elements from `offsets` per dim."""

    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@contextlib.contextmanager
def _without_crc32() -> Iterator[None]:
    """torch.save computes a CRC-32 per record by default, which doubles its cost; here it is
    redundant (the sidecar's SHA-256 covers every byte of every file), so it is switched off for
    our own writes only and restored afterwards. Readers do not need it."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def whole(shape: tuple[int, ...], rank: int = 0) -> list[Chunk]:
    return [Chunk(rank, (0,) * len(shape), tuple(shape))]


def rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


class ShardedDcpWriter:
    """Streams tensors into per-rank DCP files; `close()` writes the `.metadata` index."""

    def __init__(self, directory: Path, world_size: int):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.files: list[BinaryIO] = [open(directory / rank_file(r), "wb") for r in range(world_size)]
        self.state_md: dict[str, Any] = {}
        self.planner_data: dict[str, Any] = {}
        self.results: list[WriteResult] = []

    def write_tensor(self, key: str, tensor: torch.Tensor, chunks: list[Chunk], path: Any = None) -> int:
        """Store `chunks` of the global `tensor` under `key`; returns bytes written."""
        md = TensorStorageMetadata(properties=TensorProperties(dtype=tensor.dtype), size=tensor.shape, chunks=[])
        written = 0
        for chunk in chunks:
            piece = tensor
            for dim, (off, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                piece = piece.narrow(dim, off, size)
            piece = piece.contiguous()
            if piece.untyped_storage().nbytes() != piece.nbytes:
                # torch.save writes a view's whole storage; a chunk must store only itself.
                piece = piece.clone()
            f = self.files[chunk.rank]
            offset = f.tell()
            with _without_crc32():
                torch.save(piece, f)
            length = f.tell() - offset
            index = MetadataIndex(key, chunk.offsets, len(md.chunks))
            md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)))
            self.results.append(WriteResult(index=index, size_in_bytes=length,
                                            storage_data=_StorageInfo(rank_file(chunk.rank), offset, length)))
            written += length
        self.state_md[key] = md
        self.planner_data[key] = path if path is not None else (key,)
        return written

    def write_bytes(self, key: str, data: bytes, rank: int = 0, transform_descriptors: Any = None,
                    path: Any = None) -> int:
        """Store an already-serialised non-tensor entry verbatim (never unpickled here)."""
        f = self.files[rank]
        offset = f.tell()
        f.write(data)
        self.state_md[key] = BytesStorageMetadata()
        self.planner_data[key] = path if path is not None else (key,)
        self.results.append(WriteResult(index=MetadataIndex(key), size_in_bytes=len(data),
                                        storage_data=_StorageInfo(rank_file(rank), offset, len(data),
                                                                  transform_descriptors=transform_descriptors)))
        return len(data)

    def close(self) -> None:
        for f in self.files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        metadata = Metadata(state_dict_metadata=self.state_md, planner_data=self.planner_data)
        FileSystemWriter(str(self.directory)).finish(metadata, [self.results])

    def abort(self) -> None:
        for f in self.files:
            f.close()
