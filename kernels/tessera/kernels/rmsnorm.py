"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32, cast back to x's dtype.

The reference matches Hugging Face's LlamaRMSNorm bit for bit in fp32 (normalise in fp32, cast
to the input dtype, then scale), which is what parity with exported models needs.
"""

from __future__ import annotations

import torch

from tessera.kernels._dispatch import use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Dispatch to the fused Triton kernel (forward and backward) or the reference."""
    if use_triton(x):
        # Imported here so CPU-only installs without Triton never import it.
        from tessera.kernels.rmsnorm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
