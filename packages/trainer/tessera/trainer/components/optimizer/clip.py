"""Gradient clipping by global L2 norm.

The norm is returned (and logged) even when clipping is off. torch's clip_grad_norm_ computes
the norm over all gradients at once with foreach kernels; a parallel layout wraps this with the
reductions its sharding needs.
"""

from __future__ import annotations

import torch


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale gradients so their global norm is at most max_norm (0 = no clipping); return the norm before."""
    grads = [p for p in params if p.grad is not None]
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=True)
    return torch.nn.utils.get_total_norm([p.grad for p in grads], foreach=True)
