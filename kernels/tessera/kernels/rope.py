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
    """
    if use_triton(q) and not torch.compiler.is_compiling():
        from tessera.kernels.rope_triton import rope_qk_triton

        return rope_qk_triton(q, k, cos, sin)
    return rope_qk_reference(q, k, cos, sin)
