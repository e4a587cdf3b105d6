"""The masked-LM step (`train_loss = "mlm"`): the encoder's MLM logits against the masked
positions' labels, plus, with the binary head, cross-entropy of the sentence-order target; each
a mean (over the masked tokens, over the rows), summed, as Megatron's BERT loss and transformers'
BertForPreTraining compute it. Micro-batch losses are averaged, as for the decoder.

Forward, backward, clipping and the optimizer step are TrainStep's; only the loss differs. The
MLM head (transform and vocabulary projection) runs on the labelled positions only, about 15% of
the tokens: the same loss and gradients as logits everywhere with the rest ignored (what Megatron
and transformers compute), without the largest matmul of the step on the other 85%. With
`training.compile` the model forward and this loss are one graph, whatever `compile_scope` says
(regional compilation is built for the decoder's step only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.common.errors import UserError
from tessera.trainer.components.precision.mixed import Precision
from tessera.trainer.objectives.documents import IGNORE_INDEX, DocumentMasking
from tessera.trainer.objectives.loss import cross_entropy_loss
from tessera.trainer.objectives.mlm.batches import MLMBatch
from tessera.trainer.objectives.step import TrainStep


def mlm_loss(output, labels: torch.Tensor, binary_labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """MLM cross-entropy over the labelled positions (+ the binary head's over the labelled rows)
    from an EncoderOutput (mlm_logits [B, T, V], or [N, V] of the N labelled positions with
    `labels` [N]; binary_logits [B, 2] or None)."""
    logits = output.mlm_logits if output.mlm_logits.dim() == 3 else output.mlm_logits[None]
    loss = cross_entropy_loss(logits, labels if labels.dim() == 2 else labels[None], reduction=reduction)
    if output.binary_logits is not None:  # the batches carry the target exactly when the model has the head
        loss = loss + F.cross_entropy(output.binary_logits.float(), binary_labels, ignore_index=IGNORE_INDEX,
                                      reduction=reduction)
    return loss


class MLMStep(TrainStep):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, grad_clip: float,
                 loss_chunk_tokens: int | None = None, compile: bool | str = False,
                 documents: DocumentMasking | None = None):
        if loss_chunk_tokens is not None:
            raise UserError("training.loss_chunk_tokens is for the decoder's next-token loss; a masked-LM run "
                            "predicts only the masked tokens: set it to null")
        super().__init__(model, optimizer, precision, grad_clip, None, False, None)
        self._mlm = torch.compile(self._forward_loss) if compile else self._forward_loss

    def _forward_loss(self, inputs: MLMBatch, labels: torch.Tensor, reduction: str) -> torch.Tensor:
        output = self.model(inputs.tokens, token_types=inputs.token_types, attention_mask=inputs.padding_mask,
                            return_hidden=True)
        picked = labels != IGNORE_INDEX
        logits = self.model.logits(self.model.mlm_head.transform(output.hidden[picked]))
        return mlm_loss(output._replace(mlm_logits=logits), labels[picked], inputs.binary_labels, reduction)

    def loss(self, inputs: MLMBatch, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:  # type: ignore[override]
        with self.precision.autocast():
            return self._mlm(inputs, labels, reduction)
