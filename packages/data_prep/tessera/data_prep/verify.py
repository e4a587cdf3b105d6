"""`tessera-data verify`: is a shard exactly what its index and manifest say it is?

Checks, in order (the first failure is reported with the file and what is wrong):
  format   magic, version, dtype code, `.idx` size agrees with its header (read_index)
  index    lengths >= 0; pointers start at 0, are monotone and equal the running sum of lengths;
           document index starts at 0, never decreases, ends at the sequence count
  sizes    `.bin` holds exactly the tokens the index describes
  manifest dtype, document and token counts agree; sha256 of `.bin` and `.idx` match
  mask     a fine-tuning shard's `.mask.bin`: present, one byte per token, its sha256 matches
  tokens   every id is >= 0 and < vocab_size (from the manifest, or --vocab-size)
Works on Megatron-made shards without a manifest too (manifest checks are then skipped).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessera.common.errors import ArtifactError
from tessera.common.fileio import sha256_file
from tessera.common.indexed_dataset import bin_path, check_shard_files, idx_path, read_index, validate_index
from tessera.common.shard import manifest_path, open_loss_mask, read_shard_manifest

_CHUNK = 1 << 24  # elements per chunk, so verification memory stays flat for any shard size


@dataclass
class VerifyResult:
    prefix: Path
    dtype: str
    num_sequences: int
    num_documents: int
    num_tokens: int
    manifest: bool
    max_token: int | None


def verify_shard(prefix: str | Path, vocab_size: int | None = None, check_checksums: bool = True) -> VerifyResult:
    prefix = Path(prefix)
    check_shard_files(prefix)
    ipath, bpath = idx_path(prefix), bin_path(prefix)
    for p in (ipath, bpath):
        if not p.is_file():
            raise ArtifactError(f"{p}: not found (expected {prefix}.bin and {prefix}.idx)")
    dtype, lengths, pointers, doc_idx = read_index(ipath)
    n, itemsize = len(lengths), dtype.itemsize
    offset = validate_index(ipath, dtype, lengths, pointers, doc_idx, bpath.stat().st_size, bpath) * itemsize
    has_manifest = manifest_path(prefix).is_file()
    if has_manifest:
        m = read_shard_manifest(prefix)
        mpath = manifest_path(prefix)
        if m.dtype != dtype.name:
            raise ArtifactError(f"{mpath}: dtype {m.dtype} but the index says {dtype.name}")
        if m.num_documents != len(doc_idx) - 1 or m.num_tokens != offset // itemsize:
            raise ArtifactError(f"{mpath}: manifest says {m.num_documents} documents / {m.num_tokens} tokens, "
                                f"the shard holds {len(doc_idx) - 1} / {offset // itemsize}")
        if check_checksums:
            for kind, path in (("idx", ipath), ("bin", bpath)):
                want = m.checksums.get(kind)
                if want is None:
                    raise ArtifactError(f"{mpath}: no '{kind}' checksum in the manifest")
                if sha256_file(path) != want:
                    raise ArtifactError(f"{path}: sha256 does not match the manifest's; the file is corrupt or was "
                                        "changed after prep")
        # A fine-tuning shard's loss mask: present, one byte per token, matching checksums["mask"].
        open_loss_mask(prefix, offset // itemsize, "first-read" if check_checksums else "off")
        vocab_size = vocab_size if vocab_size is not None else m.vocab_size
    max_token = None
    total = offset // itemsize
    if total:
        tokens = np.memmap(bpath, dtype=dtype, mode="r")
        lo, hi = None, None
        for start in range(0, total, _CHUNK):
            chunk = tokens[start:start + _CHUNK]
            cmin, cmax = chunk.min(), chunk.max()
            lo = cmin if lo is None else min(lo, cmin)
            hi = cmax if hi is None else max(hi, cmax)
            if vocab_size is not None and (cmax >= vocab_size or cmin < 0):
                bad = start + int(np.flatnonzero((chunk >= vocab_size) | (chunk < 0))[0])
                raise ArtifactError(f"{bpath}: token {bad} has id {int(tokens[bad])}, outside the vocabulary "
                                    f"[0, {vocab_size})")
        max_token = int(hi)
    return VerifyResult(prefix, dtype.name, n, len(doc_idx) - 1, total, has_manifest, max_token)
