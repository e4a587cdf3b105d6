"""Writing one output stream (one JSON key) as one or several shards, published all at once.

Shards are written under hidden staging names. Only when the whole run has succeeded are they
renamed to `<base>.bin/.idx` (or `<base>_00000.bin/.idx`, … with a size limit), and each
manifest `<…>.json` is written last, after its `.bin` and `.idx` are in place: a shard without its
manifest is not finished, and a failed run removes everything it staged.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tessera.common.errors import UserError
from tessera.common.fileio import atomic_write_json, sha256_file
from tessera.common.indexed_dataset import IndexedDatasetWriter, bin_path, idx_path
from tessera.common.shard import BLOCK_SIZE, BlockHasher, ShardManifest, manifest_path, mask_path

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_max_shard_size(text: str, itemsize: int) -> int:
    """Tokens per shard from `1000000`, `50M` (tokens) or `500MB` / `2GiB` (bytes of `.bin`)."""
    m = _SIZE.match(text)
    if not m or (m.group(3).lower() == "i"):
        raise UserError(f"--max-shard-size {text!r}: expected a token count (e.g. 50M) or a size in bytes "
                        "(e.g. 500MB, 2GiB)")
    number, scale, unit = float(m.group(1)), m.group(2).lower(), m.group(3).lower()
    base = 1024 if unit == "ib" else 1000
    value = number * base ** "_kmgt".index(scale or "_") if scale else number
    tokens = int(value) // itemsize if unit.endswith("b") else int(value)
    if tokens < 1:
        raise UserError(f"--max-shard-size {text!r}: must allow at least one token per shard")
    return tokens


def output_prefixes(base: Path) -> list[Path]:
    """Existing shards (finished or not) at `base` or `base_NNNNN`, for overwrite checks."""
    pattern = re.compile(re.escape(base.name) + r"(_\d{5})?\.(bin|idx|json|mask\.bin)$")
    if not base.parent.is_dir():
        return []
    return sorted(p for p in base.parent.iterdir() if pattern.fullmatch(p.name))


def _removal_order(path: Path) -> int:
    """The .idx first (a reader stops finding the shard), the manifest last (see commit)."""
    return 0 if path.suffix == ".idx" else 2 if path.suffix == ".json" else 1


@dataclass
class _Staged:
    staging: Path  # hidden prefix the shard was written to
    final: Path  # prefix it will be published under
    num_documents: int
    num_tokens: int
    bin_sha256: str
    block_checksums: list[str]
    mask_sha256: str | None = None


class ShardSetWriter:
    """Writes the documents of one key into shards of at most `max_tokens` tokens each; with
    `loss_mask`, a uint8 per token into `<prefix>.mask.bin` beside each (tessera.common.shard)."""

    def __init__(self, base: Path, dtype: np.dtype, max_tokens: int | None, loss_mask: bool = False):
        self.base = Path(base)
        self.loss_mask = loss_mask
        self._mask_file: Any = None
        self._mask_hash = hashlib.sha256()
        self.dtype = np.dtype(dtype)
        self.max_tokens = max_tokens
        self._tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._staged: list[_Staged] = []
        self._writer: IndexedDatasetWriter | None = None
        self._hash = hashlib.sha256()
        self._blocks = BlockHasher()
        self.num_documents = 0
        self.num_tokens = 0

    def _final_prefix(self, index: int) -> Path:
        if self.max_tokens is None:
            return self.base
        return self.base.with_name(f"{self.base.name}_{index:05d}")

    def _open(self) -> IndexedDatasetWriter:
        if self._writer is None:
            staging = self.base.with_name(f".{self.base.name}.staging-{self._tag}-{len(self._staged):05d}")
            self._writer = IndexedDatasetWriter(staging, self.dtype)
            self._hash = hashlib.sha256()
            self._blocks = BlockHasher()
            if self.loss_mask:
                self._mask_file = open(mask_path(staging), "wb")  # noqa: SIM115 - closed with the shard
                self._mask_hash = hashlib.sha256()
        return self._writer

    def _close_current(self) -> None:
        w = self._writer
        if w is None:
            return
        w.finalize()
        mask_sha = None
        if self._mask_file is not None:
            self._mask_file.flush()
            os.fsync(self._mask_file.fileno())
            self._mask_file.close()
            self._mask_file, mask_sha = None, self._mask_hash.hexdigest()
        self._staged.append(_Staged(w.prefix, self._final_prefix(len(self._staged)), w.num_documents,
                                    w.num_tokens, self._hash.hexdigest(), self._blocks.finish(), mask_sha))
        self._writer = None

    def _write(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None,
               sentences: np.ndarray | None = None) -> None:
        w = self._open()
        data = memoryview(np.ascontiguousarray(tokens, dtype=self.dtype)).cast("B")
        self._hash.update(data)
        self._blocks.update(data)
        w.add_raw(data, lengths, sentences)
        if self._mask_file is not None:
            assert mask is not None and len(mask) == len(tokens)
            raw = np.ascontiguousarray(mask, dtype=np.uint8).tobytes()
            self._mask_hash.update(raw)
            self._mask_file.write(raw)

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None,
            sentences: np.ndarray | None = None) -> None:
        """Append documents (tokens back to back, and their lengths; with loss_mask their mask, one
        value per token; with `sentences`, `lengths` are per sequence and document d spans
        sentences[d] of them), cutting shards at document ends."""
        if self.loss_mask and mask is None:
            raise ValueError("this writer stores a loss mask: give one per token")
        if sentences is not None:
            self._add_sentences(tokens, lengths, sentences)
            return
        self.num_documents += len(lengths)
        self.num_tokens += int(lengths.sum())
        if self.max_tokens is None:
            self._write(tokens, lengths, mask)
            return
        ends = np.cumsum(lengths)
        doc, tok = 0, 0
        while doc < len(lengths):
            held = self._writer.num_tokens if self._writer is not None else 0
            room = self.max_tokens - held
            # documents [doc, cut) fit in the room left in the current shard
            cut = int(np.searchsorted(ends, tok + room, side="right"))
            if cut == doc:
                if held == 0:
                    cut = doc + 1  # one document longer than the limit gets a shard of its own
                else:
                    self._close_current()
                    continue
            end_tok = int(ends[cut - 1])
            self._write(tokens[tok:end_tok], lengths[doc:cut], None if mask is None else mask[tok:end_tok])
            doc, tok = cut, end_tok
            if self._writer is not None and self._writer.num_tokens >= self.max_tokens:
                self._close_current()

    def _add_sentences(self, tokens: np.ndarray, lengths: np.ndarray, sentences: np.ndarray) -> None:
        """Sentence-split documents: shards are cut between documents, never inside one."""
        sentences = np.asarray(sentences, dtype=np.int64)
        self.num_documents += len(sentences)
        self.num_tokens += int(lengths.sum())
        if self.max_tokens is None:
            self._write(tokens, lengths, None, sentences)
            return
        seq_ends = np.concatenate([[0], np.cumsum(sentences)])
        tok_ends = np.concatenate([[0], np.cumsum(lengths)])
        doc = 0
        while doc < len(sentences):
            held = self._writer.num_tokens if self._writer is not None else 0
            room = self.max_tokens - held
            # documents [doc, cut) fit in the room left in the current shard
            cut = int(np.searchsorted(tok_ends[seq_ends], tok_ends[seq_ends[doc]] + room, side="right")) - 1
            if cut <= doc:
                if held == 0:
                    cut = doc + 1  # one document longer than the limit gets a shard of its own
                else:
                    self._close_current()
                    continue
            s0, s1 = int(seq_ends[doc]), int(seq_ends[cut])
            self._write(tokens[tok_ends[s0]:tok_ends[s1]], lengths[s0:s1], None, sentences[doc:cut])
            doc = cut
            if self._writer is not None and self._writer.num_tokens >= self.max_tokens:
                self._close_current()

    def commit(self, manifest_fields: dict[str, Any], before_publish: Callable[[], None] | None = None) -> list[Path]:
        """Finish the last shard, publish every shard, then write each manifest. Returns prefixes.
        `before_publish`: runs once the earlier run's shards are gone, before these appear (an
        image-text shard's image store: never the new store beside the old shard)."""
        if self._writer is not None or not self._staged:
            self._open()  # an empty output still gets one (empty) shard
            self._close_current()
        # Leftovers of an earlier run (only reachable with --overwrite): the .idx first, so no reader
        # meets an index without its data, the manifest last, so what an interrupted removal leaves
        # is still recognised as a shard (shard.is_shard_file).
        for old in sorted(output_prefixes(self.base), key=_removal_order):
            old.unlink()
        if before_publish is not None:
            before_publish()
        published = []
        for i, s in enumerate(self._staged):
            os.replace(bin_path(s.staging), bin_path(s.final))
            checksums = {"bin": s.bin_sha256, "idx": sha256_file(idx_path(s.staging))}
            if s.mask_sha256 is not None:
                os.replace(mask_path(s.staging), mask_path(s.final))
                checksums["mask"] = s.mask_sha256
            os.replace(idx_path(s.staging), idx_path(s.final))  # last: an .idx has its .bin (and mask) beside it
            fields = dict(manifest_fields)
            fields.update(num_documents=s.num_documents, num_tokens=s.num_tokens, dtype=self.dtype.name,
                          checksums=checksums, block_size=BLOCK_SIZE, block_checksums=s.block_checksums,
                          loss_mask=s.mask_sha256 is not None)
            if self.max_tokens is not None:
                fields.update(shard_index=i, num_shards=len(self._staged))
            manifest = ShardManifest.model_validate(fields)
            atomic_write_json(manifest_path(s.final), manifest.model_dump(mode="json"))
            published.append(s.final)
        self._staged = []
        return published

    def abort(self) -> None:
        if self._mask_file is not None:
            self._mask_file.close()
            self._mask_file = None
        if self._writer is not None:
            with contextlib.suppress(FileNotFoundError):
                mask_path(self._writer.prefix).unlink()
            self._writer.abort()
            self._writer = None
        for s in self._staged:
            for p in (bin_path(s.staging), idx_path(s.staging), mask_path(s.staging)):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        self._staged = []

