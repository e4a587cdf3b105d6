"""Tensor bytes without staging copies: memory-mapped reads, exact-storage views, a reused buffer.

Why: a converter moves every byte of a checkpoint once. Reading each tensor into a fresh buffer
costs a copy plus a page fault per 4 KiB of new memory (on the dev VM first-touch faults cost more
than the copy), and `torch.save` of a slice writes its whole storage unless the slice is cloned.
Here instead:

- `map_bytes` / `map_tensor` (tessera.common.file_map, shared with the HF directory reader that
  serving uses too): a region of a file as a private (copy-on-write) memory map: the pages are
  the page cache's own, nothing is allocated or copied, and a converter that wrote into an input
  tensor would change only its private copy, never the file. The map lives as long as the tensor
  over it (then it is unmapped), so resident memory follows the live tensors.
- `load_saved_tensor`: a `torch.save` archive stored inside a larger file (a DCP entry) loaded
  over such a map, through torch's own loader (`torch.serialization._load` with the mapped bytes
  as its storage, which is what `torch.load(mmap=True)` does for a whole file) and torch's
  weights-only unpickler, so strides, storage offsets and byte order are handled as torch does.
- `exact`: a tensor over the same memory whose storage is exactly its own bytes (what
  `torch.save` writes), instead of `clone()`.
- `Staging`: one buffer, grown to the largest request and reused, for the tensors that must be
  materialised (non-contiguous slices, dtype conversions): its pages are faulted in once.
- `write_bytes`: bytes that lie in a mapped input file are copied file to file in the kernel
  (`copy_file_range`, what `cp` does) instead of through write() from the map: on the dev VM,
  1.2 GB take 0.3-0.4 s that way against 0.65-0.8 s (measured), the difference being the page
  faults on the map. Everything else is written with write().
- `early_writeback`: after each 64 MiB written to an output, asynchronous writeback of it is
  started (sync_file_range), so the disk writes while the converter still produces; the final
  fsync still makes the output durable.

Alignment: a mapped tensor's address modulo its element size is its file offset's. Files written
by tessera-ckpt keep tensor bytes 64-byte aligned, but DCP itself packs entries back to back, so
a tensor in a trainer-written checkpoint may start at an odd address. Writing such a tensor's
bytes is fine; computing on it is not (vectorised kernels may assume element alignment). So:
`aligned()` before any arithmetic on a tensor that came from `load(raw=True)`; `Staging.ready`
realigns by itself (a byte copy into a second reused buffer), and `raw()` needs no alignment.
"""

from __future__ import annotations

import functools
import io
import os
import weakref
from typing import Any, BinaryIO

import torch

from tessera.common.file_map import file_region, map_bytes
from tessera.common.fileio import name_os_error

_MIN_KERNEL_COPY = 1 << 20  # below this, write() is as good and needs no second file handle
# write() calls of at most this many bytes: on the dev VM (kernel 6.18, ext4) one write() of a
# 16 MiB buffer took 4x the system time of the same bytes in 1 MiB calls (2.5 s vs 0.64 s per
# 1.2 GB, measured 2026-11-23), and from a mapped input 1.5-5.4 s vs 1.1-1.7 s; smaller calls
# gained nothing more (256 KiB: 0.66 s). See benchmarks/results/ckpt_convert.md.
WRITE_PIECE = 1 << 20


def write_bytes(f: BinaryIO, data: Any, writeback: bool = True) -> int:
    """Append a buffer to an open binary file: file to file in the kernel when the bytes are
    pages of a mapped input, else write(). Returns the byte count. `writeback`: start early
    writeback of the file (for an output that will be fsynced; off for a non-durable one).

    The kernel copies the file's bytes, not the map's: callers never modify mapped inputs (the
    converters only slice and copy them), so the two are the same."""
    view = memoryview(data).cast("B")
    region = file_region(view) if view.nbytes >= _MIN_KERNEL_COPY else None
    done = 0
    try:
        if region is not None:
            f.flush()
            done = _kernel_copy(region[0], region[1], f.fileno(), view.nbytes)
            f.seek(0, os.SEEK_END)  # the kernel moved the file position: let the buffered file know
        # No kernel copy, or it stopped (unsupported here): write the rest, WRITE_PIECE at a time.
        for start in range(done, view.nbytes, WRITE_PIECE):
            f.write(view[start:start + WRITE_PIECE])
    except OSError as exc:
        name_os_error(exc, getattr(f, "name", None))  # a full disk's one line names the file
        raise
    if writeback:
        early_writeback(f)
    return view.nbytes


# Early writeback: every output is fsynced before it is published, and with nothing else said the
# kernel leaves a converter's output dirty in the page cache until that fsync (1.2 GB is under the
# background-writeback threshold), so the disk idles while the CPU writes, then the CPU idles while
# the disk writes. Asking for asynchronous writeback of each finished 64 MiB of a file
# (sync_file_range(SYNC_FILE_RANGE_WRITE): starts I/O, waits for nothing, durability still comes
# from the fsync) overlaps the two. Ranges this large keep ext4's allocations large (an earlier
# attempt with smaller ranges was measured ~3x slower; see benchmarks/results/ckpt_convert.md).
WRITEBACK_STEP = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2
_written_back: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # file -> bytes handed to writeback


def early_writeback(f: BinaryIO) -> None:
    """Start writeback of `f`'s bytes not yet handed to it, once there are WRITEBACK_STEP of them.
    A hint only: where the call is unavailable or fails, nothing happens (the fsync does it all)."""
    end = f.tell()
    start = _written_back.get(f, 0)
    if end - start < WRITEBACK_STEP:
        return
    f.flush()
    _written_back[f] = end
    sync_file_range = _sync_file_range()
    if sync_file_range is not None:
        sync_file_range(f.fileno(), start, end - start, _SYNC_FILE_RANGE_WRITE)  # errors ignored: a hint


