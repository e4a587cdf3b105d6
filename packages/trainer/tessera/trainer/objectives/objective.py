"""How a model kind's training objective plugs into the parallel runtime (ParallelRuntime).

The runtime owns micro-batches, the pipeline schedule, the data/context-parallel reductions and
the optimizer; what a batch holds, what each pipeline stage computes from it and the loss are the
objective's. A kind plugs in by giving, under its `train_loss` hook name (tessera.trainer.objectives.registry
OBJECTIVES), a class with:

* `split(batch, labels, model_inputs) -> (first, side, targets)`: the batch as the loop reads it
  (a token tensor or the kind's batch type; [rows, ...]) cut into what enters the first stage
  (a tensor), the side inputs every stage's forward takes as keyword arguments (dict of tensors,
  [rows, ...]: padding masks, token types, positions) and the targets the last stage's loss reads
  (one tensor, [rows, ...], so the pipeline schedule can cut it into micro-batches);
* `stage_forward(stage, x, **side)` (optional): one chunk's forward (a StageModule, `stage.model`
  the cut model); hidden states out of every stage but the last, the last's output for `loss`.
  Without it StageModule.forward is the decoder's (tokens/hidden in, local-vocab logits out).
  Everything with parameters runs here, not in `loss`: FSDP gathers a chunk's weights only
  around its forward;
* `loss(output, targets, ctx) -> scalar`: one micro-batch's share of the batch loss on the last
  stage, from local-vocabulary logits (the head is vocab-split under tensor parallel:
  tessera.common.parallel.loss.vocab_parallel_cross_entropy); `ctx` is a LossContext;
* `pipeline_outputs(micro_batch, seq, local_seq, vocab_local, dtype) -> tuple of meta tensors`
  (optional): the last stage's output shapes under a pipeline schedule (default: logits
  [micro, seq, V/tp]); `pipeline = False` refuses pipeline parallel for the objective;
* `prepare_model(model) -> model` (optional): the plain model before the stage cut, e.g. weights
  the objective never reads stop requiring gradients (the flat-buffer optimizers would decay them).
  One process applies it too (tessera.trainer.components.model_setup.prepare_model, given it by LocalEngine), so both leave the same
  weights out of the optimizer and of `params_norm`.

`NextToken` below is the causal LM's (and hybrid's) objective, exactly what the runtime computed
before objectives existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.common.parallel.loss import vocab_parallel_cross_entropy
from tessera.trainer.objectives.documents import IGNORE_INDEX


@dataclass
class LossContext:
    """What a micro-batch's loss needs from the runtime."""

    tp_group: dist.ProcessGroup | None
    share: int  # micro-batches x context ranks: a micro-batch mean / share is its part of the batch mean
    per_token_loss: bool  # the batch loss is the mean over all counted tokens of the global batch
    token_weight: float  # per_token_loss: dp_ep / counted tokens of the global batch
    cp_group: dist.ProcessGroup | None = None  # context parallel (C > 1): the ranks sharing the micro-batch


class NextToken:
    """Next-token cross-entropy: tokens in, labels [rows, T] as targets, positions / document ids
    of packed documents as side inputs."""

    pipeline = True

    def __init__(self, cfg=None) -> None:
        pass

    def split(self, tokens: torch.Tensor, labels: torch.Tensor, model_inputs: dict[str, torch.Tensor] | None):
        return tokens, dict(model_inputs or {}), labels

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, ctx: LossContext) -> torch.Tensor:
        if not ctx.per_token_loss:
            # Under context parallel each rank's mean covers 1/C of the tokens: its share is mean / C.
            return vocab_parallel_cross_entropy(logits, targets, ctx.tp_group).mean() / ctx.share
        counted = targets != IGNORE_INDEX
        # Ignored positions get a valid id (their loss is zeroed, so their gradient is zero too).
        per_token = vocab_parallel_cross_entropy(logits, targets.masked_fill(~counted, 0), ctx.tp_group)
        return (per_token * counted).sum() * ctx.token_weight
