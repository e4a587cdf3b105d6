"""`tessera-data prep --format image-text`: image-text records -> an image-text shard.

Each record's conversation is rendered and masked exactly as `--format chat` (tessera.data_prep.sft:
answers only), with one image placeholder token per image; its images are decoded with Pillow
under the image processor's limits (tessera.common.models.vision_language.processor.decode_image:
corrupt, truncated, over the pixel limit, decompression bombs, unsupported modes) and stored as
their original encoded bytes in the image store (image_shard.py). A bad image stops the run with
one line naming the record, whatever --on-error says (it is a broken download or a hostile file,
not a formatting slip), and nothing is published: the token shard and the store are staged and
renamed only when the whole run succeeds, the manifest last.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from tessera.common.errors import ArtifactError, UserError
from tessera.common.fileio import sha256_file
from tessera.common.indexed_dataset import IndexedDatasetWriter, bin_path, idx_path, token_dtype_for_vocab
from tessera.common.models.vision_language.image_shard import (
    ImageStoreManifest,
    image_store_manifest,
    image_store_prefix,
    open_image_store,
    sample_images,
)
from tessera.common.models.vision_language.processor import decode_image
from tessera.common.progress import progress
from tessera.common.shard import BLOCK_SIZE, BlockHasher
from tessera.common.tokenizer import Tokenizer
from tessera.data_prep.multimodal.records import conversation, input_kind, load_image, read_image_records
from tessera.data_prep.sft import BadRecord, SftEncoder
from tessera.data_prep.shard_writer import ShardSetWriter
from tessera.data_prep.sources import InputFile


class _ImageStoreWriter:
    """Encoded images into a staged uint8 indexed dataset, one document per sample."""

    def __init__(self, base: Path):
        self.final = image_store_prefix(base)
        self.staging = base.with_name(f".{base.name}.images.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.writer: IndexedDatasetWriter | None = IndexedDatasetWriter(self.staging, np.uint8)
        self.hash, self.blocks, self.num_images = hashlib.sha256(), BlockHasher(), 0

    def add(self, images: list[bytes]) -> None:
        assert self.writer is not None
        data = b"".join(images)
        self.hash.update(data)
        self.blocks.update(data)
        self.writer.add_raw(data, np.asarray([len(b) for b in images], dtype=np.int32), np.asarray([len(images)]))
        self.num_images += len(images)

    def finish(self, image_token: str, image_token_id: int) -> ImageStoreManifest:
        assert self.writer is not None
        self.writer.finalize()
        self.writer = None
        return ImageStoreManifest(num_images=self.num_images, image_token=image_token, image_token_id=image_token_id,
                                  checksums={"bin": self.hash.hexdigest(), "idx": sha256_file(idx_path(self.staging))},
                                  block_size=BLOCK_SIZE, block_checksums=self.blocks.finish())

    def publish(self) -> None:
        # An earlier store's .idx goes first and the new one comes last: an .idx always has its .bin.
        with contextlib.suppress(FileNotFoundError):
            idx_path(self.final).unlink()
        for path in (bin_path, idx_path):
            os.replace(path(self.staging), path(self.final))

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
        for path in (bin_path, idx_path):
            with contextlib.suppress(FileNotFoundError):
                path(self.staging).unlink()


class ImageTextWriter:
    """The token shard (with its loss mask) and its image store, committed together."""

    def __init__(self, base: Path, dtype: np.dtype, image_token: str, image_token_id: int):
        self.tokens = ShardSetWriter(base, dtype, None, loss_mask=True)
        self.images = _ImageStoreWriter(base)
        self.image_token, self.image_token_id = image_token, image_token_id

    def commit(self, fields: dict[str, Any]) -> list[Path]:
        store = self.images.finish(self.image_token, self.image_token_id)
        # The store is published once the earlier shard is gone and before the new one appears; the
        # manifest, written last by the token writer, is what makes the shard whole.
        return self.tokens.commit({**fields, "images": store.model_dump(mode="json")}, self.images.publish)

    def abort(self) -> None:
        self.images.abort()
        self.tokens.abort()


def image_token_id(tokenizer: Tokenizer, image_token: str) -> int:
    tid = tokenizer.token_id(image_token)
    encoded = tokenizer.backend.encode(image_token, add_special_tokens=False).ids if tid is not None else []
    if tid is None or encoded != [tid]:
        raise UserError(f"{tokenizer.directory}: the image placeholder {image_token!r} is not one token of the tokenizer; "
                        "add it as a special token (LLaVA's tokenizers have <image>) or pass --image-token")
    return tid


def write_image_text_shards(cfg: Any, inputs: list[InputFile], tokenizer: Tokenizer, skips: Any, base: Path,
                            bos_id: int | None, eod_id: int | None) -> tuple[ImageTextWriter, int, int]:
    """Encode every record into one image-text shard at `base`; returns (writer, samples, tokens).
    The caller commits or aborts the writer."""
    if not tokenizer.chat_template:
        raise UserError(f"{tokenizer.directory}: tokenizer has no chat template (chat_template.jinja or "
                        "tokenizer_config.json chat_template) to render the conversations with")
    for inp in inputs:  # refused before anything is read or staged
        kind = input_kind(inp.path)
        if kind is None:
            raise UserError(f"{inp.path}: --format image-text reads LLaVA .json/.jsonl, .parquet or WebDataset .tar "
                            "(give image folders with --image-folder, not --input)")
        inp.kind = kind  # recorded in the manifest's inputs
    token_id = image_token_id(tokenizer, cfg.image_token)
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    writer = ImageTextWriter(base, dtype, cfg.image_token, token_id)
    encoder = SftEncoder(tokenizer, "chat", bos_id, eod_id)
    docs = tokens = 0
    bar = progress(total=sum(i.size for i in inputs) or None, desc="image-text", unit="B", unit_scale=True,
                   quiet=cfg.quiet, mininterval=0.5)
    try:
        with bar:
            for inp in inputs:
                inp.records = 0
                for rec in read_image_records(inp, cfg.image_folder):
                    inp.records += 1
                    try:
                        if isinstance(rec.obj, BadRecord):
                            raise rec.obj
                        messages = conversation(rec.obj, len(rec.images), cfg.image_token)
                        ids, mask = encoder.encode({"messages": messages})
                        if int((ids == token_id).sum()) != len(rec.images):
                            raise BadRecord(f"the chat template renders {int((ids == token_id).sum())} image "
                                            f"placeholders for {len(rec.images)} images")
                    except BadRecord as exc:
                        skips.add(inp.path, inp.records, f"{exc} ({rec.where.removeprefix(str(inp.path) + ':')})")
                        continue
                    images = []
                    for k, src in enumerate(rec.images):
                        where = f"{rec.where} image {k}"
                        data = load_image(src, where)
                        decode_image(data, where, cfg.max_image_pixels)  # raises one line naming the record
                        images.append(data)
                    writer.tokens.add(ids.astype(dtype), np.asarray([len(ids)], dtype=np.int32), mask)
                    writer.images.add(images)
                    docs += 1
                    tokens += len(ids)
                    bar.set_postfix(samples=docs, refresh=False)
                bar.update(inp.size)
    except BaseException:
        writer.abort()
        raise
    return writer, docs, tokens


def verify_images(prefix: Path, manifest: Any, tokens: Any, check_checksums: bool) -> int | None:
    """`tessera-data verify` of an image-text shard's store; returns its image count (None: a text shard)."""
    store = image_store_manifest(manifest)
    if store is None:
        return None
    open_image_store(prefix, store, tokens.num_documents, check_checksums)
    placed = int(np.count_nonzero(np.asarray(tokens.tokens) == store.image_token_id)) if tokens.num_tokens else 0
    if placed != store.num_images:
        raise ArtifactError(f"{bin_path(prefix)}: {placed} image placeholders (id {store.image_token_id}) for "
                            f"{store.num_images} images in the store; the shard is corrupt")
    return store.num_images


def describe_images(prefix: Path, manifest: Any, num_documents: int, docs: list[int]) -> dict[int, str]:
    """`tessera-data inspect` lines for an image-text shard: -1 -> the summary, d -> document d's images
    (format and size read from each header). Empty for a text shard."""
    import io

    from PIL import Image

    store = image_store_manifest(manifest)
    if store is None:
        return {}
    images = open_image_store(prefix, store, num_documents, check_checksums=False)
    per = np.diff(np.asarray(images.doc_idx, dtype=np.int64))
    out = {-1: f"  images: {store.num_images:,} ({images.num_tokens:,} bytes), per sample min {per.min() if len(per) else 0} "
               f"max {per.max() if len(per) else 0}; placeholder {store.image_token!r} = id {store.image_token_id}"}
    for d in docs:
        described = []
        for k, data in enumerate(sample_images(images, d)):
            with Image.open(io.BytesIO(data)) as im:
                described.append(f"image {k}: {im.format} {im.size[0]}x{im.size[1]} {im.mode}, {len(data):,} bytes")
        out[d] = "  " + ("; ".join(described) or "no images")
    return out
