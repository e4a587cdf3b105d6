"""The dataset shard artifact: `<prefix>.bin` + `<prefix>.idx` (Megatron MMIDIDX) + `<prefix>.json`.

The JSON manifest is Tessera's addition: it says which tokenizer produced the tokens, how many
documents and tokens there are, which inputs they came from, and checksums of `.bin` and `.idx`.
A shard's fingerprint is the SHA-256 of its manifest file, which covers those checksums, so
mixtures can pin exact shards without re-hashing gigabytes of tokens at training start.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tessera.common.errors import ArtifactError
from tessera.common.fileio import read_json, sha256_file

SHARD_FORMAT = "tessera-shard"
SHARD_FORMAT_VERSION = 1


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
    vocab_size: int
    dtype: str = Field(description="numpy dtype name of the tokens: uint16 or int32.")
    num_documents: int
    num_tokens: int
    append_eod: bool = True
    eod_id: int | None = Field(None, description="Token id appended after every document (append_eod); null when none was or it was not recorded.")
    json_key: str | None = None
    inputs: list[ShardInput] = Field(default_factory=list)
    checksums: dict[str, str] = Field(default_factory=dict, description="'bin' and 'idx' -> sha256 hex.")


def manifest_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.json")


def shard_fingerprint(prefix: str | os.PathLike) -> str:
    path = manifest_path(prefix)
    if not path.is_file():
        raise ArtifactError(f"{path}: shard manifest not found; was {prefix} written by `tessera-data prep`?")
    return "sha256:" + sha256_file(path)


def read_shard_manifest(prefix: str | os.PathLike) -> ShardManifest:
    path = manifest_path(prefix)
    data: Any = read_json(path, "shard manifest")
    if not isinstance(data, dict) or data.get("format") != SHARD_FORMAT:
        raise ArtifactError(f"{path}: not a Tessera shard manifest (format should be {SHARD_FORMAT!r})")
    if data.get("format_version") != SHARD_FORMAT_VERSION:
        raise ArtifactError(f"{path}: shard format version {data.get('format_version')} is not supported "
                            f"(expected {SHARD_FORMAT_VERSION})")
    try:
        return ShardManifest.model_validate(data)
    except Exception as exc:
        raise ArtifactError(f"{path}: invalid shard manifest ({str(exc).splitlines()[0]})") from None
