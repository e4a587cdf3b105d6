"""`tessera-data adopt`: give a shard built elsewhere (Megatron-LM's `preprocess_data.py`,
Megatron-Core's `IndexedDatasetBuilder`, or any MMIDIDX v1 writer) the manifest every Tessera stage
asks for, after checking it.

The shard's `.bin/.idx` are left untouched (Megatron keeps reading them); `<prefix>.json` is written
beside them, atomically, only once everything checked out:
  index     structure (lengths, pointers as the running sum, document index) and `.bin` size, as
            every reader checks it (tessera.common.indexed_dataset.validate_index)
  tokens    every id in [0, vocab size of the given tokenizer): a shard made with another tokenizer
            is refused here rather than trained on
  end of    `--eod-id auto` (default): if every non-empty document ends with the tokenizer's
  document  end-of-document id (eos, else <|endoftext|>), the shard is recorded as made with
            Megatron's --append-eod and that id (what packed-document training needs); otherwise
            as without. An explicit `--eod-id N` must end every document; `--eod-id none` records none.
One read of `.bin` does the id check, its SHA-256 and its block checksums together.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from tessera.common.errors import ArtifactError, UserError
from tessera.common.fileio import atomic_write_json, check_replaceable_files, sha256_file
from tessera.common.indexed_dataset import IndexedDataset, bin_path, check_token_dtype, idx_path
from tessera.common.progress import progress
from tessera.common.shard import (
    BLOCK_SIZE,
    SHARD_KIND,
    BlockHasher,
    ShardInput,
    ShardManifest,
    is_shard_file,
    manifest_path,
)
from tessera.common.tokenizer import Tokenizer, load_tokenizer
from tessera.data_prep.prep import end_of_document_id

_READ = 1 << 24  # bytes per read: a multiple of every token size and of BLOCK_SIZE


def _scan(ds: IndexedDataset, vocab_size: int, quiet: bool) -> tuple[str, list[str]]:
    """SHA-256 and block checksums of `.bin`, refusing the first id outside [0, vocab_size)."""
    path = bin_path(ds.prefix)
    whole, blocks = hashlib.sha256(), BlockHasher(BLOCK_SIZE)
    size = path.stat().st_size
    bar = progress(total=size, desc=f"checking {path.name}", unit="B", unit_scale=True, quiet=quiet)
    with open(path, "rb") as f:
        done = 0
        while chunk := f.read(_READ):
            tokens = np.frombuffer(chunk, dtype=ds.dtype)
            if len(tokens) and (int(tokens.max()) >= vocab_size or int(tokens.min()) < 0):
                bad = int(np.flatnonzero((tokens >= vocab_size) | (tokens < 0))[0])
                raise ArtifactError(f"{path}: token {done // ds.dtype.itemsize + bad} has id {int(tokens[bad])}, "
                                    f"outside the tokenizer's vocabulary [0, {vocab_size}); pass the tokenizer the "
                                    "shard was made with")
            whole.update(chunk)
            blocks.update(chunk)
            done += len(chunk)
            bar.update(len(chunk))
    bar.close()
    return whole.hexdigest(), blocks.finish()


def _document_ends(ds: IndexedDataset) -> np.ndarray:
    """The last token of every non-empty document."""
    seq_ends = np.concatenate([[0], np.cumsum(ds.lengths, dtype=np.int64)])
    doc_idx = np.asarray(ds.doc_idx, dtype=np.int64)
    starts, ends = seq_ends[doc_idx[:-1]], seq_ends[doc_idx[1:]]
    ends = ends[ends > starts]
    return np.asarray(ds.tokens[ends - 1]) if len(ends) else np.zeros(0, dtype=ds.dtype)


def _end_of_document(ds: IndexedDataset, tokenizer: Tokenizer, eod: str) -> int | None:
    last = _document_ends(ds)
    if eod == "none":
        return None
    if eod == "auto":
        candidate = end_of_document_id(tokenizer)
        return candidate if candidate is not None and len(last) and bool((last == candidate).all()) else None
    try:
        wanted = int(eod)
    except ValueError:
        raise UserError(f"--eod-id {eod!r}: expected auto, none or a token id") from None
    if not 0 <= wanted < tokenizer.vocab_size:
        raise UserError(f"--eod-id {wanted}: outside the tokenizer's vocabulary [0, {tokenizer.vocab_size})")
    wrong = np.flatnonzero(last != wanted)
    if len(wrong):
        raise ArtifactError(f"{bin_path(ds.prefix)}: {len(wrong):,} documents do not end with --eod-id {wanted} "
                            f"(e.g. one ends with {int(last[wrong[0]])}); pass --eod-id auto or none")
    return wanted


def run_adopt(prefix: Path, tokenizer_dir: Path, eod: str = "auto", overwrite: bool = False,
              quiet: bool = False) -> ShardManifest:
    prefix = Path(prefix)
    mpath = manifest_path(prefix)
    if mpath.exists() and not overwrite:
        raise UserError(f"{mpath}: the shard already has a manifest; pass --overwrite to replace it")
    check_replaceable_files([mpath], SHARD_KIND, is_shard_file, "PREFIX")
    tokenizer = load_tokenizer(tokenizer_dir)
    ds = IndexedDataset(prefix)  # refuses a malformed index or a .bin of the wrong size
    check_token_dtype(ds, prefix)
    eod_id = _end_of_document(ds, tokenizer, eod)  # reads one token per document: before the long scan
    bin_sha, blocks = _scan(ds, tokenizer.vocab_size, quiet)
    manifest = ShardManifest(
        tokenizer_fingerprint=tokenizer.fingerprint, vocab_size=tokenizer.vocab_size, dtype=ds.dtype.name,
        num_documents=ds.num_documents, num_tokens=ds.num_tokens, append_eod=eod_id is not None, eod_id=eod_id,
        inputs=[ShardInput(path=str(bin_path(prefix)), sha256=bin_sha)],
        checksums={"bin": bin_sha, "idx": sha256_file(idx_path(prefix))},
        block_size=BLOCK_SIZE, block_checksums=blocks, created_by="tessera-data adopt",
        tokenizer=os.path.relpath(Path(tokenizer_dir).resolve(), prefix.parent.resolve()),
        sequences=len(ds))
    atomic_write_json(mpath, manifest.model_dump(mode="json"))
    if not quiet:
        print(f"adopted {prefix}: {ds.dtype.name}, {ds.num_documents:,} documents ({len(ds):,} sequences), "
              f"{ds.num_tokens:,} tokens, ids < {tokenizer.vocab_size:,}, "
              + (f"documents end with id {eod_id}" if eod_id is not None else "no end-of-document id"), flush=True)
    return manifest
