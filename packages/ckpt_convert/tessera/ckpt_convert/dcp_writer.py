"""Write a DCP checkpoint as the ranks of a parallel layout would, from one process, streaming.

`torch.distributed.checkpoint.save` writes one file per rank from a live process group. Offline we
have one process and want the same result: file `__{r}_0.distcp` holding exactly the chunks that
rank r owns, and a `.metadata` index that lists, for every global tensor, its chunks (offsets and
sizes in global coordinates) and where each is stored. Any DCP reader (a rank of the target
layout, or a single process loading full tensors) then reads it as if DCP had written it.

The bytes follow DCP's own FileSystemWriter exactly: each chunk is `torch.save`d at the current
end of its rank's file and recorded as a `_StorageInfo(relative_path, offset, length)`; the index
is written by `FileSystemWriter.finish`. Tensors arrive one at a time, so memory holds one global
tensor and at most one staged chunk.

Speed: a chunk that is a contiguous block of its tensor (anything split along dim 0) is written
straight from the tensor's memory, never cloned (from a mapped input file: file to file in the
kernel, see mapped.write_bytes);
other chunks (dim-1 splits) are copied into one reused staging buffer. Each entry starts at a
64-byte boundary of its file (DCP readers go by offset and length, so the padding is invisible),
which keeps the tensor bytes aligned for memory-mapped reading. Every byte is hashed as it is
written, so the sidecar's checksums need no second pass over the output.
"""

from __future__ import annotations

import contextlib
import functools
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

from tessera.ckpt_convert.mapped import Staging, exact, write_bytes
from tessera.common.checkpoint import CHECKSUM_ALGORITHM
from tessera.common.errors import UserError
from tessera.common.fileio import HashingWriter

ENTRY_ALIGNMENT = 64


@dataclass(frozen=True)
class Chunk:
    """The block of a global tensor that `rank` stores: `sizes` elements from `offsets` per dim."""

    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@contextlib.contextmanager
