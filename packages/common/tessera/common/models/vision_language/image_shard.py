"""The images of an image-text shard: `<prefix>.images.bin` + `<prefix>.images.idx`.

An image-text shard is a loss-masked token shard (tessera.common.shard: `.bin/.idx/.mask.bin/.json`,
one document per sample, one image placeholder token per image) plus an image store beside it: a
Megatron MMIDIDX index of dtype uint8 whose sequences are the images' encoded bytes (JPEG, PNG, …,
exactly as read) and whose documents are the samples, so document d's images are those of token
document d, in placeholder order. Reusing the indexed-dataset format keeps one reader, one
validator and memory-mapped access; the bytes stay encoded so a shard is as small as its inputs and
decoding, with the processor's limits, happens at batch time.

The token shard's manifest lists the store under `images` (ImageStoreManifest): counts, sha256 of
both files and XXH3 block checksums of `.images.bin`, so the shard's fingerprint covers its images.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tessera.common.errors import ArtifactError
from tessera.common.fileio import sha256_file
from tessera.common.indexed_dataset import IndexedDataset, bin_path, idx_path

IMAGES_SUFFIX = ".images"


class ImageStoreManifest(BaseModel):
    """The `images` entry of an image-text shard's manifest."""

    model_config = ConfigDict(extra="forbid")
    num_images: int = Field(ge=0, description="Images in the store (sequences of `.images.idx`).")
    image_token: str = Field(description="The placeholder token standing for one image in the text.")
    image_token_id: int = Field(ge=0, description="Its id; each sample has one per image, in image order.")
    checksums: dict[str, str] = Field(description="'bin' and 'idx' -> sha256 hex of `.images.bin/.images.idx`.")
    block_size: int = Field(gt=0, description="Bytes per block of `.images.bin` in block_checksums.")
    block_checksums: list[str] = Field(description="XXH3-64 hex digest of each block of `.images.bin`.")


def image_store_prefix(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}{IMAGES_SUFFIX}")


def has_image_store(prefix: str | os.PathLike) -> bool:
    """Whether the shard at `prefix` is an image-text shard (its store's index is beside it)."""
    return idx_path(image_store_prefix(prefix)).is_file()


def image_store_manifest(manifest: Any) -> ImageStoreManifest | None:
    """The `images` entry of a shard manifest (tessera.common.shard.ShardManifest), or None for a text shard."""
    entry = (manifest.model_extra or {}).get("images") if manifest is not None else None
    if entry is None:
        return None
    try:
        return ImageStoreManifest.model_validate(entry)
    except Exception as exc:
        raise ArtifactError(f"{manifest_name(manifest)}: invalid 'images' entry ({str(exc).splitlines()[0]})") from None


def manifest_name(manifest: Any) -> str:
    return "shard manifest" if manifest is None else f"shard manifest ({manifest.json_key or 'image-text'})"


def open_image_store(prefix: str | os.PathLike, store: ImageStoreManifest, num_documents: int,
                     check_checksums: bool = True) -> IndexedDataset:
    """The store of the shard at `prefix`, checked against its manifest entry: structure, one document
    per token document, the image count and (unless told not to) both files' sha256."""
    sprefix = image_store_prefix(prefix)
    for p in (bin_path(sprefix), idx_path(sprefix)):
        if not p.is_file():
            raise ArtifactError(f"{p}: missing; an image-text shard's images travel with it (copy it with the shard "
                                "or prepare the shard again)")
    images = IndexedDataset(sprefix)
    if images.dtype.name != "uint8":
        raise ArtifactError(f"{idx_path(sprefix)}: dtype {images.dtype.name}, expected uint8 (encoded image bytes)")
    if (len(images), images.num_documents) != (store.num_images, num_documents):
        raise ArtifactError(f"{idx_path(sprefix)}: holds {len(images)} images in {images.num_documents} samples, the "
                            f"manifest says {store.num_images} in {num_documents}; the store belongs to another shard")
    if check_checksums:
        for kind, path in (("idx", idx_path(sprefix)), ("bin", bin_path(sprefix))):
            if sha256_file(path) != store.checksums.get(kind):
                raise ArtifactError(f"{path}: sha256 does not match images.checksums['{kind}'] in the manifest; the "
                                    "file is corrupt or was changed after prep")
    return images


def sample_images(images: IndexedDataset, doc: int) -> list[bytes]:
    """The encoded bytes of sample `doc`'s images, in placeholder order."""
    first, last = int(images.doc_idx[doc]), int(images.doc_idx[doc + 1])
    return [images[i].tobytes() for i in range(first, last)]
