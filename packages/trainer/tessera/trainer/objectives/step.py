"""The one-process training step: forward + loss, backward, unscale/clip, optimizer step.

One object, used by `Trainer.train_step` and by benchmarks/train_throughput.py, so the benchmark
measures the trainer's real step.

Compilation (`compile`) has two scopes. "model": the forward *and the loss* are one torch.compile
graph. "blocks" (regional compilation, torchtitan's and PyTorch's recipe): each transformer block's
forward is compiled in place (components.model_setup.compile_blocks: identical blocks share one
compiled graph, so compile time does not grow with depth), the final norm is compiled as one more
region, and the output head and the loss are one graph. Either way inductor fuses the output
head's cross-entropy (log-softmax and gather, and in backward softmax minus one-hot) into single
passes over the logits, instead of eager log_softmax + nll_loss that write and re-read the
tokens x vocab fp32 logits several times (about 25 ms of a 300 ms step on 2 CPU cores at vocab
8192, 1024 tokens per step).

On CPU the compiled graph's loss is written as logsumexp minus the target logit, the target
picked by comparing against the vocabulary index (`loss.logsumexp_cross_entropy`, the same value as
F.cross_entropy up to float reassociation): inductor compiles F.cross_entropy through
log_softmax + nll_loss; in this form head + loss forward and backward went from 105-107 ms to
95-97 ms on 2 CPU cores (1024 tokens, vocab 8192).

Tried and not kept: handing the clip coefficient to the fused AdamW as its `grad_scale` instead
of a separate multiply over the gradients. The multiply it removes is 0.8 ms of that 300 ms step
(profiler), and dividing by 1/coefficient differs from multiplying by it by an ulp, enough to push
the torchrun-vs-one-process weight comparison (tests/trainer/test_e2e.py) past its tolerance.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tessera.trainer.components.model_setup import CompileScope, compile_blocks
from tessera.trainer.components.optimizer.clip import clip_grad_norm
from tessera.trainer.components.precision.mixed import Precision
from tessera.trainer.objectives.documents import DocumentMasking, loss_token_count
from tessera.trainer.objectives.loss import chunked_cross_entropy, cross_entropy_loss, logsumexp_cross_entropy


def compile_scope(compile: bool | CompileScope) -> CompileScope | None:
    """`compile` as a scope: None (eager), "model" or "blocks" (True: training.compile_scope's default)."""
    scope = "blocks" if compile is True else compile or None
    if scope not in (None, "blocks", "model"):
        raise ValueError(f"unknown compile scope {compile!r}")
    return scope


class TrainStep:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, grad_clip: float,
                 loss_chunk_tokens: int | None = None, compile: bool | CompileScope = False,
                 documents: DocumentMasking | None = None):
        """`compile`: False (eager), "model", "blocks", or True (= "blocks", training.compile_scope's default)."""
        self.model = model
        # Packed-document options: positions / document ids for the forward, and (eod_mask_loss)
        # a loss averaged over the counted tokens of the whole batch.
        self.documents = documents
        self.per_token_loss = documents is not None and documents.per_token_loss
        self.optimizer = optimizer
        self.precision = precision
        self.grad_clip = grad_clip
        self.loss_chunk_tokens = loss_chunk_tokens
        self.params = [p for p in model.parameters() if p.requires_grad]
        scope = compile_scope(compile)
        on_cpu = next(model.parameters()).device.type == "cpu"
        # On CPU the compiled graph takes the loss in logsumexp form (loss.py); on GPUs, where the
        # recorded figures use F.cross_entropy and this form was not measured, it keeps that.
        self._head_loss = logsumexp_cross_entropy if on_cpu and scope else cross_entropy_loss
        self._loss = self._full_loss
        self._hidden = self._final_hidden
        if scope == "blocks":
            compile_blocks(model)
            if getattr(model, "final_norm", None) is not None:
                model.final_norm.compile()
            # The head and its loss stay one graph; the chunked loss takes its own gradients chunk by
            # chunk (loss.py), so it runs as it is over the compiled blocks' output.
            self._loss = self._regional_loss
            self._logits_loss = torch.compile(self._logits_loss)
        elif scope == "model":
            if loss_chunk_tokens is None:
                self._loss = torch.compile(self._full_loss)
            else:  # only the model forward is compiled (the chunked loss, as above)
                self._hidden = torch.compile(self._final_hidden)

    def _full_loss(self, inputs: torch.Tensor, labels: torch.Tensor, model_inputs: dict,
                   reduction: str) -> torch.Tensor:
        return self._head_loss(self.model(inputs, **model_inputs), labels, reduction=reduction)

    def _regional_loss(self, inputs: torch.Tensor, labels: torch.Tensor, model_inputs: dict,
                       reduction: str) -> torch.Tensor:
        return self._logits_loss(self._final_hidden(inputs, model_inputs), labels, reduction)

    def _logits_loss(self, hidden: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
        return self._head_loss(self.model.logits(hidden), labels, reduction=reduction)

    def _final_hidden(self, inputs: torch.Tensor, model_inputs: dict) -> torch.Tensor:
        return self.model(inputs, return_hidden=True, **model_inputs)

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Forward (under the precision's autocast) and cross-entropy over the labels that count: their
        mean, or (reduction="sum") their sum, which is 0 with zero gradients when none count. Chunked
        when configured."""
        model_inputs = self.documents.model_inputs(inputs) if self.documents is not None else {}
        if getattr(self.model, "mtp", None) is not None and self.model.training:
            model_inputs = {**model_inputs, "mtp_labels": labels}  # the MTP depths' loss (model.py)
        with self.precision.autocast():
            if self.loss_chunk_tokens is None:
                return self._loss(inputs, labels, model_inputs, reduction)
            return chunked_cross_entropy(self._hidden(inputs, model_inputs), self.model.output_weight(), labels,
                                         self.loss_chunk_tokens, reduction=reduction,
                                         vocab_size=self.model.cfg.vocab_size)

    def __call__(self, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]], num_micro_batches: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Accumulate gradients over the micro-batches, then clip and step.

        Returns (mean loss, gradient norm before clipping, whether the step was taken: False only
        when fp16 gradients overflowed). Loss and norm stay tensors so the caller decides when to sync.
        """
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        if self.per_token_loss:
            # Counted on the host before the copy, so no device sync: each micro-batch contributes its
            # summed token loss over the batch's count, which adds up to the global per-token mean (a
            # micro-batch without counted tokens contributes 0 and zero gradients, as in parallel runs).
            micro_batches = list(micro_batches)
            total = max(sum(int(loss_token_count(labels)) for _, labels in micro_batches), 1)
        for inputs, labels in micro_batches:
            inputs, labels = inputs.to(device), labels.to(device)
            if self.per_token_loss:
                loss = self.loss(inputs, labels, reduction="sum") / total
            else:
                # Equal token counts per micro-batch: the mean of means is the global mean.
                loss = self.loss(inputs, labels) / num_micro_batches
            self.precision.scale(loss).backward()
            loss_sum += loss.detach()
        grad_norm, stepped = self.clip_and_step()
        return loss_sum, grad_norm, stepped

    def clip_and_step(self) -> tuple[torch.Tensor, bool]:
        """Unscale (fp16), clip, step (skipped on fp16 overflow); returns (norm before clipping, stepped)."""
        self.precision.unscale_(self.optimizer)
        grad_norm = clip_grad_norm(self.params, self.grad_clip)
        return grad_norm, self.precision.step(self.optimizer)
