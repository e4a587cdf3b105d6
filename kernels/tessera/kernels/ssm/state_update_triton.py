"""One decoding step of the SSM state in Triton (mamba_ssm's `selective_state_update`; our own
code), in place in a pool of states indexed by slot.

Per sequence i, slot = state_indices[i] (rows with a negative slot are padding: skipped, y = 0),
per head h: dt = clamp(softplus(dt + dt_bias)), S = S exp(dt A) + dt x B^T, y = S C + D x, then
y * silu(z) when z is given. One program per (sequence, head, block of head_dim rows); the state
is read and written once, in its own dtype, with fp32 arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _state_update_kernel(state_ptr, idx_ptr, x_ptr, dt_ptr, bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, y_ptr,
                         H, G, P, N, dt_min, dt_max, s_slot, s_head, s_p, s_n,
                         HAS_IDX: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                         HAS_LIMIT: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // (H // G)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm, nm = p < P, n < N
    if HAS_IDX:
        slot = tl.load(idx_ptr + i).to(tl.int64)
    else:
        slot = i
    live = (p * 0 + slot) >= 0  # as a vector: the interpreter rejects a scalar in a mask
    smask = (pm & live)[:, None] & nm[None, :]
    sp = state_ptr + tl.maximum(slot, 0) * s_slot + h * s_head + p[:, None] * s_p + n[None, :] * s_n
    S = tl.load(sp, mask=smask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + i * H + h).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + h).to(tl.float32)
    if SOFTPLUS:
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))
    x = tl.load(x_ptr + (i * H + h) * P + p, mask=pm, other=0.0).to(tl.float32)
    B = tl.load(B_ptr + (i * G + g) * N + n, mask=nm, other=0.0).to(tl.float32)
    C = tl.load(C_ptr + (i * G + g) * N + n, mask=nm, other=0.0).to(tl.float32)
    S = S * decay + (dt * x)[:, None] * B[None, :]
    tl.store(sp, S.to(state_ptr.dtype.element_ty), mask=smask)
    y = tl.sum(S * C[None, :], axis=1)
    if HAS_D:
        y += tl.load(D_ptr + h).to(tl.float32) * x
    if HAS_Z:
        z = tl.load(z_ptr + (i * H + h) * P + p, mask=pm, other=0.0).to(tl.float32)
        y = y * z * tl.sigmoid(z)
    tl.store(y_ptr + (i * H + h) * P + p, tl.where(live, y, 0.0), mask=pm)


def ssd_state_update_triton(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                            dt_limit=(0.0, float("inf")), state_indices=None):
    b, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    x, dt, B, C = x.contiguous(), dt.contiguous(), B.contiguous(), C.contiguous()
    z = z.contiguous() if z is not None else None
    y = torch.empty(b, H, P, device=x.device, dtype=torch.float32)
    if b == 0:
        return y
    block_n = triton.next_power_of_2(N)
    block_p = min(triton.next_power_of_2(P), max(1, 4096 // block_n))  # at most 4096 state values per program
    idx = state_indices.contiguous() if state_indices is not None else None
    _state_update_kernel[(b, H, triton.cdiv(P, block_p))](
        state, idx if idx is not None else x, x, dt, dt_bias if dt_bias is not None else A, A, B, C,
        D if D is not None else A, z if z is not None else x, y, H, G, P, N, float(dt_limit[0]), float(dt_limit[1]),
        *state.stride(), HAS_IDX=idx is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
        HAS_LIMIT=tuple(dt_limit) != (0.0, float("inf")), HAS_D=D is not None, HAS_Z=z is not None,
        BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4)
    return y
