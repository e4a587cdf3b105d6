"""Document boundaries inside packed samples (Megatron's reset_position_ids, reset_attention_mask
and eod_mask_loss).

A mixture sample is seq_length + 1 consecutive tokens of the concatenated corpus, so it usually
holds the end of one document, an end-of-document (EOD) token, and the start of the next. By
default the model sees the sample as one text. These options make it see the documents:

* reset_position_ids: positions restart at 0 on the token after each EOD;
* reset_attention_mask: a token attends only to earlier tokens of its own document;
* eod_mask_loss: no loss where the input token is EOD (predicting the next document's first
  token from the previous document), and the loss is averaged over the tokens that count, over
  the whole global batch (not a mean of micro-batch means, which would weight a token by how
  many others its micro-batch lost).

Fine-tuning data carries a loss mask per token (tessera.common.shard: 1 on answer tokens); with
`loss_mask` the labels whose target token the mask excludes are ignored, and the loss is the same
per-token mean over the whole global batch as with eod_mask_loss (`per_token_loss`).

The EOD token ends its document: tokens up to and including an EOD belong to one document, the
token after it starts the next. Everything here is a pure function of the input tokens, so every
rank and every layout derives the same positions, masks and labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # label value the losses skip (F.cross_entropy's default ignore_index)


@dataclass(frozen=True)
class DocumentMasking:
    eod_id: int | None  # None: only the loss mask is used (no document options)
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    loss_mask: bool = False  # the mixture carries loss masks (fine-tuning data)

    @property
    def per_token_loss(self) -> bool:
        """The loss is the mean over the counted tokens of the global batch."""
        return self.eod_mask_loss or self.loss_mask

    def model_inputs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Keyword arguments for the model's forward: `positions` and/or `document_ids`, [B, T]."""
        out: dict[str, torch.Tensor] = {}
        if not (self.reset_position_ids or self.reset_attention_mask):
            return out
        # starts[b, t]: token t is the first of a document that began inside this sample.
        starts = torch.zeros_like(inputs, dtype=torch.bool)
        starts[:, 1:] = inputs[:, :-1] == self.eod_id
        if self.reset_attention_mask:
            out["document_ids"] = starts.cumsum(dim=1)
        if self.reset_position_ids:
            index = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
            last_start = torch.where(starts, index, 0).cummax(dim=1).values
            out["positions"] = index - last_start
        return out

    def mask_labels(self, inputs: torch.Tensor, labels: torch.Tensor,
                    label_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Labels with IGNORE_INDEX where the input token is EOD (when eod_mask_loss) and where
        `label_mask` (the loss mask of the label tokens, [B, T]) is 0 (when loss_mask)."""
        if self.eod_mask_loss:
            labels = labels.masked_fill(inputs == self.eod_id, IGNORE_INDEX)
        if self.loss_mask and label_mask is not None:
            labels = labels.masked_fill(label_mask == 0, IGNORE_INDEX)
        return labels


def loss_token_count(labels: torch.Tensor) -> torch.Tensor:
    """Label positions that count toward the loss (int64 scalar tensor)."""
    return (labels != IGNORE_INDEX).sum()
