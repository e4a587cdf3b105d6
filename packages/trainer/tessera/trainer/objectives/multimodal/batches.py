"""The vision-language batch builder (`train_batch = "vision_language"`): image-text shards ->
batches of whole samples, one per row or (data.pack_samples) several per row.

An image-text shard (docs/formats/image-text-shard.md) keeps one placeholder token per image; the
model writes `image_seq_len` features per image over as many image tokens, so each placeholder is
expanded here to that many. Expansion changes a sample's length, so the mixture's packed windows
(cut before expansion) would split an image's run of tokens between two rows, and the tower's
features of one image cannot be split. So rows hold whole samples (global sample n is document
j mod count of dataset k, as the mixture maps n to (k, j): the split's shuffled, epoch-repeated
document order), placeholders expanded, padded to training.seq_length with ignored labels; a sample
longer than that after expansion is refused in one line naming it, since cutting it would cut an
image or lose the answer. Unpacked, row n is sample n. Packed (tessera.trainer.objectives.multimodal.packing),
row r is the next run of consecutive samples that fits, each with its own positions and attention
(`positions`, `document_ids` of the batch, which the model's forward takes). Images are decoded and
processed at batch time by the shared image processor (tessera.common.models.vision_language.processor),
several per sample in placeholder order, a row's samples in order. Nothing is drawn at random: a
resumed run reads exactly the same batches.

Labels are the next token where the shard's loss mask marks it (the answers), IGNORE_INDEX
elsewhere (prompts, image tokens, padding).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessera.common.errors import ArtifactError, UserError
from tessera.common.mixture import MixtureSplit
from tessera.common.models.vision_language.image_shard import (
    image_store_manifest,
    open_image_store,
    sample_images,
)
from tessera.common.models.vision_language.processor import PREPROCESSOR_CONFIG, ImageProcessor, decode_image
from tessera.common.shard import read_shard_manifest
from tessera.trainer.objectives.batches import MicroBatchPlan
from tessera.trainer.objectives.documents import DocumentMasking
from tessera.trainer.objectives.multimodal.packing import SamplePacking, pack_row, stack_rows


@dataclass
class VisionLanguageBatch:
    """B rows of tokens and their images: pixels [B, M, C, H, W] (M = the most images of a row,
    zeros past a row's count), so slicing rows slices images too (the engines and the pipeline
    cut micro-batches by rows). Packed rows also carry each token's position in its sample and
    its sample's number in the row (`model_inputs()`: the forward's keyword arguments)."""

    tokens: torch.Tensor  # int64 [B, S], each placeholder expanded to the tower's feature count
    pixels: torch.Tensor  # float32 [B, M, C, H, W]
    num_images: torch.Tensor  # int64 [B]
    positions: torch.Tensor | None = None  # int64 [B, S], packed rows only
    document_ids: torch.Tensor | None = None  # int64 [B, S], packed rows only

    def _map(self, fn: Any) -> VisionLanguageBatch:
        return VisionLanguageBatch(*(None if (v := getattr(self, f.name)) is None else fn(v) for f in fields(self)))

    def __getitem__(self, rows: slice) -> VisionLanguageBatch:
        return self._map(lambda t: t[rows])

    def to(self, device: Any) -> VisionLanguageBatch:
        return self._map(lambda t: t.to(device))

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """`positions` and `document_ids` for the model's forward when the rows are packed, else {}
        (the same keywords as tessera.trainer.objectives.documents.DocumentMasking.model_inputs)."""
        return {k: v for k, v in (("positions", self.positions), ("document_ids", self.document_ids)) if v is not None}

    @property
    def shape(self) -> torch.Size:
        return self.tokens.shape

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def images(self) -> torch.Tensor:
        """The batch's images in reading order, [N, C, H, W] (what the model takes)."""
        m = self.pixels.shape[1]
        present = torch.arange(m, device=self.num_images.device)[None, :] < self.num_images[:, None]
        return self.pixels[present]


