"""RoPE on q and k in one Triton kernel: forward and backward (the inverse rotation).

Semantics are those of `rope_qk_reference` (rotate-half layout, fp32 arithmetic, one rounding to
the input's dtype). With x = [x1, x2] split into halves and cos = [c1, c2], sin = [s1, s2]:
    forward:  o1 = x1 c1 - x2 s1          o2 = x2 c2 + x1 s2
    backward: d1 = g1 c1 + g2 s2          d2 = g2 c2 - g1 s1     (the transpose of the forward)
The rotation is linear in x, so the backward needs only cos/sin: nothing per token is saved.
One program per token: it loads the token's cos/sin once and rotates every q head and k head.
Registered as the torch custom op tessera::rope_qk (its `backward` flag selects the transpose,
which is also its gradient), with a fake-tensor rule, so torch.compile sees one opaque op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, o_ptr, stride_xh, n_heads, c1, c2, s1, s2, half,
                  BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (cols < half)
    x_lo = x_ptr + heads * stride_xh + cols
    x1 = tl.load(x_lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_lo + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    o_lo = o_ptr + heads * (2 * half) + cols
    tl.store(o_lo, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_lo + half, o2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_qk_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
    seq_len, half, n_q_heads, n_k_heads,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_cb, stride_ct,
    BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0)
    b = token // seq_len
    t = token % seq_len
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cmask = cols < half
    c_lo = cos_ptr + b * stride_cb + t * stride_ct + cols
    s_lo = sin_ptr + b * stride_cb + t * stride_ct + cols
    c1 = tl.load(c_lo, mask=cmask, other=0.0).to(tl.float32)
    c2 = tl.load(c_lo + half, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(s_lo, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(s_lo + half, mask=cmask, other=0.0).to(tl.float32)
    # Outputs are contiguous [B, T, H, D].
    _rotate_heads(q_ptr + b * stride_qb + t * stride_qt, qo_ptr + token * n_q_heads * 2 * half,
                  stride_qh, n_q_heads, c1, c2, s1, s2, half, BACKWARD, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + b * stride_kb + t * stride_kt, ko_ptr + token * n_k_heads * 2 * half,
                  stride_kh, n_k_heads, c1, c2, s1, s2, half, BACKWARD, BLOCK_HK, BLOCK_HALF)


def _table_strides(table: torch.Tensor, batch: int, seq: int, head_dim: int) -> tuple[int, int]:
    if table.dim() != 4 or table.shape[0] not in (1, batch) or table.shape[1:] != (seq, 1, head_dim):
        raise ValueError(f"rope: cos/sin must be [1 or {batch}, {seq}, 1, {head_dim}], got {tuple(table.shape)}")
    return (0 if table.shape[0] == 1 else table.stride(0)), table.stride(1)


@torch.library.custom_op("tessera::rope_qk", mutates_args=())
def _rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (or, backward=True, inverse-rotated) q and k, contiguous, in their own dtypes."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    batch, seq, n_q, head_dim = q.shape
    n_k = k.shape[2]
    stride_cb, stride_ct = _table_strides(cos, batch, seq, head_dim)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    half = head_dim // 2
    if batch * seq > 0:
        block_hq, block_hk = triton.next_power_of_2(n_q), triton.next_power_of_2(n_k)
        _rope_qk_kernel[(batch * seq,)](
            q, k, cos, sin, q_out, k_out,
            seq, half, n_q, n_k,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), stride_cb, stride_ct,
            BACKWARD=backward, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=triton.next_power_of_2(half),
            num_warps=4 if block_hq * half >= 2048 else 2,
        )
    return q_out, k_out


@_rope_qk.register_fake
def _(q, k, cos, sin, backward):
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    _q, _k, cos, sin, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward = backward


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq, dk = torch.ops.tessera.rope_qk(dq, dk, cos, sin, not ctx.backward)
    return (dq if ctx.needs_input_grad[0] else None), (dk if ctx.needs_input_grad[1] else None), None, None, None


_rope_qk.register_autograd(_backward, setup_context=_setup_context)


def rope_qk_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, Hq, D], k [B, T, Hkv, D], cos/sin [B or 1, T, 1, D] (fp32) -> rotated (q, k)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[3] % 2:
        raise ValueError(f"rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be [B, T, H, D] with even D")
    if cos.shape != sin.shape:
        raise ValueError(f"rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    return torch.ops.tessera.rope_qk(q, k, cos, sin, False)
