"""The dataset shard artifact: `<prefix>.bin` + `<prefix>.idx` (Megatron MMIDIDX) + `<prefix>.json`.

The JSON manifest is Tessera's addition: it says which tokenizer produced the tokens, how many
documents and tokens there are, which inputs they came from, and checksums of `.bin` and `.idx`.
A shard's fingerprint is the SHA-256 of its manifest file, which covers those checksums, so
mixtures can pin exact shards without re-hashing gigabytes of tokens at training start.

Block checksums (`block_checksums`, XXH3-64 of every `block_size` bytes of `.bin`, written by prep
and merge) let a reader verify exactly what it reads, the first time it reads it, instead of
hashing a whole shard up front: `open_shard` attaches a `BlockVerifier` that hashes a block and
checks its token ids against the vocabulary before the first token of that block is handed out.
Measured cost, and the rejected alternative of per-sample checks, in docs/operations.md.

Loss masks (fine-tuning data, `tessera-data prep --format chat|prompt-completion`) are a fourth
file, `<prefix>.mask.bin`: one uint8 per token of `.bin`, in the same order, 1 where the token is
a target the loss counts (an answer token) and 0 where it is context (system, user, template
text). The manifest says `loss_mask: true` and records its sha256 as `checksums["mask"]`. Megatron's
readers never open it, so to them the shard is plain tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tessera.common.errors import ArtifactError
from tessera.common.fileio import read_json, sha256_file
from tessera.common.indexed_dataset import MAGIC, IndexedDataset, bin_path, check_shard_files, idx_path

SHARD_FORMAT = "tessera-shard"
BLOCK_ALGORITHM = "xxh3-64"
BLOCK_SIZE = 1 << 20  # 1 MiB: a JSON entry per MiB of tokens, ~0.2 ms to hash and range-check on first read
SHARD_FORMAT_VERSION = 1
SHARD_KIND = "shard (.idx of Megatron's format, its .bin, or a tessera-shard manifest)"


# Ids are stored as int32 at most, so no vocabulary is larger. The manifest is not covered by
# its own checksums: a vocab_size of 10^12 written into it passed verify and blend, and the
# trainer then failed with a traceback.
MAX_VOCAB_IDS = 2**31


class ShardInput(BaseModel):
    model_config = ConfigDict(extra="allow")
    path: str = Field(description="Input file as given.")
    sha256: str | None = Field(None, description="Content hash of the input file (None for streams).")


class ShardManifest(BaseModel):
    """Contents of `<prefix>.json`."""

    model_config = ConfigDict(extra="allow")
    format: str = SHARD_FORMAT
    format_version: int = SHARD_FORMAT_VERSION
    tokenizer_fingerprint: str = Field(description="sha256 of the tokenizer.json that produced the tokens.")
    vocab_size: int = Field(ge=1, le=MAX_VOCAB_IDS, description="Tokenizer vocabulary size: every id is below it.")
    dtype: str = Field(description="numpy dtype name of the tokens: uint16 or int32.")
    num_documents: int
    num_tokens: int
    append_eod: bool = True
    eod_id: int | None = Field(None, description="Token id appended after every document (append_eod); null when none was or it was not recorded.")
    json_key: str | None = None
    inputs: list[ShardInput] = Field(default_factory=list)
    checksums: dict[str, str] = Field(default_factory=dict, description="'bin' and 'idx' -> sha256 hex.")
    block_size: int | None = Field(None, description="Bytes per block of `.bin` covered by one entry of block_checksums (null: none recorded).")
    block_checksum_algorithm: str = Field(BLOCK_ALGORITHM, description="Algorithm of block_checksums.")
    block_checksums: list[str] = Field(default_factory=list, description="Hex digest of each block of `.bin` in order (the last block may be short).")
    loss_mask: bool = Field(False, description="`<prefix>.mask.bin` holds a uint8 per token: 1 where the loss counts the token as a target (sha256 in checksums['mask']).")


def first_problem(exc: ValidationError) -> str:
    """'field: what is wrong' of a manifest's first invalid field (pydantic's own first line names
    only the model)."""
    err = exc.errors()[0]
    return f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"


def manifest_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.json")


MASK_SUFFIX = ".mask.bin"


def mask_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}{MASK_SUFFIX}")


def open_loss_mask(prefix: str | os.PathLike, num_tokens: int, verify: str = "first-read") -> np.ndarray | None:
    """The shard's loss mask, memory-mapped (uint8 per token), or None when its manifest has none.
    Unless `verify` is `off` its size and sha256 are checked now (one byte per token: cheap)."""
    check_shard_files(prefix)
    path = manifest_path(prefix)
    manifest = read_shard_manifest(prefix) if path.is_file() else None
    if manifest is None or not manifest.loss_mask:
        return None
    mpath = mask_path(prefix)
    if not mpath.is_file():
        raise ArtifactError(f"{mpath}: loss mask missing ({path.name} says the shard has one); copy it with the "
                            "shard or prepare the shard again")
    if mpath.stat().st_size != num_tokens:
        raise ArtifactError(f"{mpath}: {mpath.stat().st_size} bytes for {num_tokens} tokens; the loss mask is "
                            "truncated or belongs to another shard")
    if verify != "off" and sha256_file(mpath) != manifest.checksums.get("mask"):
        raise ArtifactError(f"{mpath}: sha256 does not match checksums['mask'] in {path.name}; the loss mask is "
                            "corrupt or was changed after prep")
    return np.memmap(mpath, dtype=np.uint8, mode="r") if num_tokens else np.zeros(0, dtype=np.uint8)


def is_shard_file(path: Path) -> bool:
    """One of a shard's files, recognised by content: an `.idx` with Megatron's magic, a manifest
    of format tessera-shard, or a `.bin` / `.mask.bin` beside such an `.idx` or manifest. What a
    writer's --overwrite may replace (fileio.check_replaceable_files). Writers remove an old `.idx`
    first and its manifest last, so what an interrupted removal leaves is recognised; they publish
    an `.idx` after its `.bin` (a reader never meets an index without its data), so a publish cut
    between the two leaves a lone `.bin`, which is refused (it could be anyone's)."""
    name = path.name
    if name.endswith(".idx"):
        try:
            with open(path, "rb") as f:
                return f.read(len(MAGIC)) == MAGIC
        except OSError:
            return False
    if name.endswith(".json"):
        try:
            return json.loads(path.read_text(encoding="utf-8")).get("format") == SHARD_FORMAT
        except (OSError, ValueError, AttributeError):
            return False
    for suffix in (MASK_SUFFIX, ".bin"):
        if name.endswith(suffix):
            prefix = path.with_name(name[:-len(suffix)])
            return is_shard_file(idx_path(prefix)) or is_shard_file(manifest_path(prefix))
    return False


def shard_fingerprint(prefix: str | os.PathLike) -> str:
    check_shard_files(prefix)
    path = manifest_path(prefix)
    if not path.is_file():
        raise ArtifactError(f"{path}: shard manifest not found; {_NO_MANIFEST_HINT.format(prefix=prefix)}")
    return "sha256:" + sha256_file(path)


_NO_MANIFEST_HINT = ("for a shard made by another tool (Megatron), run `tessera-data adopt {prefix} --tokenizer DIR`; "
                     "otherwise check the prefix")


def read_shard_manifest(prefix: str | os.PathLike) -> ShardManifest:
    check_shard_files(prefix)
    path = manifest_path(prefix)
    if not path.is_file() and bin_path(prefix).is_file():
        raise ArtifactError(f"{path}: shard manifest not found; {_NO_MANIFEST_HINT.format(prefix=prefix)}")
    data: Any = read_json(path, "shard manifest")
    if not isinstance(data, dict) or data.get("format") != SHARD_FORMAT:
        raise ArtifactError(f"{path}: not a Tessera shard manifest (format should be {SHARD_FORMAT!r})")
    if data.get("format_version") != SHARD_FORMAT_VERSION:
        raise ArtifactError(f"{path}: shard format version {data.get('format_version')} is not supported "
                            f"(expected {SHARD_FORMAT_VERSION})")
    try:
        return ShardManifest.model_validate(data)
    except ValidationError as exc:
        raise ArtifactError(f"{path}: invalid shard manifest ({first_problem(exc)})") from None


class BlockHasher:
    """Streaming XXH3-64 digests of consecutive `block_size`-byte blocks of what is fed to it."""

    def __init__(self, block_size: int = BLOCK_SIZE):
        import xxhash

        self.block_size, self.digests = block_size, []
        self._new = xxhash.xxh3_64
        self._hash, self._filled = self._new(), 0

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block_size - self._filled)
            self._hash.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.block_size:
                self.digests.append(self._hash.hexdigest())
                self._hash, self._filled = self._new(), 0

    def finish(self) -> list[str]:
        """All digests, the last (short) block included; the hasher is spent afterwards."""
        if self._filled:
            self.digests.append(self._hash.hexdigest())
            self._hash, self._filled = self._new(), 0
        return self.digests


