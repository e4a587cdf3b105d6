"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32, cast back to x's dtype.

The reference matches Hugging Face's LlamaRMSNorm bit for bit in fp32 (normalise in fp32, cast
to the input dtype, then scale), which is what parity with exported models needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.kernels._dispatch import use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _eager_fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's own rms_norm gives the reference's values here: on CPU (on CUDA it is
    another kernel), x and weight fp32 (for bf16 x and an fp32 weight its composite casts back to
    bf16 after the weight, where the reference promotes to fp32; bf16 x and weight differ from the
    reference in the last bit) and no autograd (its backward is another formula; training keeps
    the reference's)."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference` as one ATen call, for the eager CPU path (serving).

    torch 2.13's F.rms_norm on CPU is ATen's `_fused_rms_norm`, a C++ composite of the same ops in
    the same order (pow, mean, add eps, rsqrt, mul, cast, mul by weight): in fp32 bit-identical to
    the reference (tests/kernels/test_eager_cpu_paths.py), without five Python-level dispatches. Measured
    (issue #18; llama-25m's [1, 8 / 64, 512] fp32, 1 thread, A/B alternating in one process on
    the loaded 2-core CPU, ratio of medians): 0.74x / 0.85x of the reference's time.
    """
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Dispatch to the fused Triton kernel (forward and backward) or the reference.

    Under torch.compile the reference expression is returned: inductor writes its own fused
    kernel for it and also fuses the residual add and the casts around it, which an opaque
    custom op prevents (llama-160m bf16 training on an H100: 390k tokens/s against 361k with the
    custom op; benchmarks/RESULTS.md). Eager callers (inference, uncompiled training) get the
    Triton kernel; elsewhere (CPU) inference gets `rms_norm_eager`.
    """
    if torch.compiler.is_compiling():
        return rms_norm_reference(x, weight, eps)
    if use_triton(x):
        # Imported here so CPU-only installs without Triton never import it.
        from tessera.kernels.rmsnorm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    if _eager_fused(x, weight):
        return rms_norm_eager(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm block's `s = x + residual; n = norm(s)`: returns (s, n)."""
    s = x + residual
    return s, rms_norm_reference(s, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)), one Triton kernel each way on CUDA.

    Eager only, as `rms_norm`: under torch.compile inductor fuses the reference's add and norm
    itself. The kernel saves the add's separate pass over the residual stream (one read and one
    write of [tokens, hidden]) and one launch in each direction. Elsewhere (CPU) inference adds
    and calls `rms_norm_eager`.
    """
    if torch.compiler.is_compiling():
        return add_rms_norm_reference(x, residual, weight, eps)
    if use_triton(x):
        from tessera.kernels.rmsnorm_triton import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    if _eager_fused(x, weight) and not (torch.is_grad_enabled() and residual.requires_grad):
        s = x + residual
        return s, rms_norm_eager(s, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)