def default_processor(model: Any) -> ImageProcessor:
    """The processor transformers' CLIP / SigLIP image processors apply for this tower's image size
    (CLIP: shortest edge then center crop, OpenAI's mean/std; SigLIP: a fixed size, mean/std 0.5)."""
    size = model.vision.image_size
    if model.vision.arch == "siglip":
        return ImageProcessor(shortest_edge=None, size=(size, size), do_center_crop=False,
                              image_mean=(0.5,) * 3, image_std=(0.5,) * 3)
    return ImageProcessor(shortest_edge=size, crop_size=(size, size))


def run_processor(model: Any, tokenizer_dir: Path) -> ImageProcessor:
    """The processor of this run: the tokenizer directory's preprocessor_config.json when it has one
    (an HF model directory carries both), else the tower's default."""
    if (tokenizer_dir / PREPROCESSOR_CONFIG).is_file():
        processor = ImageProcessor.from_dir(tokenizer_dir)
    else:
        processor = default_processor(model)
    size = model.vision.image_size
    out = processor.crop_size if processor.do_center_crop else processor.size
    if out is not None and tuple(out) != (size, size):
        raise UserError(f"{tokenizer_dir / PREPROCESSOR_CONFIG}: images come out {out[0]}x{out[1]}, the vision tower "
                        f"reads {size}x{size} (model.vision.image_size)")
    return processor


