"""Megatron-compatible indexed dataset (`.bin` + `.idx`, MMIDIDX version 1).

`.idx` layout, little-endian, no padding:
    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version = 1
    u8        dtype code (1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16)
    u64       sequence count S
    u64       document count D + 1
    i32[S]    sequence lengths (tokens)
    i64[S]    byte offset of each sequence in .bin
    i64[D+1]  document indices: sequence number where each document starts; 0 first, S last
`.bin` holds the tokens of all sequences back to back in that dtype.

In Tessera one sequence is one document, but the reader accepts Megatron files where a
document spans several sequences (sentence-split data). The reader memory-maps both files.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from tessera.common.errors import ArtifactError
from tessera.common.fileio import atomic_file, tmp_name

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8

DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """u16 when every id fits comfortably (vocab < 65500, as Megatron), else i32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.bin")


class IndexedDatasetWriter:
    """Stream documents into `<prefix>.bin/.idx`, written under temporary names until `finalize`.

    Use as a context manager: on an exception nothing is left under the final names.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = tmp_name(bin_path(self.prefix))
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []
        self._doc_idx: list[int] = [0]
        self._finalized = False

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        """Append one document as one sequence."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.append(int(arr.size))
        self._doc_idx.append(len(self._lengths))

    def add_raw(self, token_bytes: bytes, lengths: np.ndarray) -> None:
        """Append many documents at once: their tokens already in this dtype, and their lengths."""
        self._bin.write(token_bytes)
        start = len(self._lengths)
        self._lengths.extend(int(n) for n in lengths)
        self._doc_idx.extend(range(start + 1, len(self._lengths) + 1))

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return int(sum(self._lengths))

    def finalize(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        write_index(idx_path(self.prefix), self.dtype, np.asarray(self._lengths, dtype=np.int32),
                    np.asarray(self._doc_idx, dtype=np.int64))
        os.replace(self._bin_tmp, bin_path(self.prefix))
        self._finalized = True

    def abort(self) -> None:
        if not self._bin.closed:
            self._bin.close()
        if self._bin_tmp.exists():
            self._bin_tmp.unlink()

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self._finalized:
            self.finalize()
        elif exc_type is not None:
            self.abort()


def write_index(path: Path, dtype: np.dtype, lengths: np.ndarray, doc_idx: np.ndarray) -> None:
    """Write an `.idx` file atomically from sequence lengths and document indices."""
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    with atomic_file(path) as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODE_OF_DTYPE[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_idx.astype("<i8").tobytes())


class IndexedDataset:
    """Memory-mapped reader of `<prefix>.bin/.idx`. Cheap to open; reads touch only what they need."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = Path(prefix)
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        for p in (ipath, bpath):
            if not p.is_file():
                raise ArtifactError(f"{p}: shard file not found (expected {self.prefix}.bin and .idx)")
        self.dtype, self.lengths, self.pointers, self.doc_idx = read_index(ipath)
        bin_size = bpath.stat().st_size
        expected = int(self.lengths.astype(np.int64).sum()) * self.dtype.itemsize
        if bin_size != expected:
            raise ArtifactError(f"{bpath}: size {bin_size} bytes but the index describes {expected}; "
                                "the shard is truncated or does not belong to this index")
        self._bin = np.memmap(bpath, dtype=self.dtype, mode="r") if bin_size else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        """Number of sequences (documents, for data written by Tessera)."""
        return len(self.lengths)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.astype(np.int64).sum())

    @property
    def tokens(self) -> np.ndarray:
        """All tokens, memory-mapped."""
        return self._bin

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence i, optionally a slice [offset, offset + length)."""
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        n = int(self.lengths[i]) - offset if length is None else length
        return self._bin[start:start + n]

    def document_tokens(self, doc: int) -> np.ndarray:
        """All tokens of document `doc` (its sequences back to back)."""
        first, last = int(self.doc_idx[doc]), int(self.doc_idx[doc + 1])
        if first == last:
            return self._bin[0:0]
        start = int(self.pointers[first]) // self.dtype.itemsize
        n = int(self.lengths[first:last].astype(np.int64).sum())
        return self._bin[start:start + n]


def read_index(path: Path) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """Parse and validate an `.idx` file; returns (dtype, lengths, pointers, doc_idx), memory-mapped."""
    size = path.stat().st_size
    if size < HEADER_SIZE:
        raise ArtifactError(f"{path}: {size} bytes is shorter than the {HEADER_SIZE}-byte MMIDIDX header; truncated")
    with open(path, "rb") as f:
        header = f.read(HEADER_SIZE)
    if header[:9] != MAGIC:
        raise ArtifactError(f"{path}: not a Megatron MMIDIDX index (bad magic {header[:9]!r})")
    (version,) = struct.unpack("<Q", header[9:17])
    if version != VERSION:
        raise ArtifactError(f"{path}: index version {version} is not supported (expected {VERSION})")
    code = header[17]
    if code not in DTYPE_CODES:
        raise ArtifactError(f"{path}: unknown dtype code {code}")
    dtype = np.dtype(DTYPE_CODES[code])
    (num_seqs,) = struct.unpack("<Q", header[18:26])
    (num_docs1,) = struct.unpack("<Q", header[26:34])
    expected = HEADER_SIZE + num_seqs * (4 + 8) + num_docs1 * 8
    if size != expected:
        raise ArtifactError(f"{path}: size {size} bytes but the header implies {expected} "
                            f"({num_seqs} sequences, {num_docs1 - 1} documents); truncated or corrupt")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(mm, dtype="<i4", count=num_seqs, offset=HEADER_SIZE)
    pointers = np.frombuffer(mm, dtype="<i8", count=num_seqs, offset=HEADER_SIZE + 4 * num_seqs)
    doc_idx = np.frombuffer(mm, dtype="<i8", count=num_docs1, offset=HEADER_SIZE + 12 * num_seqs)
    return dtype, lengths, pointers, doc_idx
