"""The training loss: mean next-token cross-entropy, a function of the output and the labels.

Kept apart from the model so a parallel layout can substitute a vocab-parallel version, and so
the model can hand over hidden states instead of logits.

`chunked_cross_entropy` is for large vocabularies: full logits for a micro-batch are
tokens x vocab fp32 values (8192 tokens x 128256 vocab = 4.2 GB), and the softmax backward
needs as much again. It takes the final hidden states and the output weight, computes logits
and loss for one chunk of tokens at a time under activation checkpointing, so only one chunk's
logits exist at once, in forward and in backward (which recomputes them: one extra head matmul).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over all label positions; logits [B, T, V] in any dtype, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=ignore_index)


def logsumexp_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Same value as cross_entropy_loss, written as mean(logsumexp(logits) - logits[label]).

    For torch.compile: inductor lowers F.cross_entropy through log_softmax + nll_loss. Here the
    target logit is picked with a comparison against the vocabulary index instead of a gather, so
    forward is row reductions over the logits and backward one elementwise pass (softmax minus the
    one-hot), with no scatter into a fresh tokens x vocab buffer (a gather's backward). Compiled
    head + loss (1024 tokens x 256 -> 8192 vocab, forward + backward, 2 CPU threads): 95-97 ms vs
    105-107 ms for compiled F.cross_entropy, same page faults. The value differs from
    F.cross_entropy only by float reassociation (gradients ~1e-11 apart). Eager, prefer
    cross_entropy_loss (one fused aten kernel).
    """
    x = logits.flatten(0, 1).float()
    y = labels.flatten()
    hit = torch.arange(x.shape[1], device=x.device) == y.unsqueeze(1)  # no vocab index equals ignore_index
    target = torch.where(hit, x, 0.0).sum(dim=1)
    per_token = torch.logsumexp(x, dim=1) - target
    valid = y != ignore_index
    # Like F.cross_entropy's mean with ignore_index: over the non-ignored positions (nan if none).
    return torch.where(valid, per_token, 0.0).sum() / valid.sum()


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                          ignore_index: int = -100) -> torch.Tensor:
    """Same value as cross_entropy_loss(F.linear(hidden, weight), labels), chunk_tokens rows at a time.

    hidden [B, T, d] (final-normed), weight [V, d] (the output head), labels [B, T].
    """
    h = hidden.flatten(0, 1)
    y = labels.flatten()
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(_chunk_loss_sum, h[start:end], weight, y[start:end], ignore_index,
                                   use_reentrant=False)
    count = (y != ignore_index).sum().clamp(min=1)
    return total / count