class VisionLanguageBatches:
    """(VisionLanguageBatch, labels) batches read from a mixture split of image-text shards."""

    def __init__(self, split: MixtureSplit, seq_length: int, documents: DocumentMasking | None = None, *,
                 model: Any, processor: ImageProcessor, pack: bool = False):
        if documents is not None and (documents.reset_position_ids or documents.reset_attention_mask
                                      or documents.eod_mask_loss):  # the shard's loss mask is always applied
            raise UserError("data.reset_position_ids, reset_attention_mask and eod_mask_loss are for the text mixture's "
                            "windows; a vision-language run keeps samples whole (data.pack_samples packs them, "
                            "positions and attention per sample): switch them off")
        self.split = split
        self.seq_length = seq_length
        self.image_seq_len = model.image_seq_len
        self.image_token_id = model.image_token_id
        self.processor = processor
        self.stores = []
        for ds in split.datasets:
            manifest = read_shard_manifest(ds.prefix)
            store = image_store_manifest(manifest)
            if store is None:
                raise UserError(f"{ds.prefix}: a text shard in a vision-language run's mixture; blend image-text "
                                "shards (tessera-data prep --format image-text)")
            if store.image_token_id != model.image_token_id:
                raise UserError(f"{ds.prefix}.json: images.image_token_id is {store.image_token_id}, the model's "
                                f"image_token_id is {model.image_token_id}; prepare the shard with the model's "
                                "tokenizer or set model.image_token_id")
            self.stores.append(open_image_store(ds.prefix, store, ds.num_documents, check_checksums=False))
        self._sizes: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.packing = SamplePacking(self.sample_positions, seq_length) if pack else None

    @classmethod
    def for_run(cls, cfg: Any, inputs: Any) -> Any:
        """This run's builder: the checked model config and the processor (refused now, in one line,
        when its output size is not the tower's)."""
        model = inputs.model
        return functools.partial(cls, model=model, processor=run_processor(model, Path(cfg.data.tokenizer)),
                                 pack=cfg.data.pack_samples)

    def __len__(self) -> int:
        return len(self.split)

    def document(self, n: int) -> tuple[int, int]:
        """(dataset k, document) of global sample n (wrapping past the split's end)."""
        n = int(n) % len(self.split)
        k, j = int(self.split.dataset_index[n]), int(self.split.dataset_sample_index[n])
        order = self.split.document_index[k]
        return k, int(order[j % len(order)])

    def sample_positions(self, ns: np.ndarray) -> np.ndarray:
        """Positions samples ns take in a row (expanded tokens but the last), from the shards'
        indexes alone: tokens per document plus (image_seq_len - 1) per image."""
        ns = ns % len(self.split)
        ks = np.asarray(self.split.dataset_index[ns])
        out = np.zeros(len(ns), dtype=np.int64)
        for k in np.unique(ks):
            tokens, images = self._document_sizes(int(k))
            at = ks == k
            order = self.split.document_index[k]
            docs = np.asarray(order)[np.asarray(self.split.dataset_sample_index[ns[at]]) % len(order)]
            out[at] = tokens[docs] + images[docs] * (self.image_seq_len - 1) - 1
        return np.maximum(out, 0)

    def _document_sizes(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, images) of each document of dataset k."""
        if k not in self._sizes:
            ds, store = self.split.datasets[k], self.stores[k]
            ends = np.concatenate([[0], np.cumsum(ds.lengths, dtype=np.int64)])
            self._sizes[k] = (ends[ds.doc_idx[1:]] - ends[ds.doc_idx[:-1]],
                              np.diff(np.asarray(store.doc_idx, dtype=np.int64)))
        return self._sizes[k]

    def sample_parts(self, n: int) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """Sample n: token ids (placeholders expanded), whether each is a counted target, its images."""
        k, doc = self.document(n)
        ds, mask = self.split.datasets[k], self.split.masks[k]
        ids = np.asarray(ds.document_tokens(doc), dtype=np.int64)
        start, count = ds.document_range(doc)
        counted = np.asarray(mask[start:start + count], dtype=bool) if mask is not None else np.ones(count, bool)
        image = ids == self.image_token_id
        repeat = np.where(image, self.image_seq_len, 1)
        ids, counted = np.repeat(ids, repeat), np.repeat(counted & ~image, repeat)
        where = f"{ds.prefix}: sample {doc}"
        if len(ids) > self.seq_length + 1:
            raise UserError(f"{where} is {len(ids)} tokens with its images' {self.image_seq_len} tokens each, over "
                            f"training.seq_length + 1 ({self.seq_length + 1}); raise seq_length or prepare shorter "
                            "samples")
        datas = sample_images(self.stores[k], doc)
        if len(datas) != int(image.sum()):
            raise ArtifactError(f"{where}: {int(image.sum())} image placeholders for {len(datas)} images; the shard "
                                "is corrupt (tessera-data verify names it)")
        pixels = (self.processor.batch([decode_image(d, f"{where}, image {i}") for i, d in enumerate(datas)])
                  if datas else torch.zeros(0, 3, self.processor_size, self.processor_size))
        return ids, counted, pixels

    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """Sample n alone: tokens and labels [seq_length] (placeholders expanded, padded) and its images."""
        ids, counted, pixels = self.sample_parts(n)
        row = pack_row([(ids, counted)], self.seq_length)
        return row["tokens"], row["labels"], pixels

    @property
    def processor_size(self) -> int:
        size = self.processor.crop_size if self.processor.do_center_crop else self.processor.size
        return int(size[0]) if size is not None else 0

    def batch(self, sample_ids: np.ndarray) -> tuple[VisionLanguageBatch, torch.Tensor]:
        """Rows `sample_ids` (global sample numbers, or row numbers when packed) and their labels."""
        rows, row_images = [], []
        for r in sample_ids:
            parts = [self.sample_parts(n) for n in (self.packing.row(int(r)) if self.packing else (int(r),))]
            rows.append(pack_row([(ids, counted) for ids, counted, _ in parts], self.seq_length))
            row_images.append(torch.cat([p[2] for p in parts]))
        most = max((images.shape[0] for images in row_images), default=0)
        size = self.processor_size
        pixels = torch.zeros(len(rows), most, 3, size, size)
        for row, images in enumerate(row_images):
            pixels[row, :images.shape[0]] = images
        packed = {k: stack_rows(rows, k) for k in ("positions", "document_ids")} if self.packing else {}
        inputs = VisionLanguageBatch(stack_rows(rows, "tokens"), pixels,
                                     torch.tensor([images.shape[0] for images in row_images], dtype=torch.int64),
                                     **packed)
        return inputs, stack_rows(rows, "labels")

    def micro_batches(self, plan: MicroBatchPlan, consumed_samples: int) -> Iterator[tuple[VisionLanguageBatch, torch.Tensor]]:
        for ids in plan.sample_ids(consumed_samples):
            yield self.batch(ids)
