"""The mixture artifact: which tokens make up each training sample, decided once, offline.

Built by `tessera-data blend`, read by the trainer (memory-mapped; the trainer never rebuilds it).

Directory layout (format version 1):

    manifest.json                       every parameter, the shards and their fingerprints
    <split>/dataset_index.npy           uint16 [N]  dataset of global sample n
    <split>/dataset_sample_index.npy    int64  [N]  sample number within that dataset's stream
    <split>/d<k>_document_index.npy     int32  [E*D_k]  document ids of dataset k, shuffled per epoch
    <split>/d<k>_sample_index.npy       int64  [M_k+1, 2]  (position in document_index, token offset)
    <split>/d<k>_shuffle_index.npy      int64  [M_k]  order in which dataset k's samples are drawn

Sample j of dataset k (Megatron's GPT dataset semantics): i = shuffle_index[j]; it starts at
document_index[sample_index[i, 0]], token sample_index[i, 1], and ends at
document_index[sample_index[i+1, 0]], token sample_index[i+1, 1], inclusive: seq_length + 1
tokens, packed across document boundaries. Consecutive samples overlap by that one token, which is
the last label of one and the first input of the next.

Dataset paths in the manifest are relative to the mixture directory when they can be.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tessera.common.errors import ArtifactError
from tessera.common.fileio import artifact_path, holds_only, read_json, sha256_file
from tessera.common.indexed_dataset import IndexedDataset
from tessera.common.shard import MAX_VOCAB_IDS, first_problem, open_loss_mask, open_shard, shard_fingerprint

MIXTURE_FORMAT = "tessera-mixture"
MIXTURE_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MIXTURE_KIND = "mixture directory (manifest.json of format tessera-mixture)"
SPLITS = ("train", "valid", "test")


class MixtureDatasetEntry(BaseModel):
    model_config = ConfigDict(extra="allow")
    prefix: str = Field(description="Shard prefix, relative to the mixture directory when possible.")
    weight: float = Field(description="Normalised blending weight.")
    fingerprint: str = Field(description="Fingerprint of the shard (sha256 of its manifest).")
    num_documents: int
    num_tokens: int


class MixtureSplitInfo(BaseModel):
    model_config = ConfigDict(extra="allow")
    num_samples: int
    documents: list[list[int]] = Field(default_factory=list, description="Per dataset, [first, last) document range of this split.")


class MixtureManifest(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: str = MIXTURE_FORMAT
    format_version: int = MIXTURE_FORMAT_VERSION
    seq_length: int
    seed: int
    split: list[float]
    tokenizer_fingerprint: str
    vocab_size: int = Field(ge=1, le=MAX_VOCAB_IDS, description="The shards' vocabulary size.")
    datasets: list[MixtureDatasetEntry]
    splits: dict[str, MixtureSplitInfo]
    checksums: dict[str, str] = Field(default_factory=dict, description="Relative path of every .npy file -> sha256 hex.")


def split_file(split: str, name: str) -> str:
    return f"{split}/{name}.npy"


def dataset_file(split: str, k: int, kind: str) -> str:
    """kind: document_index | sample_index | shuffle_index."""
    return f"{split}/d{k}_{kind}.npy"


def mixture_fingerprint(directory: str | os.PathLike) -> str:
    return "sha256:" + sha256_file(artifact_path(directory, MANIFEST))


def is_mixture_directory(path: Path) -> bool:
    """A folder whose manifest.json says it is a mixture: what `tessera-data blend --overwrite`
    may replace (written last by an atomic rename, so an interrupted blend leaves no folder), when
    it holds nothing but the manifest and its split folders."""
    try:
        is_mixture = json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("format") == MIXTURE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False
    return is_mixture and holds_only(path, lambda name: name == MANIFEST or name in SPLITS)


def read_mixture_manifest(directory: str | os.PathLike) -> MixtureManifest:
    path = artifact_path(directory, MANIFEST)
    if not Path(directory).is_dir():
        raise ArtifactError(f"{directory}: mixture directory not found; build it with `tessera-data blend`")
    data: Any = read_json(path, "mixture manifest")
    if not isinstance(data, dict) or data.get("format") != MIXTURE_FORMAT:
        raise ArtifactError(f"{path}: not a Tessera mixture manifest (format should be {MIXTURE_FORMAT!r})")
    if data.get("format_version") != MIXTURE_FORMAT_VERSION:
        raise ArtifactError(f"{path}: mixture format version {data.get('format_version')} is not supported")
    try:
        return MixtureManifest.model_validate(data)
    except ValidationError as exc:
        raise ArtifactError(f"{path}: invalid mixture manifest ({first_problem(exc)})") from None


def resolve_prefix(directory: Path, prefix: str) -> Path:
    p = Path(prefix)
    return p if p.is_absolute() else (directory / p)


class MixtureSplit:
    """Random access to the samples of one split: `split[n]` -> int64 array of seq_length + 1 tokens."""

    def __init__(self, directory: str | os.PathLike, split: str = "train", check_fingerprints: bool = True,
                 verify: str = "first-read"):
        """`verify`: how shard tokens are checked (tessera.common.shard.open_shard): `first-read`
        (each block's checksum and ids the first time it is read), `full` (every block now), `off`.
        Unless `off`, this split's index arrays are checked against the manifest's checksums now."""
        self.directory = Path(directory)
        self.manifest = read_mixture_manifest(self.directory)
        if split not in self.manifest.splits:
            raise ArtifactError(f"{self.directory / MANIFEST}: mixture has no {split!r} split "
                                f"(it has {', '.join(self.manifest.splits)})")
        self.split = split
        self.seq_length = self.manifest.seq_length
        self.datasets: list[IndexedDataset] = []
        self.masks: list[np.ndarray | None] = []
        for entry in self.manifest.datasets:
            prefix = resolve_prefix(self.directory, entry.prefix)
            if check_fingerprints:
                actual = shard_fingerprint(prefix)
                if actual != entry.fingerprint:
                    raise ArtifactError(f"{prefix}.json: shard changed since the mixture was built "
                                        f"(fingerprint {actual[:19]}… != {entry.fingerprint[:19]}…); rebuild the mixture")
            self.datasets.append(open_shard(prefix, verify, vocab_size=self.manifest.vocab_size))
            self._check_entry(entry, self.datasets[-1])
            self.masks.append(open_loss_mask(prefix, self.datasets[-1].num_tokens, verify))
        # Fine-tuning data: a loss mask per token (tessera.common.shard); a dataset without one, blended
        # with masked ones, counts every token.
        self.has_loss_mask = any(m is not None for m in self.masks)
        self.num_samples = self.manifest.splits[split].num_samples
        if verify != "off":
            self._verify_index_files()
        self.dataset_index = self._load(split_file(split, "dataset_index"))
        self.dataset_sample_index = self._load(split_file(split, "dataset_sample_index"))
        if len(self.dataset_index) != self.num_samples or len(self.dataset_sample_index) != self.num_samples:
            raise ArtifactError(f"{self.directory / split}: index arrays do not hold {self.num_samples} samples; corrupt mixture")
        self.document_index, self.sample_index, self.shuffle_index = [], [], []
        for k in range(len(self.datasets)):
            self.document_index.append(self._load(dataset_file(split, k, "document_index")))
            self.sample_index.append(self._load(dataset_file(split, k, "sample_index")))
            self.shuffle_index.append(self._load(dataset_file(split, k, "shuffle_index")))

    def _check_entry(self, entry: MixtureDatasetEntry, dataset: IndexedDataset) -> None:
        """The mixture's record of a shard agrees with the shard: counts (its indices were built from
        them) and, through the shard's manifest, tokenizer and vocabulary (ids are range-checked
        against the mixture's)."""
        mpath, shard = self.directory / MANIFEST, dataset.manifest
        if (entry.num_documents, entry.num_tokens) != (dataset.num_documents, dataset.num_tokens):
            raise ArtifactError(f"{mpath}: says {entry.prefix} holds {entry.num_documents} documents / "
                                f"{entry.num_tokens} tokens, the shard holds {dataset.num_documents} / "
                                f"{dataset.num_tokens}; the manifest was edited or the shard changed; rebuild the mixture")
        if shard is not None and (shard.tokenizer_fingerprint, shard.vocab_size) != (
                self.manifest.tokenizer_fingerprint, self.manifest.vocab_size):
            raise ArtifactError(f"{mpath}: tokenizer {self.manifest.tokenizer_fingerprint[:19]}… (vocab "
                                f"{self.manifest.vocab_size}) but {entry.prefix}.json says "
                                f"{shard.tokenizer_fingerprint[:19]}… (vocab {shard.vocab_size}); rebuild the mixture")

    def _verify_index_files(self) -> None:
        """This split's .npy files match the manifest's checksums (a flipped index entry would point a
        sample at the wrong tokens, or past the end): hashed on threads, ~2 GB/s each."""
        from concurrent.futures import ThreadPoolExecutor

        prefix = f"{self.split}/"
        files = sorted(rel for rel in self.manifest.checksums if rel.startswith(prefix))
        needed = [split_file(self.split, "dataset_index"), split_file(self.split, "dataset_sample_index")]
        needed += [dataset_file(self.split, k, kind) for k in range(len(self.manifest.datasets))
                   for kind in ("document_index", "sample_index", "shuffle_index")]
        unchecked = [rel for rel in needed if rel not in self.manifest.checksums]
        if unchecked:  # an array without a checksum would be trusted unread: refuse it
            raise ArtifactError(f"{self.directory / MANIFEST}: no checksum for {unchecked[0]}; the manifest was "
                                "edited or is incomplete; rebuild the mixture")
        unlisted = sorted(f"{prefix}{p.name}" for p in (self.directory / self.split).glob("*.npy")
                          if f"{prefix}{p.name}" not in self.manifest.checksums)
        if unlisted:  # what the manifest does not list was not made by this blend
            raise ArtifactError(f"{self.directory / unlisted[0]}: an index file {MANIFEST} does not list; the mixture "
                                "was changed after blending; remove the file or rebuild the mixture")
        missing = [rel for rel in files if not artifact_path(self.directory, rel).is_file()]
        if missing:
            raise ArtifactError(f"{self.directory / missing[0]}: mixture index file missing; rebuild the mixture")
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            digests = pool.map(lambda rel: sha256_file(self.directory / rel), files)
            for rel, digest in zip(files, digests):
                if digest != self.manifest.checksums[rel]:
                    raise ArtifactError(f"{self.directory / rel}: sha256 does not match {MANIFEST}'s; the mixture index "
                                        "is corrupt or was changed after blending; rebuild the mixture")

    def _load(self, rel: str) -> np.ndarray:
        path = artifact_path(self.directory, rel)
        if not path.is_file():
            raise ArtifactError(f"{path}: mixture index file missing; rebuild the mixture")
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise ArtifactError(f"{path}: unreadable .npy ({exc})") from None

    def __len__(self) -> int:
        return self.num_samples

    def dataset_sample(self, k: int, j: int, document: Callable[[int], np.ndarray] | None = None) -> np.ndarray:
        """Sample j of dataset k's stream in this split: its tokens, or what `document(doc)` gives
        per document (the loss mask)."""
        ds, doc_index, sample_index = self.datasets[k], self.document_index[k], self.sample_index[k]
        document = document or ds.document_tokens
        i = int(self.shuffle_index[k][j])
        p0, o0 = (int(x) for x in sample_index[i])
        p1, o1 = (int(x) for x in sample_index[i + 1])
        if p0 == p1:
            return document(int(doc_index[p0]))[o0:o1 + 1].astype(np.int64)
        parts = [document(int(doc_index[p0]))[o0:]]
        parts.extend(document(int(doc_index[p])) for p in range(p0 + 1, p1))
        parts.append(document(int(doc_index[p1]))[:o1 + 1])
        return np.concatenate(parts).astype(np.int64)

    def loss_mask(self, n: int) -> np.ndarray:
        """Sample n's loss mask (int64 0/1, aligned with `self[n]`); all ones for a dataset without one."""
        k, j = int(self.dataset_index[n]), int(self.dataset_sample_index[n])
        ds, mask = self.datasets[k], self.masks[k]
        if mask is None:
            return np.ones(len(self[n]), dtype=np.int64)

        def document(doc: int) -> np.ndarray:
            start, count = ds.document_range(doc)
            return mask[start:start + count]
        return self.dataset_sample(k, j, document)

    def __getitem__(self, n: int) -> np.ndarray:
        if not 0 <= n < self.num_samples:
            raise IndexError(f"sample {n} out of range [0, {self.num_samples})")
        try:
            return self.dataset_sample(int(self.dataset_index[n]), int(self.dataset_sample_index[n]))
        except IndexError:
            raise ArtifactError(f"{self.directory / self.split}: sample {n} points outside the mixture's index arrays "
                                "or its shards; the mixture is corrupt or its shards changed; rebuild it") from None
