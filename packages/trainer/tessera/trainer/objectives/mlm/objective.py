"""The masked-LM objective under the parallel runtime (tessera.trainer.objectives.objective).

A batch (MLMBatch, labels) enters as: tokens into the first stage; token types and the padding
mask as side inputs of every stage (the first embeds the types, every block masks the padding);
labels [rows, T] with the binary target appended as column T, one target tensor the pipeline
schedule cuts into micro-batches. The last stage computes the MLM transform, this rank's
vocabulary slice of the logits and the binary head inside its forward (FSDP gathers the weights
only around it); the loss is the vocab-parallel cross-entropy's mean over the masked tokens plus
the binary head's mean over the rows, per micro-batch, averaged over micro-batches as MLMStep does
on one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.common.parallel.loss import vocab_parallel_cross_entropy
from tessera.common.parallel.tensor_parallel import parallel_logits
from tessera.trainer.objectives.documents import IGNORE_INDEX
from tessera.trainer.objectives.objective import LossContext


class MaskedLM:
    pipeline = True

    def __init__(self, cfg) -> None:
        self.binary_head = bool(getattr(cfg, "binary_head", False))

    def split(self, batch, labels: torch.Tensor, model_inputs: dict[str, torch.Tensor] | None):
        side = {"token_types": batch.token_types, "attention_mask": batch.padding_mask}
        return batch.tokens, side, torch.cat([labels, batch.binary_labels[:, None].to(labels.dtype)], dim=1)

    def stage_forward(self, stage, x: torch.Tensor, token_types: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None):
        model = stage.model
        out = model(x, token_types=token_types, attention_mask=attention_mask, return_hidden=True)
        if not stage.is_last:
            return out
        weight = stage.tied_head if stage.tied_head is not None else model.output_weight()
        logits = parallel_logits(model.mlm_head.transform(out.hidden), weight, model)
        return (logits, out.binary_logits) if self.binary_head else logits

    def pipeline_outputs(self, micro_batch: int, seq: int, local_seq: int, vocab_local: int,
                         dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        meta = torch.device("meta")
        logits = torch.empty(micro_batch, seq, vocab_local, dtype=dtype, device=meta, requires_grad=True)
        if not self.binary_head:
            return (logits,)
        return logits, torch.empty(micro_batch, 2, dtype=dtype, device=meta, requires_grad=True)

    def loss(self, output, targets: torch.Tensor, ctx: LossContext) -> torch.Tensor:
        logits, binary = output if isinstance(output, (tuple, list)) else (output, None)
        labels, binary_labels = targets[:, :-1], targets[:, -1]
        counted = labels != IGNORE_INDEX
        per_token = vocab_parallel_cross_entropy(logits, labels.masked_fill(~counted, 0), ctx.tp_group)
        loss = (per_token * counted).sum() / counted.sum()
        if binary is not None:
            loss = loss + F.cross_entropy(binary.float(), binary_labels, ignore_index=IGNORE_INDEX)
        return loss / ctx.share