def _without_crc32() -> Iterator[None]:
    """torch.save computes a CRC-32 per record by default, which doubles its cost; here it is
    redundant (the sidecar's checksum covers every byte of every file), so it is switched off for
    our own writes only and restored afterwards. Readers do not need it."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def _block(tensor: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    for dim, (off, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
        tensor = tensor.narrow(dim, off, size)
    return tensor


def whole(shape: tuple[int, ...], rank: int = 0) -> list[Chunk]:
    return [Chunk(rank, (0,) * len(shape), tuple(shape))]


def rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


# Descriptors the process holds besides the rank files (interpreter, libraries, the source
# checkpoint's mapped files, the hashing threads' pipes), with room to spare.
OTHER_OPEN_FILES = 64


def allow_open_files(ranks: int) -> None:
    """The writer keeps one file per target rank open: raise the soft limit on open files toward
    the hard one when that many need it, and refuse a layout past the hard limit in one line
    (--data-parallel 10^8 failed at the 20,000th file with EMFILE's traceback)."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to ask
        return
    need = ranks + OTHER_OPEN_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise UserError(f"the target layout has {ranks:,} ranks, whose files are written at once: more than the "
                        f"{hard:,} files this process may open (ulimit -Hn); choose a smaller layout or raise the limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


class ShardedDcpWriter:
    """Streams tensors into per-rank DCP files; `close()` writes the `.metadata` index."""

    def __init__(self, directory: Path, world_size: int, sync: bool = True):
        """`sync`: fsync every file at close (early writeback while writing); False: neither."""
        self.directory = directory
        self.sync = sync
        allow_open_files(world_size)
        directory.mkdir(parents=True, exist_ok=True)
        self.raw: list[BinaryIO] = []
        try:
            for r in range(world_size):
                self.raw.append(open(directory / rank_file(r), "wb"))
        except BaseException:
            self.abort()  # the files opened so far
            raise
        self.files = [HashingWriter(f, CHECKSUM_ALGORITHM, write=functools.partial(write_bytes, f, writeback=sync))
                      for f in self.raw]
        self.staging = Staging()
        self.state_md: dict[str, Any] = {}
        self.planner_data: dict[str, Any] = {}
        self.results: list[WriteResult] = []

    def _start_entry(self, rank: int) -> int:
        f = self.files[rank]
        pad = -f.tell() % ENTRY_ALIGNMENT
        if pad:
            f.write(bytes(pad))
        return f.tell()

    def write_tensor(self, key: str, tensor: torch.Tensor, chunks: list[Chunk], path: Any = None,
                     dtype: torch.dtype | None = None) -> int:
        """Store `chunks` of the global `tensor` (converted to `dtype` if given) under `key`;
        returns bytes written."""
        dtype = dtype or tensor.dtype
        md = TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=tensor.shape, chunks=[])
        written = 0
        for chunk in chunks:
            piece = _block(tensor, chunk)
            # torch.save writes a tensor's whole storage: give it one of exactly the chunk's bytes.
            piece = exact(self.staging.ready(piece, dtype))
            f = self.files[chunk.rank]
            offset = self._start_entry(chunk.rank)
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
        offset = self._start_entry(rank)
        f.write(data)
        self.state_md[key] = BytesStorageMetadata()
        self.planner_data[key] = path if path is not None else (key,)
        self.results.append(WriteResult(index=MetadataIndex(key), size_in_bytes=len(data),
                                        storage_data=_StorageInfo(rank_file(rank), offset, len(data),
                                                                  transform_descriptors=transform_descriptors)))
        return len(data)

    def close(self) -> dict[str, str]:
        """fsync (unless sync=False) and close the rank files, write `.metadata`; returns the rank
        files' checksums (file name -> CHECKSUM_ALGORITHM hex digest) for `finalize_checkpoint`."""
        try:
            for f in self.raw:
                f.flush()
                if self.sync:
                    os.fsync(f.fileno())
        finally:
            self.abort()  # every file closed, even after a failed flush (a full disk)
        metadata = Metadata(state_dict_metadata=self.state_md, planner_data=self.planner_data)
        FileSystemWriter(str(self.directory), sync_files=self.sync).finish(metadata, [self.results])
        return {rank_file(r): f.hexdigest() for r, f in enumerate(self.files)}

    def abort(self) -> None:
        for f in self.raw:
            with contextlib.suppress(OSError):  # closed anyway: a failed final flush must not keep the rest open
                f.close()


def write_imported_checkpoint(tmp: Path, tensors: Iterator[tuple[str, torch.Tensor]], cfg: Any, tokenizer: Any,
                              out_dtype: torch.dtype, imported_from: dict, bar: Any, sync: bool,
                              generation: Any = None) -> None:
    """An imported model as a one-rank checkpoints directory under `tmp` (renamed by the caller's
    atomic_directory): every (name, global tensor) written as `model.<name>` in `out_dtype`, hashed as
    written, then the tokenizer, the sidecar (last; `imported_from` recorded, and `generation`: the
    model's generation settings, when its source has them) and the pointer. Shared by `import --format
    hf` and `--format megatron`."""
    from tessera.common.checkpoint import CheckpointSidecar, finalize_checkpoint, iter_dir_name, write_pointer
    from tessera.common.fileio import fsync_tree

    target = tmp / iter_dir_name(0)
    writer = ShardedDcpWriter(target, 1, sync=sync)
    try:
        for name, tensor in tensors:
            # A view or another dtype is materialised by the writer in its reused staging buffer.
            writer.write_tensor("model." + name, tensor, whole(tuple(tensor.shape)), dtype=out_dtype)
            bar.update(tensor.numel() * out_dtype.itemsize)
            del tensor
    except BaseException:
        writer.abort()
        raise
    checksums = writer.close()
    if tokenizer is not None:
        tokenizer.save(target / "tokenizer")
        if sync:
            fsync_tree(target / "tokenizer")
    sidecar = CheckpointSidecar(model=cfg, tokenizer_fingerprint=tokenizer.fingerprint if tokenizer else None,
                                params_dtype=str(out_dtype).removeprefix("torch."), generation=generation)
    sidecar.imported_from = imported_from  # type: ignore[attr-defined]  # extra field, kept by the sidecar model
    finalize_checkpoint(target, sidecar, checksums, sync=sync)  # rank files hashed as written; .metadata here
    write_pointer(tmp, 0, sync=sync)
