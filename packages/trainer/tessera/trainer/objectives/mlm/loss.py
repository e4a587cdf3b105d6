"""The masked-LM step (`train_loss = "mlm"`): the encoder's MLM logits against the masked
positions' labels, plus, with the binary head, cross-entropy of the sentence-order target; each
a mean (over the masked tokens, over the rows), summed, as Megatron's BERT loss and transformers'
BertForPreTraining compute it. Micro-batch losses are averaged, as for the decoder.

Forward, backward, clipping and the optimizer step are TrainStep's; only the loss differs. The
MLM head (transform and vocabulary projection) runs on the labelled positions only, about 15% of
the tokens: the same loss and gradients as logits everywhere with the rest ignored (what Megatron
and transformers compute), without the largest matmul of the step on the other 85%. With
`training.compile` and `compile_scope` blocks (the default) each encoder block is compiled in place
(blocks share one graph) and the head with its cross-entropy is one more graph, compiled for any
number of labelled positions (dynamic shapes: the count changes every batch); with `compile_scope`
model the whole forward and loss are one graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.common.errors import UserError
from tessera.trainer.components.model_setup import compile_blocks
from tessera.trainer.components.precision.mixed import Precision
from tessera.trainer.objectives.documents import IGNORE_INDEX, DocumentMasking
from tessera.trainer.objectives.loss import cross_entropy_loss
from tessera.trainer.objectives.mlm.batches import MLMBatch
from tessera.trainer.objectives.step import TrainStep, compile_scope


def mlm_loss(output, labels: torch.Tensor, binary_labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """MLM cross-entropy over the labelled positions (+ the binary head's over the labelled rows)
    from an EncoderOutput (mlm_logits [B, T, V], or [N, V] of the N labelled positions with
    `labels` [N]; binary_logits [B, 2] or None)."""
    logits = output.mlm_logits if output.mlm_logits.dim() == 3 else output.mlm_logits[None]
    loss = cross_entropy_loss(logits, labels if labels.dim() == 2 else labels[None], reduction=reduction)
    return loss + binary_loss(output, binary_labels, reduction)


def binary_loss(output, binary_labels: torch.Tensor, reduction: str) -> torch.Tensor | float:
    """The binary (sentence-order) head's cross-entropy over the labelled rows; 0 without the head."""
    if output.binary_logits is None:  # the batches carry the target exactly when the model has the head
        return 0.0
    return F.cross_entropy(output.binary_logits.float(), binary_labels, ignore_index=IGNORE_INDEX,
                           reduction=reduction)


class MLMStep(TrainStep):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, grad_clip: float,
                 loss_chunk_tokens: int | None = None, compile: bool | str = False,
                 documents: DocumentMasking | None = None):
        if loss_chunk_tokens is not None:
            raise UserError("training.loss_chunk_tokens is for the decoder's next-token loss; a masked-LM run "
                            "predicts only the masked tokens: set it to null")
        super().__init__(model, optimizer, precision, grad_clip, None, False, None)
        scope = compile_scope(compile)
        self._mlm = torch.compile(self._forward_loss) if scope == "model" else self._forward_loss
        self._picked_loss = self._masked_loss
        if scope == "blocks":
            compile_blocks(model)
            self._picked_loss = torch.compile(self._masked_loss, dynamic=True)

    def _forward_loss(self, inputs: MLMBatch, labels: torch.Tensor, reduction: str) -> torch.Tensor:
        output = self.model(inputs.tokens, token_types=inputs.token_types, attention_mask=inputs.padding_mask,
                            return_hidden=True)
        picked = labels != IGNORE_INDEX
        loss = self._picked_loss(output.hidden[picked], labels[picked], reduction)
        return loss + binary_loss(output, inputs.binary_labels, reduction)

    def _masked_loss(self, hidden: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
        """The MLM head over the N labelled positions' hidden states [N, d] and its cross-entropy."""
        logits = self.model.logits(self.model.mlm_head.transform(hidden))
        return cross_entropy_loss(logits[None], labels[None], reduction=reduction)

    def loss(self, inputs: MLMBatch, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:  # type: ignore[override]
        with self.precision.autocast():
            return self._mlm(inputs, labels, reduction)
