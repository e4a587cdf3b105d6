"""`tessera-data merge`: concatenate shards (same tokenizer, same dtype) into one shard.

Tokens are stream-copied; the index is rebuilt in chunks (document indices offset by the
sequences before them), so Megatron multi-sequence documents survive and memory stays flat.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tessera.common.errors import ArtifactError, UserError
from tessera.common.fileio import (
    atomic_write_json,
    check_replaceable_files,
    ensure_output_dir,
    names_os_errors,
    sha256_file,
    tmp_name,
)
from tessera.common.indexed_dataset import bin_path, check_shard_files, idx_path, write_index_chunks
from tessera.common.shard import (
    BLOCK_SIZE,
    SHARD_KIND,
    BlockHasher,
    ShardManifest,
    is_shard_file,
    manifest_path,
    mask_path,
    open_loss_mask,
    open_shard,
    read_shard_manifest,
    shard_fingerprint,
)

_CHUNK = 1 << 20


def expand_prefixes(args: list[str]) -> list[Path]:
    """Prefixes as given, or globs over prefixes (matched against their `.idx` files)."""
    out: list[Path] = []
    for a in args:
        if glob.has_magic(a):
            matches = sorted(glob.glob(a if a.endswith(".idx") else a + ".idx"))
            if not matches:
                raise UserError(f"{a}: no shard matches (looked for {a}.idx)")
            out += [Path(m[:-4]) for m in matches]
        else:
            out.append(Path(a[:-4]) if a.endswith((".idx", ".bin")) else Path(a))
    return out


def run_merge(inputs: list[Path], output: Path, overwrite: bool = False, quiet: bool = False) -> Path:
    if len(inputs) < 1:
        raise UserError("--inputs: give at least one shard prefix")
    for suffix in (".bin", ".idx", ".json"):
        if Path(f"{output}{suffix}").exists() and not overwrite:
            raise UserError(f"{output}{suffix}: already exists; choose another --output-prefix or pass --overwrite")
    check_replaceable_files([p for p in (bin_path(output), idx_path(output), manifest_path(output), mask_path(output))
                             if os.path.lexists(p)], SHARD_KIND, is_shard_file)
    ensure_output_dir(output.parent, "--output-prefix")
    manifests = [read_shard_manifest(p) for p in inputs]
    for p, m in zip(inputs, manifests):
        if (m.model_extra or {}).get("images") is not None:  # its image store would be left behind
            raise UserError(f"{p}.json: an image-text shard; merge joins token shards only (blend several "
                            "image-text shards into one mixture instead)")
    datasets = [open_shard(p, "off") for p in inputs]  # index against manifest; bytes are checked while copied
    first = manifests[0]
    for p, m, ds in zip(inputs, manifests, datasets):
        if m.tokenizer_fingerprint != first.tokenizer_fingerprint:
            raise UserError(f"{p}.json: tokenizer {m.tokenizer_fingerprint[:19]}… differs from {inputs[0]}'s "
                            f"{first.tokenizer_fingerprint[:19]}…; only shards of one tokenizer can be merged")
        if m.dtype != first.dtype or ds.dtype.name != first.dtype:
            raise UserError(f"{p}: token dtype {ds.dtype.name} differs from {inputs[0]}'s {first.dtype}")
        if m.append_eod != first.append_eod:
            raise UserError(f"{p}.json: append_eod={m.append_eod} differs from {inputs[0]}'s; refusing to mix")
        if m.eod_id != first.eod_id:
            raise UserError(f"{p}.json: eod_id={m.eod_id} differs from {inputs[0]}'s ({first.eod_id}); "
                            "refusing to mix documents ended by different tokens")
    dtype = datasets[0].dtype
    num_seqs = sum(len(ds) for ds in datasets)
    num_docs = sum(ds.num_documents for ds in datasets)

    def length_chunks() -> Iterator[np.ndarray]:
        for ds in datasets:
            for s in range(0, len(ds), _CHUNK):
                yield np.asarray(ds.lengths[s:s + _CHUNK])

    def doc_chunks() -> Iterator[np.ndarray]:
        yield np.zeros(1, dtype=np.int64)
        base = 0
        for ds in datasets:
            for s in range(1, len(ds.doc_idx), _CHUNK):
                yield np.asarray(ds.doc_idx[s:s + _CHUNK], dtype=np.int64) + base
            base += len(ds)

    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.staging-{tmp_name(output).name[-8:]}")
    try:
        blocks, whole = BlockHasher(), hashlib.sha256()
        with names_os_errors(bin_path(output)), open(bin_path(staging), "wb") as out:
            for p, m in zip(inputs, manifests):
                _copy_verified(p, m, dtype, out, (blocks, whole))
            out.flush()
            os.fsync(out.fileno())
        write_index_chunks(idx_path(staging), dtype, num_seqs, num_docs + 1, length_chunks, doc_chunks())
        checksums = {"bin": whole.hexdigest(), "idx": sha256_file(idx_path(staging))}
        loss_mask = any(m.loss_mask for m in manifests)
        if loss_mask:  # fine-tuning shards: their masks in the same order; an unmasked input counts every token
            with names_os_errors(mask_path(output)):
                checksums["mask"] = _merge_masks(inputs, datasets, mask_path(staging))
        inputs_seen: dict[tuple, dict] = {}
        for m in manifests:
            for inp in m.inputs:
                d = inp.model_dump(mode="json")
                inputs_seen.setdefault((d.get("path"), d.get("sha256")), d)
        keys = {m.json_key for m in manifests}
        manifest = ShardManifest(
            tokenizer_fingerprint=first.tokenizer_fingerprint, vocab_size=first.vocab_size, dtype=dtype.name,
            num_documents=num_docs, num_tokens=sum(ds.num_tokens for ds in datasets), append_eod=first.append_eod,
            eod_id=first.eod_id, json_key=keys.pop() if len(keys) == 1 else None, inputs=list(inputs_seen.values()),
            checksums=checksums, block_size=BLOCK_SIZE, block_checksums=blocks.finish(), loss_mask=loss_mask,
            created_by="tessera-data merge",
            tokenizer=_tokenizer_rel(inputs[0], first, output),
            merged_from=[{"prefix": str(p), "fingerprint": shard_fingerprint(p), "num_documents": ds.num_documents}
                         for p, ds in zip(inputs, datasets)])
        # The earlier output (--overwrite) goes before anything new is published, so no old file sits
        # beside new data: its .idx first (no reader meets an index without its data), its manifest
        # last (what an interrupted removal leaves is still recognised, shard.is_shard_file).
        for old in (idx_path(output), bin_path(output), mask_path(output), manifest_path(output)):
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
        os.replace(bin_path(staging), bin_path(output))
        if loss_mask:
            os.replace(mask_path(staging), mask_path(output))
        os.replace(idx_path(staging), idx_path(output))  # after its data: an .idx always has its .bin beside it
        atomic_write_json(manifest_path(output), manifest.model_dump(mode="json"))
    finally:
        for p in (bin_path(staging), idx_path(staging), mask_path(staging)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    if not quiet:
        print(f"merged {len(inputs)} shards into {output}: {num_docs:,} documents", flush=True)
    return output


def _merge_masks(inputs: list[Path], datasets: list, out_path: Path) -> str:
    """Concatenate the inputs' loss masks (each checked against its manifest) into `out_path`; returns
    the sha256 of what was written."""
    digest = hashlib.sha256()
    with open(out_path, "wb") as out:
        for p, ds in zip(inputs, datasets):
            mask = open_loss_mask(p, ds.num_tokens)
            for s in range(0, ds.num_tokens, 1 << 24):
                chunk = (np.ones(min(1 << 24, ds.num_tokens - s), dtype=np.uint8) if mask is None
                         else np.asarray(mask[s:s + (1 << 24)])).tobytes()
                digest.update(chunk)
                out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest()


def _copy_verified(prefix: Path, manifest: ShardManifest, dtype: np.dtype, out, hashers) -> None:
    """Append an input's tokens to `out`, checking them on the way: its `.bin` and `.idx` must match
    the manifest's checksums and every id must be inside the vocabulary, so merge never launders a
    corrupt shard into one with fresh checksums. The bytes are read once, for copying and hashing."""
    check_shard_files(prefix)
    mpath = manifest_path(prefix)
    if sha256_file(idx_path(prefix)) != manifest.checksums.get("idx"):
        raise ArtifactError(f"{idx_path(prefix)}: sha256 does not match {mpath.name}'s; the index is corrupt or was "
                            "changed after prep")
    copied = hashlib.sha256()
    with open(bin_path(prefix), "rb") as f:
        while chunk := f.read(1 << 24):
            tokens = np.frombuffer(chunk, dtype=dtype)
            if len(tokens) and (int(tokens.max()) >= manifest.vocab_size or int(tokens.min()) < 0):
                raise ArtifactError(f"{bin_path(prefix)}: token ids outside the vocabulary [0, {manifest.vocab_size}); "
                                    "the shard is corrupt")
            copied.update(chunk)
            for h in hashers:
                h.update(chunk)
            out.write(chunk)
    if copied.hexdigest() != manifest.checksums.get("bin"):
        raise ArtifactError(f"{bin_path(prefix)}: sha256 does not match {mpath.name}'s; the shard is corrupt or was "
                            "changed after prep")


def _tokenizer_rel(prefix: Path, manifest: ShardManifest, output: Path) -> str | None:
    tok = (manifest.model_extra or {}).get("tokenizer")
    if not tok:
        return None
    return os.path.relpath((prefix.resolve().parent / tok).resolve(), output.resolve().parent)
