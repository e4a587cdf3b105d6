"""The span-corruption objective under the parallel runtime (tessera.trainer.objectives.objective).

A batch (SpanBatch, labels) enters as: the corrupted encoder tokens into the (only) stage; the
encoder's padding mask and the decoder's input tokens (the targets shifted right) as side inputs,
row-aligned so the runtime cuts micro-batches from them as from the tokens; the target tokens
[rows, decoder_seq_length] (-100 on padding) as targets. The stage runs the encoder, the decoder
with cross-attention and this rank's vocabulary slice of the head (T5's d_model**-0.5 scaling,
tied or untied: encoder_decoder.parallelize.parallel_logits) inside its forward, so FSDP gathers
the weights only around it. The loss is the vocab-parallel cross-entropy's mean over the counted
targets per micro-batch, averaged over micro-batches as SpanStep does on one process.

Pipeline parallel is refused (`pipeline = False`): Megatron cuts an encoder-decoder into encoder
stages and decoder stages, with the encoder's output carried to every decoder stage; the runtime's
pipeline cuts one stack of layers, and that split is not built.
"""

from __future__ import annotations

import torch

from tessera.common.models.encoder_decoder.parallelize import parallel_logits
from tessera.common.parallel.loss import vocab_parallel_cross_entropy
from tessera.trainer.objectives.documents import IGNORE_INDEX
from tessera.trainer.objectives.objective import LossContext


class SpanCorruption:
    pipeline = False

    def __init__(self, cfg=None) -> None:
        pass

    def split(self, batch, labels: torch.Tensor, model_inputs: dict[str, torch.Tensor] | None):
        side = {"attention_mask": batch.padding_mask, "decoder_input_ids": batch.decoder_tokens}
        return batch.tokens, side, labels

    def stage_forward(self, stage, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      decoder_input_ids: torch.Tensor | None = None):
        model = stage.model
        hidden = model.hidden(x, decoder_input_ids=decoder_input_ids, attention_mask=attention_mask)
        return parallel_logits(model, hidden)

    def loss(self, output: torch.Tensor, targets: torch.Tensor, ctx: LossContext) -> torch.Tensor:
        counted = targets != IGNORE_INDEX
        # Ignored positions get a valid id (their loss is zeroed, so their gradient is zero too).
        per_token = vocab_parallel_cross_entropy(output, targets.masked_fill(~counted, 0), ctx.tp_group)
        return (per_token * counted).sum() / counted.sum().clamp(min=1) / ctx.share
