"""The training loss: mean next-token cross-entropy, a function of the output and the labels.

Kept apart from the model so a parallel layout can substitute a vocab-parallel version, and so
the model can hand over hidden states instead of logits.

`chunked_cross_entropy` is for large vocabularies: full logits for a micro-batch are
tokens x vocab fp32 values (8192 tokens x 128256 vocab = 4.2 GB), and the softmax backward
needs as much again. It takes the final hidden states and the output weight and, one chunk of
tokens at a time, computes the logits, the loss and at once their gradients (softmax minus
one-hot, then grad_hidden = g @ W and grad_W += g^T @ h), so only one chunk's logits ever exist
and nothing is recomputed: three head matmuls per chunk, as without chunking, where activation
checkpointing would take four. The gradients are held from forward to backward; since the head
is the last op of forward and the first of backward, that costs no extra peak memory (backward
would allocate them at once anyway).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.common.models.causal_lm.model import mask_vocab_padding
from tessera.kernels import cross_entropy_with_grad


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                       reduction: str = "mean") -> torch.Tensor:
    """Mean (or, reduction="sum", summed) cross-entropy over the non-ignored label positions; logits
    [B, T, V] in any dtype, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=ignore_index,
                           reduction=reduction)


def logsumexp_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                            reduction: str = "mean") -> torch.Tensor:
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
    total = torch.where(valid, per_token, 0.0).sum()
    # Like F.cross_entropy's mean with ignore_index: over the non-ignored positions (nan if none).
    return total if reduction == "sum" else total / valid.sum()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Head matmul + mean cross-entropy whose gradients are computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                chunk_tokens: int, ignore_index: int, compute_dtype: torch.dtype, mean: bool,
                vocab_size: int) -> torch.Tensor:
        # hidden [N, d], weight [V, d], labels [N]. Autocast is switched off in here and its choice
        # (compute_dtype) applied by hand: the matmuls run in it, softmax and loss in fp32 (or
        # fp64 for fp64 inputs), as F.linear under autocast followed by an fp32 cross-entropy would.
        with torch.autocast(hidden.device.type, enabled=False):
            acc = torch.promote_types(compute_dtype, torch.float32)  # softmax, loss, grad_W sums
            valid = labels != ignore_index
            inv_count = 1.0 / valid.sum().clamp(min=1).to(acc) if mean else torch.ones((), dtype=acc,
                                                                                        device=hidden.device)
            w = weight.to(compute_dtype)
            want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_hidden = torch.empty_like(hidden) if want_hidden else None
            grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_weight else None
            total = torch.zeros((), dtype=acc, device=hidden.device)
            for start in range(0, hidden.shape[0], chunk_tokens):
                h = hidden[start:start + chunk_tokens].to(compute_dtype)
                y = labels[start:start + chunk_tokens]
                # Sum of the valid rows' losses and d(it)/d(logits) = softmax - one-hot, zero on
                # ignored rows, times 1/count for the mean (on CUDA one Triton kernel, in place).
                # Padded vocabulary rows: -inf logits, so zero probability and zero gradient.
                chunk_loss, g = cross_entropy_with_grad(mask_vocab_padding(h @ w.t(), vocab_size), y, inv_count,
                                                        ignore_index)
                total += chunk_loss
                if grad_hidden is not None:
                    grad_hidden[start:start + chunk_tokens] = g @ w
                if grad_weight is not None:
                    grad_weight.add_(g.t() @ h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total * inv_count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                          ignore_index: int = -100, reduction: str = "mean",
                          vocab_size: int | None = None) -> torch.Tensor:
    """Same value as cross_entropy_loss(F.linear(hidden, weight), labels), chunk_tokens rows at a time.

    hidden [B, T, d] (final-normed), weight [V, d] (the output head), labels [B, T]. Under autocast
    the head matmuls run in the autocast dtype and the softmax in fp32, as in the unchunked path.
    Mean over non-ignored positions (reduction="sum": their sum); 0 (with zero gradients) when every
    label is ignored. Rows of `weight` from `vocab_size` on (vocabulary padding) get -inf logits, as
    the model's head gives them.
    """
    device_type = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    return _ChunkedLinearCrossEntropy.apply(hidden.flatten(0, 1), weight, labels.flatten(), chunk_tokens,
                                            ignore_index, compute_dtype, reduction == "mean",
                                            weight.shape[0] if vocab_size is None else vocab_size)
