"""Rotary position embeddings in the rotate-half layout (Hugging Face Llama), applied to q and k.

    rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
    rope(x)        = (x.float() * cos + rotate_half(x).float() * sin).to(x.dtype)

cos/sin are the model's precomputed fp32 tables (`RotaryEmbedding`, Llama-3 frequency scaling
already applied), indexed by position: [B or 1, T, 1, D], each frequency repeated in both halves.
The rotation is computed in fp32 and rounded once to x's dtype.
"""

from __future__ import annotations

import torch

from tessera.kernels._dispatch import use_triton


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference, for one tensor: x [B, T, H, D]; cos, sin broadcastable to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rope_qk_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [B, T, Hq, D] and k [B, T, Hkv, D] with cos, sin [B or 1, T, 1, D].

    On CUDA (eager) one Triton kernel rotates both, reading each token's cos/sin once, in place of
    the reference's ~8 elementwise kernels and their fp32 temporaries per tensor; its backward is
    the inverse rotation, saving only cos/sin. Under torch.compile the reference is returned for
    inductor to fuse.

    CPU (eager) keeps the reference. Measured and rejected (issue #18): a bit-identical fast path,
    rotate_half(x) * sin as x.roll(D/2) * sin with sin's first half negated (the signed table made
    once per forward), with q and k rotated as one tensor when k's heads follow q's in memory (the
    serving engine's stacked q/k/v GEMM output): alone 0.62x / 0.64x / 0.71x of the reference's
    time at 8 / 32 / 64 tokens (llama-25m's 8 / 2 heads of 64), but 0.999x-1.005x of the whole
    decode forward (8 and 64 sequences, thread CPU time, A/B alternating in one process, median of
    60 pair ratios; an A/A run read 0.992x-0.996x): ~90 us a step saved is below what that
    measures, and it cost a module-level table cache and a strided-view check. torch.addcmul for
    the last mul and add rounds once where the reference rounds twice (1 ulp off); flip of a
    [.., 2, D/2] view in place of the roll was 1.6x-3x the roll's time.
    """
    if use_triton(q) and not torch.compiler.is_compiling():
        from tessera.kernels.rope_triton import rope_qk_triton

        return rope_qk_triton(q, k, cos, sin)
    return rope_qk_reference(q, k, cos, sin)
