"""The span-corruption batch builder (`train_batch = "span"`): global sample numbers -> T5 batches.

The mixture (tessera-data blend) decides, as for the decoder, which packed window of which
dataset global sample n of a split is; its first `raw_length` tokens (corruption.raw_length: what
the encoder and decoder lengths, training.seq_length and span.decoder_seq_length, hold) are corrupted with draws from (training.seed,
split, n) alone (trainer.mlm.draws.sample_rng), so resume, any data-parallel layout and any
micro-batch split see the same samples.

A batch is (SpanBatch, labels): the encoder input and its padding mask, the decoder input, and
the decoder labels [B, decoder_seq_length] (IGNORE_INDEX past the target), so the loop's per-token
counts are the target tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from tessera.common.errors import UserError
from tessera.common.mixture import MixtureSplit
from tessera.trainer.objectives.batches import MicroBatchPlan
from tessera.trainer.objectives.documents import DocumentMasking
from tessera.trainer.objectives.draws import sample_rng
from tessera.trainer.objectives.span.corruption import SpanOptions, build_sample, raw_length, span_counts

SPLIT_STREAMS = {"train": 0, "valid": 1, "test": 2}
SENTINEL = "<extra_id_{}>"


@dataclass
class SpanBatch:
    """The encoder-decoder's inputs for B samples: row slicing, `.to`, `.shape` as a tensor has
    them, so the engines cut micro-batches from it as from token tensors."""

    tokens: torch.Tensor  # int64 [B, seq_length]
    padding_mask: torch.Tensor  # int64 [B, seq_length], 1 on real tokens
    decoder_tokens: torch.Tensor  # int64 [B, decoder_seq_length]

    def __getitem__(self, rows: slice) -> SpanBatch:
        return SpanBatch(*(getattr(self, f.name)[rows] for f in fields(self)))

    def to(self, device: Any) -> SpanBatch:
        return SpanBatch(*(getattr(self, f.name).to(device) for f in fields(self)))

    @property
    def shape(self) -> torch.Size:
        return self.tokens.shape

    def __len__(self) -> int:
        return self.tokens.shape[0]


def sentinel_ids(tokenizer: Any, count: int, where: str) -> np.ndarray:
    """The ids of `<extra_id_0>` .. `<extra_id_{count-1}>`, or one line naming the tokenizer."""
    ids = [tokenizer.token_id(SENTINEL.format(i)) for i in range(count)]
    missing = next((i for i, t in enumerate(ids) if t is None), None)
    if missing is not None:
        have = f"has only {missing}" if missing else "has none"
        raise UserError(f"{where}: tokenizer {have} of the {count} sentinel tokens <extra_id_0>.. that span corruption "
                        f"needs for these lengths; use T5's tokenizer, or prepare with `tessera-data prep "
                        f"--train-tokenizer --extra-ids 100`")
    return np.asarray(ids, dtype=np.int64)


class SpanBatches:
    """T5 batches read from a mixture split of ordinary token shards."""

    def __init__(self, split: MixtureSplit, seq_length: int, documents: DocumentMasking | None = None, *,
                 options: SpanOptions, sentinels: np.ndarray, eos: int, pad: int, decoder_start: int, seed: int):
        if documents is not None:
            raise UserError("data.reset_position_ids, reset_attention_mask and eod_mask_loss are for packed "
                            "decoder samples; span corruption has its own padding masks: switch them off")
        self.split, self.options, self.seed = split, options, seed
        self.raw_length = raw_length(options)
        if self.raw_length > split.seq_length + 1:
            raise UserError(f"{split.directory}: mixture samples hold {split.seq_length + 1} tokens but span corruption "
                            f"for training.seq_length {options.encoder_length} / span.decoder_seq_length "
                            f"{options.decoder_length} takes {self.raw_length}; rebuild it with `tessera-data blend "
                            f"--seq-length {self.raw_length - 1}` or lower the lengths")
        self.sentinels, self.eos, self.pad, self.decoder_start = sentinels, eos, pad, decoder_start
        self.stream = SPLIT_STREAMS.get(split.split, 3 + sum(map(ord, split.split)))

    @classmethod
    def for_run(cls, cfg: Any, inputs: Any) -> Any:
        """This run's builder: the lengths (training.seq_length, span.decoder_seq_length), the
        model's ids, the `span` section, training.seed, and the checked tokenizer's sentinels (refused now, in one line, when it lacks them)."""
        model, tok, where = inputs.model, inputs.tokenizer, str(cfg.data.tokenizer)
        options = SpanOptions(cfg.span.noise_density, cfg.span.mean_span_length, cfg.training.seq_length,
                              cfg.span.decoder_seq_length)
        sentinels = sentinel_ids(tok, span_counts(raw_length(options), options)[1], where)
        if tok.eos_id is None or tok.eos_id != model.eos_token_id:
            raise UserError(f"model.eos_token_id ({model.eos_token_id}) is not {where}'s eos token "
                            f"({tok.eos_token!r} = {tok.eos_id}); set model.eos_token_id to it")
        return functools.partial(cls, options=options, sentinels=sentinels, eos=tok.eos_id, pad=model.pad_token_id,
                                 decoder_start=model.decoder_start_token_id, seed=cfg.training.seed)

    def __len__(self) -> int:
        return len(self.split)

    def sample(self, n: int):
        """Global sample n of the split (wrapping past its end, as the decoder batches do)."""
        n = int(n) % len(self.split)
        window = np.asarray(self.split[n][:self.raw_length], dtype=np.int64)
        return build_sample(window, self.options, self.sentinels, self.eos, self.pad, self.decoder_start,
                            sample_rng(self.seed, n, self.stream))

    def batch(self, sample_ids: np.ndarray) -> tuple[SpanBatch, torch.Tensor]:
        samples = [self.sample(int(i)) for i in sample_ids]

        def stack(name: str) -> torch.Tensor:
            return torch.from_numpy(np.stack([getattr(s, name) for s in samples]))

        return SpanBatch(stack("tokens"), stack("padding_mask"), stack("decoder_tokens")), stack("labels")

    def micro_batches(self, plan: MicroBatchPlan, consumed_samples: int) -> Iterator[tuple[SpanBatch, torch.Tensor]]:
        for ids in plan.sample_ids(consumed_samples):
            yield self.batch(ids)