@functools.cache
def _sync_file_range() -> Any:
    """libc's sync_file_range (Linux), or None."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


def _kernel_copy(path: str, offset: int, fd_out: int, count: int) -> int:
    """copy_file_range from `path` at `offset` to the current end of `fd_out`; bytes copied
    (fewer than `count` when the call is unavailable or fails, which the caller completes)."""
    done = 0
    try:
        with open(path, "rb") as src:
            while done < count:
                n = os.copy_file_range(src.fileno(), fd_out, count - done, offset + done)
                if n <= 0:
                    break
                done += n
    except (OSError, AttributeError):
        pass
    return done


def is_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % t.element_size() == 0


def _bytes_of_storage(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under `t` as a uint8 tensor (byte operations are safe at any address)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _rebuild(t: torch.Tensor, storage_bytes: torch.Tensor) -> torch.Tensor:
    """`t`'s view (shape, strides, offset) over another copy of its storage."""
    return torch.empty(0, dtype=t.dtype).set_(storage_bytes.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or, when its elements are misaligned, the same view over a fresh aligned copy of its
    storage (copied as bytes, so no arithmetic ever touches the misaligned memory)."""
    if is_aligned(t):
        return t
    return _rebuild(t, _bytes_of_storage(t).clone())


class RangeReader(io.RawIOBase):
    """A seekable, read-only file over bytes [offset, offset + length) of an open file (its fd),
    read with pread: one DCP entry for torch's zip reader or `torch.load`. The zip reader reads
    only the directory and the small pickle record through it, not through the map: a first touch
    of a fresh map costs a page fault (~10 ms per tensor on the dev VM), and a tensor that is only
    copied file to file never needs one."""

    def __init__(self, fd: int, offset: int, length: int):
        super().__init__()
        self.fd, self.start, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, min(self.length, base + offset))
        return self.pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos) if n else b""
        out[:len(data)] = data
        self.pos += len(data)
        return len(data)


def load_saved_tensor(path: str | os.PathLike, offset: int, length: int) -> Any:
    """The object `torch.save`d at [offset, offset + length) of a file, its tensors over a memory
    map of those bytes (weights-only unpickling, as `torch.load(weights_only=True)`). Raises on
    anything torch.load would reject."""
    from torch import _weights_only_unpickler
    from torch.serialization import _load, _open_zipfile_reader

    data = map_bytes(path, offset, length)
    storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
    with open(path, "rb", buffering=0) as f, \
            _open_zipfile_reader(RangeReader(f.fileno(), offset, length)) as archive:  # type: ignore[arg-type]
        return _load(archive, "cpu", _weights_only_unpickler, overall_storage=storage, encoding="utf-8")


def exact(t: torch.Tensor) -> torch.Tensor:
    """`t` (contiguous) over the same memory but with a storage of exactly its bytes, so
    `torch.save` writes only `t`, not the larger buffer or file map it is a slice of."""
    if not t.is_contiguous():
        raise ValueError("exact() needs a contiguous tensor")
    if t.untyped_storage().nbytes() == t.nbytes:
        return t
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    as_bytes = t.reshape(-1).view(torch.uint8).numpy()  # shares memory; numpy has no bfloat16
    return torch.from_numpy(as_bytes).view(t.dtype).reshape(t.shape)


def raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, shared (for file.write / write_bytes)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _grow(buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
    if nbytes <= buffer.numel():
        return buffer
    del buffer  # free the old one before allocating the larger one
    return torch.empty(nbytes, dtype=torch.uint8)


class Staging:
    """Reusable buffers for the tensors that must be materialised before writing."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.realign_buffer = torch.empty(0, dtype=torch.uint8)
        # The storage last realigned, kept alive so that its address cannot be reused by another
        # while it is remembered: the pieces of one tensor (one per rank) share one realignment.
        self._realigned: tuple[torch.Tensor, tuple[int, int]] | None = None

    def ready(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`t` as a contiguous tensor of `dtype`: `t` itself when it already is one (aligned or
        not: it is only written), else a copy (converting) into the reused buffer, valid until
        the next call."""
        dtype = dtype or t.dtype
        if t.dtype == dtype and t.is_contiguous():
            return t
        nbytes = t.numel() * dtype.itemsize
        self.buffer = _grow(self.buffer, nbytes)
        if t.dtype == dtype and t.dim() and t.stride(-1) == 1:
            # Rows of contiguous elements (e.g. a column split): copy them as bytes, which is
            # safe at any alignment, so a misaligned input needs no realigning pass first.
            rows = t.view(torch.uint8)
            out_bytes = self.buffer[:nbytes].view(rows.shape)
            out_bytes.copy_(rows)
            return out_bytes.view(dtype)
        t = self.aligned(t)
        out = self.buffer[:nbytes].view(dtype).view(t.shape)
        out.copy_(t)
        return out

    def aligned(self, t: torch.Tensor) -> torch.Tensor:
        """Like `aligned()`, but the copy goes to a reused buffer, valid until the next call."""
        if is_aligned(t):
            return t
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if self._realigned is None or self._realigned[1] != key:
            self._realigned = None
            self.realign_buffer = _grow(self.realign_buffer, key[1])
            self.realign_buffer[:key[1]].copy_(_bytes_of_storage(t))
            self._realigned = (t, key)
        return _rebuild(t, self.realign_buffer[:key[1]])
