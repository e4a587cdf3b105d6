"""The span-corruption step (`train_loss = "span"`): the decoder's logits against the target
tokens (sentinels, the corrupted spans, EOS), their mean cross-entropy, as transformers'
T5ForConditionalGeneration computes it with labels. Micro-batch losses are averaged, as for the
decoder. Forward, backward, clipping and the optimizer step are TrainStep's; only the loss
differs. With `training.compile` and `compile_scope` blocks (the default) each encoder and decoder
block is compiled in place (one graph per kind of block, shared by the blocks of that kind) and the
head with its cross-entropy is one more graph; with `compile_scope` model both stacks, the head and
the loss are one graph.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.common.errors import UserError
from tessera.trainer.components.model_setup import compile_blocks
from tessera.trainer.components.precision.mixed import Precision
from tessera.trainer.objectives.documents import DocumentMasking
from tessera.trainer.objectives.loss import cross_entropy_loss
from tessera.trainer.objectives.span.batches import SpanBatch
from tessera.trainer.objectives.step import TrainStep, compile_scope


class SpanStep(TrainStep):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, grad_clip: float,
                 loss_chunk_tokens: int | None = None, compile: bool | str = False,
                 documents: DocumentMasking | None = None):
        if loss_chunk_tokens is not None:
            raise UserError("training.loss_chunk_tokens is for the decoder-only next-token loss; an encoder-decoder's "
                            "targets are short: set it to null")
        super().__init__(model, optimizer, precision, grad_clip, None, False, None)
        scope = compile_scope(compile)
        self._span = torch.compile(self._forward_loss) if scope == "model" else self._forward_loss
        self._target_loss = self._head_and_loss
        if scope == "blocks":
            compile_blocks(model)
            self._target_loss = torch.compile(self._head_and_loss)

    def _forward_loss(self, inputs: SpanBatch, labels: torch.Tensor, reduction: str) -> torch.Tensor:
        hidden = self.model.hidden(inputs.tokens, decoder_input_ids=inputs.decoder_tokens,
                                   attention_mask=inputs.padding_mask)
        return self._target_loss(hidden, labels, reduction)

    def _head_and_loss(self, hidden: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
        return cross_entropy_loss(self.model.head(hidden), labels, reduction=reduction)

    def loss(self, inputs: SpanBatch, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:  # type: ignore[override]
        with self.precision.autocast():
            return self._span(inputs, labels, reduction)