class BlockVerifier:
    """Checks each block of a shard's `.bin` once, on first read: its checksum, then its token ids.

    Called with a token range before those tokens are used; blocks already checked cost one
    numpy lookup. `check_all` checks every block (`data.verify: full`)."""

    def __init__(self, dataset: IndexedDataset, manifest: ShardManifest | None, vocab_size: int | None):
        self.path = bin_path(dataset.prefix)
        self.manifest_path = manifest_path(dataset.prefix)
        self.dtype = dataset.dtype
        self.tokens = dataset.tokens
        self.nbytes = dataset.num_tokens * self.dtype.itemsize
        digests = manifest.block_checksums if manifest is not None and manifest.block_size else []
        self.block_size = manifest.block_size if digests else BLOCK_SIZE
        if self.block_size % self.dtype.itemsize:
            raise ArtifactError(f"{self.manifest_path}: block_size {self.block_size} is not a multiple of the "
                                f"token size ({self.dtype.itemsize} bytes)")
        self.num_blocks = -(-self.nbytes // self.block_size)
        if digests and len(digests) != self.num_blocks:
            raise ArtifactError(f"{self.manifest_path}: {len(digests)} block checksums for {self.num_blocks} blocks "
                                f"of {self.path.name}; the shard or its manifest is corrupt")
        self.digests = digests
        self.vocab_size = vocab_size
        self.checked = np.zeros(self.num_blocks, dtype=bool)

    def __call__(self, first_token: int, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        size = self.dtype.itemsize
        b0 = first_token * size // self.block_size
        b1 = ((first_token + num_tokens) * size - 1) // self.block_size
        if b0 == b1 and self.checked[b0]:
            return
        for b in range(b0, b1 + 1):
            if not self.checked[b]:
                self._check_block(b)

    def check_all(self) -> None:
        for b in np.flatnonzero(~self.checked):
            self._check_block(int(b))

    def _check_block(self, b: int) -> None:
        import xxhash

        per_block = self.block_size // self.dtype.itemsize
        tokens = self.tokens[b * per_block:(b + 1) * per_block]
        if self.digests and xxhash.xxh3_64_hexdigest(memoryview(np.ascontiguousarray(tokens)).cast("B")) \
                != self.digests[b]:
            start = b * self.block_size
            raise ArtifactError(f"{self.path}: block {b} (bytes {start}-{min(start + self.block_size, self.nbytes) - 1}) "
                                f"does not match its checksum in {self.manifest_path.name}; the shard is corrupt or "
                                "was changed after prep (tessera-data verify checks it whole)")
        if self.vocab_size is not None and len(tokens):
            high, low = int(tokens.max()), int(tokens.min())
            if high >= self.vocab_size or low < 0:
                bad = b * per_block + int(np.flatnonzero((tokens >= self.vocab_size) | (tokens < 0))[0])
                raise ArtifactError(f"{self.path}: token {bad} has id {int(self.tokens[bad])}, outside the "
                                    f"vocabulary [0, {self.vocab_size}); the shard is corrupt or was made with "
                                    "another tokenizer")
        self.checked[b] = True


VERIFY_MODES = ("first-read", "full", "off")


def check_against_manifest(dataset: IndexedDataset, manifest: ShardManifest) -> None:
    """The one check, for every reader, that a shard's files are the ones its manifest describes:
    the `.idx` header's dtype and the index's document and token counts equal the manifest's, the
    manifest lists a checksum for every file of the shard, and no loss mask lies beside a shard
    whose manifest has none (it would be silently ignored). Reads nothing but the open index."""
    mpath, ipath = manifest_path(dataset.prefix), idx_path(dataset.prefix)
    stale = "the index or the manifest was changed after prep; run `tessera-data verify`"
    if manifest.dtype != dataset.dtype.name:
        raise ArtifactError(f"{mpath}: dtype {manifest.dtype} but the header of {ipath.name} says "
                            f"{dataset.dtype.name}; {stale}")
    if (manifest.num_documents, manifest.num_tokens) != (dataset.num_documents, dataset.num_tokens):
        raise ArtifactError(f"{mpath}: says {manifest.num_documents} documents / {manifest.num_tokens} tokens, "
                            f"{ipath.name} holds {dataset.num_documents} / {dataset.num_tokens}; {stale}")
    listed = ["bin", "idx"] + (["mask"] if manifest.loss_mask else [])
    if missing := [kind for kind in listed if not manifest.checksums.get(kind)]:
        raise ArtifactError(f"{mpath}: no checksum for '{missing[0]}'; every file of the shard must be listed "
                            "(the manifest was edited or is incomplete); prepare the shard again")
    if not manifest.loss_mask and mask_path(dataset.prefix).exists():
        raise ArtifactError(f"{mask_path(dataset.prefix)}: a loss mask that {mpath.name} does not list "
                            "(loss_mask is false); delete it, or prepare the shard again with its mask")


def open_shard(prefix: str | os.PathLike, verify: str = "first-read", vocab_size: int | None = None) -> IndexedDataset:
    """Open a shard for reading tokens, its structure validated and its blocks verified as `verify` says.

    Any mode checks the index structure and, when there is a manifest, that the index agrees with
    it (check_against_manifest). `first-read` also checks `.idx` against the manifest's sha256
    now (the index is ~20 bytes per document) and hashes each block (when the manifest records
    block checksums) and range-checks its ids the first time any of its tokens is read; `full`:
    every block now (a manifest without block checksums: `.bin` against its sha256); `off`: no
    more. `vocab_size` defaults to the manifest's. The manifest is kept as `dataset.manifest`."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, not {verify!r}")
    dataset = IndexedDataset(prefix)
    manifest = read_shard_manifest(prefix) if manifest_path(prefix).is_file() else None
    dataset.manifest = manifest
    if manifest is not None:
        check_against_manifest(dataset, manifest)
    if verify == "off":
        return dataset
    if manifest is not None:
        _check_sha256(idx_path(prefix), manifest, "idx")
    if vocab_size is None and manifest is not None:
        vocab_size = manifest.vocab_size
    verifier = BlockVerifier(dataset, manifest, vocab_size)
    dataset.verifier = verifier
    if verify == "full":
        if manifest is not None and not verifier.digests:  # an older manifest: the whole file's hash instead
            _check_sha256(bin_path(prefix), manifest, "bin")
        verifier.check_all()
    return dataset


def _check_sha256(path: Path, manifest: ShardManifest, kind: str) -> None:
    if sha256_file(path) != manifest.checksums.get(kind):
        raise ArtifactError(f"{path}: sha256 does not match checksums['{kind}'] in its manifest; the file is corrupt "
                            "or was changed after prep")
