"""Rotary position embeddings in the rotate-half layout (Hugging Face Llama), applied to q and k.

    rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
    rope(x)        = (x.float() * cos + rotate_half(x).float() * sin).to(x.dtype)

cos/sin are the model's precomputed fp32 tables (`RotaryEmbedding`, Llama-3 frequency scaling
already applied), indexed by position: [B or 1, T, 1, D], each frequency repeated in both halves.
The rotation is computed in fp32 and rounded once to x's dtype.
"""

from __future__ import annotations

import weakref

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


# The last sin table's signed copy (see `rope_qk_eager`): (weak reference to the table, the copy).
# Every layer of a forward gets the same table object, made for that forward (RotaryEmbedding) and
# never written, so the copy is made once a step. (Inference tensors have no version counter to
# check.)
_signed_sin: tuple[weakref.ref, torch.Tensor] | None = None


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half's minus sign, folded into the table."""
    global _signed_sin
    cached = _signed_sin
    if cached is not None and cached[0]() is sin:
        return cached[1]
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    _signed_sin = (weakref.ref(sin), signed)
    return signed


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [B, T, Hq + Hkv, D] view when k's heads follow q's in memory (slices of the
    serving engine's stacked q/k/v GEMM output: tessera.inference.merged_linear), else None."""
    if (q.dtype != k.dtype or q.shape[:2] != k.shape[:2] or q.stride() != k.stride() or q.stride(-1) != 1
            or q.stride(2) != q.shape[3] or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
            or k.storage_offset() != q.storage_offset() + q.shape[2] * q.stride(2)):
        return None
    return q.as_strided((*q.shape[:2], q.shape[2] + k.shape[2], q.shape[3]), q.stride(), q.storage_offset())


def rope_qk_eager(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_qk_reference` in fewer eager ops, for fp32 q/k without autograd (CPU serving); equal to
    the reference bit for bit (tests/kernels/test_eager_cpu_paths.py).

    rotate_half(x) * sin is roll(x, D/2) * sin with the first half of sin negated (a sign flip
    is exact; the signed table is made once per step), and when k's heads follow q's in memory
    both are rotated as one tensor: 4 kernels (roll, 2 muls, add) for q and k together in place
    of the reference's 2 x 5 (neg, cat, 2 muls, add) and their slices and no-op casts.
    torch.addcmul for the last mul and add was rejected: its fused multiply-add rounds once where
    the reference rounds twice (results differ by 1 ulp), for 0.90-0.97x of this path's time; and
    flip of x as [.., 2, D/2] for the roll: the same values, 1.6x-3x the roll's time.
    Measured (issue #18; llama-25m's q/k, 8 / 2 heads of 64, as slices of the q/k/v GEMM output,
    8 / 32 / 64 tokens, 1 thread, A/B alternating in one process on the loaded 2-core CPU, ratio of
    medians): 0.62x / 0.64x / 0.49x of the reference's time (with flip in place of the roll 0.57x /
    0.71x / 0.82x, and q and k rotated apart 0.61x-0.83x).
    """
    sin = _signed(sin)
    qk = _adjacent_heads(q, k)
    if qk is None:
        return _rotate(q, cos, sin), _rotate(k, cos, sin)
    out = _rotate(qk, cos, sin)
    return out[:, :, :q.shape[2]], out[:, :, q.shape[2]:]


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [B, T, Hq, D] and k [B, T, Hkv, D] with cos, sin [B or 1, T, 1, D].

    On CUDA (eager) one Triton kernel rotates both, reading each token's cos/sin once, in place of
    the reference's ~8 elementwise kernels and their fp32 temporaries per tensor; its backward is
    the inverse rotation, saving only cos/sin. Under torch.compile the reference is returned for
    inductor to fuse. On CPU fp32 q/k that need no gradient (serving) take `rope_qk_eager`,
    the reference's values in fewer ops; training keeps the reference (and its autograd graph).
    """
    if torch.compiler.is_compiling():
        return rope_qk_reference(q, k, cos, sin)
    if use_triton(q):
        from tessera.kernels.rope_triton import rope_qk_triton

        return rope_qk_triton(q, k, cos, sin)
    if (q.device.type == "cpu" and q.dtype == k.dtype == cos.dtype == sin.dtype == torch.float32
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))):
        return rope_qk_eager(q, k, cos, sin)
    return rope_qk_reference(q, k, cos, sin)
