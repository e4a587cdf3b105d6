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


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                             group_size: int) -> torch.Tensor:
    """Mamba-2's gated RMSNorm: x * silu(gate), normalised over each group of `group_size`
    channels (one group per Mamba group, so a tensor-parallel shard normalises its own groups),
    scaled by `weight`. Gate before norm (Megatron's norm_before_gate=False). In fp32, cast to
    x's dtype before the scale, as transformers' MambaRMSNormGated."""
    dtype = x.dtype
    h = x.float() * F.silu(gate.float())
    h = h.unflatten(-1, (-1, group_size))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.flatten(-2).to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Dispatch to the fused Triton kernel (forward and backward) or the reference.

    Under torch.compile the reference expression is returned: inductor writes its own fused
    kernel for it and also fuses the residual add and the casts around it, which an opaque
    custom op prevents (llama-160m bf16 training on an H100: 390k tokens/s against 361k with the
    custom op; benchmarks/RESULTS.md). Eager callers (inference, uncompiled training) get the
    Triton kernel.

    CPU (eager) keeps the reference. Measured and rejected (issue #18): F.rms_norm, which in
    torch 2.13 on CPU is ATen's `_fused_rms_norm`, a C++ composite of the same ops in the same
    order (bit-identical to the reference in fp32, 1 ulp off in bf16): alone 0.76x / 0.85x of the
    reference's time at llama-25m's [1, 8 / 64, 512], but 1.004x-1.009x of the whole decode
    forward (8 and 64 sequences, for this and `add_rms_norm`; thread CPU time, A/B alternating in
    one process, median of 60 pair ratios; an A/A run read 0.992x-0.996x).
    """
    if use_triton(x) and not torch.compiler.is_compiling():
        # Imported here so CPU-only installs without Triton never import it.
        from tessera.kernels.rmsnorm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
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
    write of [tokens, hidden]) and one launch in each direction.
    """
    if use_triton(x) and not torch.compiler.is_compiling():
        from tessera.kernels.rmsnorm_triton import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)
