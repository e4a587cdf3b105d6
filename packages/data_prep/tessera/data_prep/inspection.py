"""`tessera-data inspect`: what is in a shard — counts, document lengths, top tokens, sample text."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tessera.common.errors import UserError
from tessera.common.shard import manifest_path, open_shard, read_shard_manifest
from tessera.common.tokenizer import Tokenizer, load_tokenizer
from tessera.data_prep.multimodal.image_text import describe_images

_CHUNK = 1 << 24


def _tokenizer_for(prefix: Path, tokenizer_dir: Path | None, fingerprint: str | None) -> Tokenizer | None:
    if tokenizer_dir is None:
        if fingerprint is None:
            return None
        rel = (read_shard_manifest(prefix).model_extra or {}).get("tokenizer")
        if not rel or not (prefix.parent / rel).is_dir():
            return None
        tokenizer_dir = prefix.parent / rel
    tok = load_tokenizer(tokenizer_dir)
    if fingerprint is not None and tok.fingerprint != fingerprint:
        raise UserError(f"{tokenizer_dir}: tokenizer fingerprint {tok.fingerprint[:19]}… is not the shard's "
                        f"{fingerprint[:19]}…; pass the tokenizer the shard was made with")
    return tok


def inspect_shard(prefix: Path, docs: list[int], tokenizer_dir: Path | None, top: int = 10,
                  max_chars: int = 400) -> str:
    """A human-readable report (returned as text so tests can check it)."""
    ds = open_shard(prefix, "full")  # the report reads every token (counts): check every block first
    has_manifest = manifest_path(prefix).is_file()
    manifest = read_shard_manifest(prefix) if has_manifest else None
    fingerprint = manifest.tokenizer_fingerprint if manifest else None
    for d in docs:
        if not 0 <= d < ds.num_documents:
            raise UserError(f"--docs {d}: out of range; {prefix} has {ds.num_documents} documents (0..{ds.num_documents - 1})")
    tok = _tokenizer_for(prefix, tokenizer_dir, fingerprint)
    seq_ends = np.concatenate([[0], np.cumsum(ds.lengths, dtype=np.int64)])
    doc_idx = np.asarray(ds.doc_idx, dtype=np.int64)
    doc_len = seq_ends[doc_idx[1:]] - seq_ends[doc_idx[:-1]]
    lines = [f"shard: {prefix}",
             f"  dtype {ds.dtype.name}, {ds.num_documents:,} documents, {len(ds):,} sequences, {ds.num_tokens:,} tokens"]
    if manifest:
        lines.append(f"  tokenizer {manifest.tokenizer_fingerprint}, vocab {manifest.vocab_size:,}, "
                     f"append_eod={manifest.append_eod}")
        skipped = (manifest.model_extra or {}).get("skipped") or {}
        if skipped.get("total"):
            lines.append(f"  skipped records at prep: {skipped['total']:,} {skipped.get('by_reason', {})}")
    else:
        lines.append("  no manifest (a Megatron-made shard?)")
    images = describe_images(prefix, manifest, ds.num_documents, docs) if manifest else {}
    if -1 in images:
        lines.append(images[-1])
    if len(doc_len):
        p50, p99 = np.percentile(doc_len, [50, 99])
        lines.append(f"  document length (tokens): min {doc_len.min():,}  mean {doc_len.mean():,.1f}  "
                     f"p50 {p50:,.0f}  p99 {p99:,.0f}  max {doc_len.max():,}")
    if ds.num_tokens and ds.dtype.kind in "iu":
        counts = None
        for s in range(0, ds.num_tokens, _CHUNK):
            c = np.bincount(np.asarray(ds.tokens[s:s + _CHUNK], dtype=np.int64))
            if counts is None:
                counts = c
            else:
                if len(c) > len(counts):
                    c[:len(counts)] += counts
                    counts = c
                else:
                    counts[:len(c)] += c
        assert counts is not None
        order = np.argsort(-counts, kind="stable")[:top]
        parts = []
        for t in order:
            if counts[t] == 0:
                break
            label = f" {tok.decode([int(t)], skip_special_tokens=False)!r}" if tok else ""
            parts.append(f"{int(t)}{label}: {int(counts[t]):,} ({counts[t] / ds.num_tokens:.2%})")
        lines.append(f"  top {len(parts)} tokens: " + ", ".join(parts))
    for d in docs:
        ids = ds.document_tokens(d)
        lines.append(f"--- document {d}: {len(ids):,} tokens")
        if d in images:
            lines.append(images[d])
        if tok is None:
            lines.append("  " + " ".join(str(int(x)) for x in ids[:64]) + (" …" if len(ids) > 64 else "")
                         + "  (pass --tokenizer DIR to decode)")
        else:
            text = tok.decode([int(x) for x in ids], skip_special_tokens=False)
            lines.append(text[:max_chars] + (f"\n  … ({len(text) - max_chars:,} more characters)"
                                              if len(text) > max_chars else ""))
    return "\n".join(lines)
