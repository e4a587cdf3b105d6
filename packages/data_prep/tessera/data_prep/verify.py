"""`tessera-data verify`: is a shard exactly what its index and manifest say it is?

Checks, in order (the first failure is reported with the file and what is wrong):
  format   magic, version, dtype code, `.idx` size agrees with its header (read_index)
  index    lengths >= 0; pointers start at 0, are monotone and equal the running sum of lengths;
           document index starts at 0, never decreases, ends at the sequence count
  sizes    `.bin` holds exactly the tokens the index describes
  manifest dtype, document and token counts agree, every file has a checksum (shard.check_against_manifest);
           sha256 of `.bin` and `.idx` match
  mask     a fine-tuning shard's `.mask.bin`: present, one byte per token, its sha256 matches
  tokens   every id is >= 0 and < vocab_size (from the manifest, or --vocab-size)
  images   an image-text shard's image store: structure, one sample per document, sha256 of both
           files, one placeholder token per image (multimodal.verify_images)
Works on Megatron-made shards without a manifest too (manifest checks are then skipped).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessera.common.errors import ArtifactError
from tessera.common.fileio import sha256_file
from tessera.common.indexed_dataset import (
    IndexedDataset,
    bin_path,
    check_shard_files,
    check_token_dtype,
    idx_path,
)
from tessera.common.shard import check_against_manifest, manifest_path, open_loss_mask, read_shard_manifest
from tessera.data_prep.multimodal.image_text import verify_images

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
    num_images: int | None = None


def verify_shard(prefix: str | Path, vocab_size: int | None = None, check_checksums: bool = True) -> VerifyResult:
    prefix = Path(prefix)
    check_shard_files(prefix)
    ipath, bpath = idx_path(prefix), bin_path(prefix)
    for p in (ipath, bpath):
        if not p.is_file():
            raise ArtifactError(f"{p}: not found (expected {prefix}.bin and {prefix}.idx)")
    ds = IndexedDataset(prefix)  # format, index structure and `.bin` size
    check_token_dtype(ds, prefix)  # with or without a manifest (one records an integer dtype anyway)
    dtype, n, total = ds.dtype, len(ds), ds.num_tokens
    has_manifest = manifest_path(prefix).is_file()
    if has_manifest:
        m = read_shard_manifest(prefix)
        check_against_manifest(ds, m)  # dtype, counts, every file listed: the check every reader makes
        if check_checksums:
            for kind, path in (("idx", ipath), ("bin", bpath)):
                if sha256_file(path) != m.checksums[kind]:
                    raise ArtifactError(f"{path}: sha256 does not match the manifest's; the file is corrupt or was "
                                        "changed after prep")
        # A fine-tuning shard's loss mask: present, one byte per token, matching checksums["mask"].
        open_loss_mask(prefix, total, "first-read" if check_checksums else "off")
        vocab_size = vocab_size if vocab_size is not None else m.vocab_size
        images = verify_images(prefix, m, ds, check_checksums)
    max_token = None
    images = None if not has_manifest else images
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
    return VerifyResult(prefix, dtype.name, n, ds.num_documents, total, has_manifest, max_token, images)
