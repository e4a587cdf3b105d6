"""Batches from a mixture split: global batch -> this rank's share -> micro-batches.

The data position is one integer, `consumed_samples` (global samples used so far), so resume is
exact and independent of the layout: optimizer step s reads global samples
[s * global_batch, (s + 1) * global_batch); data-parallel rank r of W takes the r-th contiguous
slice of global_batch / W samples, cut into micro-batches. Sample numbers past the end of the
split wrap around (another epoch over the mixture, in the same order).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from tessera.common.errors import UserError
from tessera.common.mixture import MixtureSplit
from tessera.common.models.vision_language.image_shard import has_image_store
from tessera.trainer.objectives.documents import DocumentMasking


def global_batch_size_at(consumed_samples: int, global_batch_size: int,
                         rampup: tuple[int, int, int] | None = None) -> int:
    """Global batch of the step starting at `consumed_samples` (Megatron's batch-size ramp-up).

    With rampup = (start, increment, samples): the (global_batch_size - start) / increment
    increments are spread evenly over the first `samples` consumed samples, so the batch is
    start + increment * floor(consumed / (samples / increments)), and global_batch_size once more
    than `samples` have been consumed. A function of the data position alone, so resume is exact.
    """
    if rampup is None:
        return global_batch_size
    start, increment, samples = rampup
    if consumed_samples > samples:
        return global_batch_size
    samples_per_increment = samples / ((global_batch_size - start) // increment)
    return min(start + increment * int(consumed_samples / samples_per_increment), global_batch_size)


class MicroBatchPlan:
    """How one global batch is divided among data-parallel ranks and micro-batches."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1):
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"micro_batch_size ({micro_batch_size}) x data-parallel size ({dp_size}) must divide "
                             f"global_batch_size ({global_batch_size})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.per_rank = global_batch_size // dp_size
        self.num_micro_batches = self.per_rank // micro_batch_size

    def rank_sample_ids(self, consumed_samples: int) -> np.ndarray:
        """Global sample numbers of this rank's rows of the step starting at consumed_samples."""
        start = consumed_samples + self.dp_rank * self.per_rank
        return np.arange(start, start + self.per_rank)

    def sample_ids(self, consumed_samples: int) -> list[np.ndarray]:
        """Global sample numbers of each of this rank's micro-batches for the step starting at consumed_samples."""
        start = consumed_samples + self.dp_rank * self.per_rank
        return [np.arange(start + i * self.micro_batch_size, start + (i + 1) * self.micro_batch_size)
                for i in range(self.num_micro_batches)]


class MixtureBatches:
    """Token tensors for training or evaluation, read from a memory-mapped mixture split."""

    def __init__(self, split: MixtureSplit, seq_length: int, documents: DocumentMasking | None = None):
        if seq_length > split.seq_length:
            raise ValueError(f"seq_length {seq_length} longer than the mixture's {split.seq_length}")
        for ds in split.datasets:  # a placeholder token would be trained on as text, the images never seen
            if has_image_store(ds.prefix):
                raise UserError(f"{ds.prefix}: an image-text shard, which a text model cannot read; train a "
                                "vision-language model on it (model.kind: vision_language) or blend text shards")
        self.split = split
        self.seq_length = seq_length
        self.documents = documents

    def __len__(self) -> int:
        return len(self.split)

    def batch(self, sample_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs, labels: int64 [len(sample_ids), seq_length], labels shifted by one token.

        A mixture built for a longer sequence serves a shorter one by taking the first
        seq_length + 1 tokens of each sample. With data.eod_mask_loss, labels whose input token is
        the end-of-document token are IGNORE_INDEX (documents.py); with a loss-masked mixture
        (fine-tuning data), so are labels whose token the mask excludes.
        """
        n = len(self.split)
        rows = [self.split[int(i) % n][: self.seq_length + 1] for i in sample_ids]
        tokens = torch.from_numpy(np.stack(rows))
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if self.documents is not None:
            label_mask = None
            if self.documents.loss_mask:
                masks = [self.split.loss_mask(int(i) % n)[: self.seq_length + 1] for i in sample_ids]
                label_mask = torch.from_numpy(np.stack(masks))[:, 1:]
            labels = self.documents.mask_labels(inputs, labels, label_mask)
        return inputs, labels

    def micro_batches(self, plan: MicroBatchPlan, consumed_samples: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for ids in plan.sample_ids(consumed_samples):
            yield self.batch(ids)
