"""The masked-LM batch builder (`train_batch = "mlm"`): global sample numbers -> BERT batches.

The mixture (tessera-data blend) decides, as for every kind, which dataset each global sample n
of a split comes from and its number j in that dataset's stream; its document split ratios
decide which documents each split owns. What a BERT sample is differs from a packed decoder
sample, so each dataset's sentence runs are indexed here (samples.build_sample_index, seeded by
the mixture's seed and the dataset, the same on every rank: no rank waits for another), and
sample j is run j modulo their count. Pairing, truncation and masks are drawn from
(training.seed, split, n) alone (draws.sample_rng): resume, any data-parallel layout and any
micro-batch split see the same masks.

A batch is (MLMBatch, labels): the model's inputs and the binary target, and the MLM labels
[B, S] (IGNORE_INDEX where nothing is predicted), so the loop's per-token counts are the masked
tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from tessera.common.errors import ArtifactError, UserError
from tessera.common.mixture import MixtureSplit
from tessera.trainer.objectives.batches import MicroBatchPlan
from tessera.trainer.objectives.documents import DocumentMasking
from tessera.trainer.objectives.draws import sample_rng
from tessera.trainer.objectives.mlm.samples import (
    MaskingOptions,
    SpecialIds,
    build_sample,
    build_sample_index,
    continuation_flags,
)

SPLIT_STREAMS = {"train": 0, "valid": 1, "test": 2}
INDEX_STREAM = 1 << 20  # keeps the sample-index draws apart from every sample's


@dataclass
class MLMBatch:
    """The encoder's inputs for B sequences (and the binary target): row slicing, `.to`, `.shape`
    as a tensor has them, so the engines cut micro-batches from it as from token tensors."""

    tokens: torch.Tensor  # int64 [B, S]
    token_types: torch.Tensor  # int64 [B, S]
    padding_mask: torch.Tensor  # int64 [B, S], 1 on real tokens
    binary_labels: torch.Tensor  # int64 [B]: sentence order swapped / B random (1) or not; IGNORE_INDEX without the head

    def __getitem__(self, rows: slice) -> MLMBatch:
        return MLMBatch(*(getattr(self, f.name)[rows] for f in fields(self)))

    def to(self, device: Any) -> MLMBatch:
        return MLMBatch(*(getattr(self, f.name).to(device) for f in fields(self)))

    @property
    def shape(self) -> torch.Size:
        return self.tokens.shape

    def __len__(self) -> int:
        return self.tokens.shape[0]


def special_ids(tokenizer: Any, where: str) -> SpecialIds:
    """[CLS] [SEP] [MASK] [PAD] of a tessera Tokenizer (its config's *_token, else BERT's names), or one
    line naming the tokenizer and the missing token."""
    found = {}
    for key, default in (("cls", "[CLS]"), ("sep", "[SEP]"), ("mask", "[MASK]"), ("pad", "[PAD]")):
        value = tokenizer.config.get(f"{key}_token")
        name = value.get("content") if isinstance(value, dict) else value
        token_id = tokenizer.token_id(name or default)
        if token_id is None:
            raise UserError(f"{where}: tokenizer has no {name or default} token, which masked-LM training needs "
                            f"({key}_token); use a WordPiece tokenizer with [CLS] [SEP] [MASK] [PAD] "
                            "(tessera-data prep --train-tokenizer --tokenizer-type wordpiece, or BERT's vocab.txt)")
        found[key] = token_id
    return SpecialIds(vocab_size=tokenizer.vocab_size, **found)


class MLMBatches:
    """BERT batches read from a mixture split of sentence-split shards."""

    def __init__(self, split: MixtureSplit, seq_length: int, documents: DocumentMasking | None = None, *,
                 tokenizer: Any, options: MaskingOptions, seed: int, where: str = "data.tokenizer"):
        if documents is not None:
            raise UserError("data.reset_position_ids, reset_attention_mask and eod_mask_loss are for packed "
                            "decoder samples; a masked-LM run has its own padding mask: switch them off")
        if seq_length < 4:
            raise UserError(f"training.seq_length ({seq_length}): a BERT sample needs at least 4 tokens "
                            "([CLS] A [SEP] and one more)")
        self.split = split
        self.seq_length = seq_length
        self.options = options
        self.seed = seed
        self.ids = special_ids(tokenizer, where)
        self.continuation = continuation_flags(tokenizer.backend, max(self.ids.vocab_size, split.manifest.vocab_size))
        self.stream = SPLIT_STREAMS.get(split.split, 3 + sum(map(ord, split.split)))
        info = split.manifest.splits[split.split]
        self.index: list[np.ndarray] = []
        self.doc_ranges: list[tuple[int, int]] = []
        for k, ds in enumerate(split.datasets):
            first, last = info.documents[k] if k < len(info.documents) else (0, ds.num_documents)
            self.doc_ranges.append((int(first), int(last)))
            rng = sample_rng(split.manifest.seed, k, INDEX_STREAM, self.stream)
            index = build_sample_index(ds, first, last, seq_length - 3, options, rng)
            if len(index) == 0 and len(split) > 0 and (np.asarray(split.dataset_index) == k).any():
                need = "two sentences" if options.binary_head else "one sentence"
                raise ArtifactError(f"{ds.prefix}: no document of split {split.split!r} has {need} to make a BERT "
                                    "sample of; prepare the shard with `tessera-data prep --split-sentences`"
                                    + (" or turn the binary head off" if options.binary_head else ""))
            self.index.append(index)

    @classmethod
    def for_run(cls, cfg: Any, inputs: Any) -> Any:
        """This run's builder: the checked tokenizer's special ids (refused now, in one line, when
        [MASK] or another is missing), the `mlm` section, training.seed, the model's binary head."""
        special_ids(inputs.tokenizer, str(cfg.data.tokenizer))
        m = cfg.mlm
        options = MaskingOptions(m.mask_prob, m.whole_word, m.max_ngram, m.short_seq_prob,
                                 bool(getattr(inputs.model, "binary_head", False)),
                                 m.binary_target == "next_sentence")
        return functools.partial(cls, tokenizer=inputs.tokenizer, options=options, seed=cfg.training.seed,
                                 where=str(cfg.data.tokenizer))

    def __len__(self) -> int:
        return len(self.split)

    def sample(self, n: int):
        """Global sample n of the split (wrapping past its end, as the decoder batches do)."""
        n = int(n) % len(self.split)
        k, j = int(self.split.dataset_index[n]), int(self.split.dataset_sample_index[n])
        index = self.index[k]
        rng = sample_rng(self.seed, n, self.stream)
        return build_sample(self.split.datasets[k], index[j % len(index)], self.seq_length, self.ids,
                            self.continuation, self.options, rng, self.doc_ranges[k])

    def batch(self, sample_ids: np.ndarray) -> tuple[MLMBatch, torch.Tensor]:
        samples = [self.sample(int(i)) for i in sample_ids]

        def stack(name: str) -> torch.Tensor:
            return torch.from_numpy(np.stack([getattr(s, name) for s in samples]))

        inputs = MLMBatch(stack("tokens"), stack("token_types"), stack("padding_mask"),
                          torch.tensor([s.binary_label for s in samples], dtype=torch.int64))
        return inputs, stack("labels")

    def micro_batches(self, plan: MicroBatchPlan, consumed_samples: int) -> Iterator[tuple[MLMBatch, torch.Tensor]]:
        for ids in plan.sample_ids(consumed_samples):
            yield self.batch(ids)
