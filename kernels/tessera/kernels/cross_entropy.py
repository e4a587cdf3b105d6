"""Cross-entropy of one chunk of logits together with its gradient, for the chunked loss.

The trainer's `chunked_cross_entropy` (tessera.trainer.objectives.loss) owns the chunk loop: per chunk of
tokens it computes the head matmul, calls `cross_entropy_with_grad` on the chunk's logits, and
multiplies the returned gradient into grad_hidden and grad_weight. This module owns the step in
the middle:

    loss_sum = sum over valid rows of logsumexp(logits) - logits[label]
    grad     = (softmax(logits) - onehot(label)) * scale, zero on rows whose label is ignore_index

with softmax and loss in fp32 (fp64 for fp64 logits) and the gradient returned in the logits'
dtype. `logits` is consumed: its storage may hold the gradient afterwards.
"""

from __future__ import annotations

import torch

from tessera.kernels._dispatch import use_triton


def cross_entropy_with_grad_reference(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor,
                                      ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V], labels [n], scale 0-d (1/valid-count for a mean) -> (loss_sum, grad [n, V])."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    dtype = logits.dtype
    x = logits.to(acc)
    lse = torch.logsumexp(x, dim=1)
    hit = torch.arange(x.shape[1], device=x.device) == labels.unsqueeze(1)  # the one-hot target
    row_valid = (labels != ignore_index).to(acc)
    loss_sum = ((lse - torch.where(hit, x, 0.0).sum(dim=1)) * row_valid).sum()
    # softmax - one-hot, zero on ignored rows, times scale; built in place over the fp32 logits.
    g = x.sub_(lse.unsqueeze(1)).exp_().sub_(hit.to(acc))
    g.mul_((row_valid * scale).unsqueeze(1))
    return loss_sum, g.to(dtype)


def cross_entropy_with_grad(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor,
                            ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to the Triton kernel (CUDA, eager, fp32/bf16/fp16 logits) or the reference.

    The reference makes an fp32 copy of the chunk's logits, a boolean one-hot and several
    elementwise passes over [n, V]; the kernel reads the (bf16) logits twice (online max/sum,
    then softmax) and writes the gradient over them, with no [n, V] temporaries — so a chunk costs
    its bf16 logits only, and larger chunks fit.
    """
    if logits.dtype != torch.float64 and use_triton(logits) and not torch.compiler.is_compiling():
        from tessera.kernels.cross_entropy_triton import cross_entropy_with_grad_triton

        return cross_entropy_with_grad_triton(logits, labels, scale, ignore_index)
    return cross_entropy_with_grad_reference(logits, labels, scale, ignore_index)
