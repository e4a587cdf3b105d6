"""The SSD chunked scan's forward in Triton, in the four steps of the Mamba-2 paper's algorithm
(as mamba_ssm decomposes `mamba_chunk_scan_combined`; this is our own code for it):

1. `_chunk_cumsum_kernel`: dt = clamp(softplus(dt + dt_bias)) per token, and the running sum of
   dt * A inside each chunk (the log of the decay from the chunk's start);
2. `_chunk_state_kernel`: what each chunk adds to the state at its end (its last document's tokens,
   decayed to the end): x^T (w * B), a [P, N] matmul per chunk and head;
3. `_state_passing_kernel`: the state entering each chunk, carried across chunks in order (reset
   where a document starts inside a chunk);
4. `_chunk_scan_fwd_kernel`: each token's output, the entering state's part C S^T plus the masked
   attention-like product inside the chunk, plus D x.

Semantics are `ssd_chunk_scan_reference`'s (tessera.kernels.ssd): fp32 states and outputs,
`seq_idx` resets, an initial state belonging to the first token's document. Layouts (all
contiguous): x [b, T, H, P], dt [b, T, H], B/C [b, T, G, N], seq [b, T] int32; per-chunk
tensors dt/cumsum [b, H, nc, L], states [b, nc, H, P, N]. The matmuls take fp32 operands (IEEE,
not TF32) for fp32 inputs and the inputs' dtype otherwise (see `dot_in_fp32`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessera.kernels._dispatch import interpret_mode


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """fp32 inputs: IEEE fp32 matmuls, to match the reference. bf16 under the interpreter: fp32 too,
    since the interpreter's tl.dot multiplies bf16 bit patterns (see docs/kernels.md)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpret_mode())


def tiles(chunk_size: int, head_dim: int, state_size: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes: rows of a chunk per program (at least 16, tl.dot's minimum; 32 rather than 64
    for fp32 operands, whose backward source kernel otherwise needs 161 KiB of shared memory at
    P = 64, N = 128, over what sm_80 gives a block), whole head_dim and state_size per program."""
    block_l = min(32 if dot_in_fp32(dtype) else 64, max(16, triton.next_power_of_2(chunk_size)))
    return dict(BLOCK_M=block_l, BLOCK_K=block_l, BLOCK_P=max(16, triton.next_power_of_2(head_dim)),
                BLOCK_N=max(16, triton.next_power_of_2(state_size)))


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr, DTYPE: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DTYPE), b.to(DTYPE))


@triton.jit
def _chunk_cumsum_kernel(dt_ptr, bias_ptr, A_ptr, dtp_ptr, cs_ptr, T, H, NC, dt_min, dt_max,
                         L: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                         HAS_LIMIT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr):
    bi = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    lo = tl.arange(0, BLOCK_L)
    t = c * L + lo
    hm = h < H
    mask = ((lo < L) & (t < T))[:, None] & hm[None, :]
    dt = tl.load(dt_ptr + (bi * T + t[:, None]) * H + h[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + h, mask=hm, other=0.0).to(tl.float32)[None, :]
    if SOFTPLUS:  # torch's softplus: linear above 20
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dt = tl.where(mask, dt, 0.0)  # padding tokens neither decay nor add
    A = tl.load(A_ptr + h, mask=hm, other=0.0).to(tl.float32)
    cs = tl.cumsum(dt * A[None, :], axis=0)
    out = ((bi * H + h[None, :]) * NC + c) * L + lo[:, None]
    omask = (lo < L)[:, None] & hm[None, :]
    tl.store(dtp_ptr + out, dt, mask=omask)
    tl.store(cs_ptr + out, cs, mask=omask)


@triton.jit
def _chunk_state_kernel(x_ptr, B_ptr, dtp_ptr, cs_ptr, seq_ptr, st_ptr, T, H, G, NC,
                        P: tl.constexpr, N: tl.constexpr, L: tl.constexpr, HAS_SEQ: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT_FP32: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    bi, c = pid // NC, pid % NC
    h = tl.program_id(1)
    g = h // (H // G)
    p, n = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    chunk_len = tl.minimum(L, T - c * L)
    cs_base = ((bi * H + h) * NC + c) * L
    cs_last = tl.load(cs_ptr + cs_base + L - 1)
    if HAS_SEQ:
        seq_last = tl.load(seq_ptr + bi * T + c * L + chunk_len - 1)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, chunk_len, BLOCK_K):
        s = k0 + tl.arange(0, BLOCK_K)
        sm = s < chunk_len
        t = c * L + s
        xs = tl.load(x_ptr + ((bi * T + t[:, None]) * H + h) * P + p[None, :],
                     mask=sm[:, None] & (p < P)[None, :], other=0.0)
        Bs = tl.load(B_ptr + ((bi * T + t[:, None]) * G + g) * N + n[None, :],
                     mask=sm[:, None] & (n < N)[None, :], other=0.0)
        cs_s = tl.load(cs_ptr + cs_base + s, mask=sm, other=0.0)
        w = tl.exp(cs_last - cs_s) * tl.load(dtp_ptr + cs_base + s, mask=sm, other=0.0)
        if HAS_SEQ:
            w = tl.where(tl.load(seq_ptr + bi * T + t, mask=sm, other=-1) == seq_last, w, 0.0)
        w = tl.where(sm, w, 0.0)
        acc += _dot(tl.trans(xs.to(tl.float32) * w[:, None]), Bs, DOT_FP32, x_ptr.dtype.element_ty)
    out = (((bi * NC + c) * H + h) * P + p[:, None]) * N + n[None, :]
    tl.store(st_ptr + out, acc, mask=(p < P)[:, None] & (n < N)[None, :])


@triton.jit
def _state_passing_kernel(st_ptr, cs_ptr, seq_ptr, init_ptr, sin_ptr, final_ptr, T, H, NC,
                          PN: tl.constexpr, L: tl.constexpr, HAS_INIT: tl.constexpr,
                          HAS_SEQ: tl.constexpr, BLOCK: tl.constexpr):
    bi = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    m = offs < PN
    if HAS_INIT:
        s = tl.load(init_ptr + (bi * H + h) * PN + offs, mask=m, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_SEQ:
        prev = tl.load(seq_ptr + bi * T)  # the initial state belongs to the first token's document
    for c in range(NC):
        tl.store(sin_ptr + ((bi * NC + c) * H + h) * PN + offs, s, mask=m)
        decay = tl.exp(tl.load(cs_ptr + ((bi * H + h) * NC + c) * L + L - 1))
        if HAS_SEQ:
            last = tl.load(seq_ptr + bi * T + tl.minimum((c + 1) * L, T) - 1)
            decay = tl.where(last == prev, decay, 0.0)
            prev = last
        s = s * decay + tl.load(st_ptr + ((bi * NC + c) * H + h) * PN + offs, mask=m, other=0.0)
    tl.store(final_ptr + (bi * H + h) * PN + offs, s, mask=m)


@triton.jit
def _chunk_scan_fwd_kernel(x_ptr, B_ptr, C_ptr, dtp_ptr, cs_ptr, seq_ptr, sin_ptr, D_ptr, y_ptr,
                           T, H, G, NC, P: tl.constexpr, N: tl.constexpr, L: tl.constexpr,
                           HAS_SEQ: tl.constexpr, HAS_D: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                           DOT_FP32: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    bi, c = pid // NC, pid % NC
    h = tl.program_id(1)
    g = h // (H // G)
    DTYPE = x_ptr.dtype.element_ty
    p, n = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    pm, nm = p < P, n < N
    chunk_len = tl.minimum(L, T - c * L)
    cs_base = ((bi * H + h) * NC + c) * L
    lo = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    lm = lo < chunk_len
    t_l = c * L + lo
    cs_l = tl.load(cs_ptr + cs_base + lo, mask=lm, other=0.0)
    C_l = tl.load(C_ptr + ((bi * T + t_l[:, None]) * G + g) * N + n[None, :], mask=lm[:, None] & nm[None, :],
                  other=0.0)
    S = tl.load(sin_ptr + (((bi * NC + c) * H + h) * P + p[:, None]) * N + n[None, :],
                mask=pm[:, None] & nm[None, :], other=0.0)
    e = tl.exp(cs_l)
    if HAS_SEQ:
        seq_l = tl.load(seq_ptr + bi * T + t_l, mask=lm, other=-1)
        entering = tl.load(seq_ptr + bi * T + tl.maximum(c * L - 1, 0))
        e = tl.where(seq_l == entering, e, 0.0)
    acc = _dot(C_l, tl.trans(S), DOT_FP32, DTYPE) * e[:, None]  # [BLOCK_M, BLOCK_P]
    hi = tl.minimum(chunk_len, (tl.program_id(2) + 1) * BLOCK_M)
    for k0 in range(0, hi, BLOCK_K):
        s = k0 + tl.arange(0, BLOCK_K)
        sm = s < chunk_len
        t_s = c * L + s
        B_s = tl.load(B_ptr + ((bi * T + t_s[:, None]) * G + g) * N + n[None, :], mask=sm[:, None] & nm[None, :],
                      other=0.0)
        x_s = tl.load(x_ptr + ((bi * T + t_s[:, None]) * H + h) * P + p[None, :], mask=sm[:, None] & pm[None, :],
                      other=0.0)
        cs_s = tl.load(cs_ptr + cs_base + s, mask=sm, other=0.0)
        dt_s = tl.load(dtp_ptr + cs_base + s, mask=sm, other=0.0)
        keep = (s[None, :] <= lo[:, None]) & sm[None, :] & lm[:, None]
        if HAS_SEQ:
            keep = keep & (tl.load(seq_ptr + bi * T + t_s, mask=sm, other=-2)[None, :] == seq_l[:, None])
        decay = tl.exp(tl.where(keep, cs_l[:, None] - cs_s[None, :], float("-inf")))
        scores = _dot(C_l, tl.trans(B_s), DOT_FP32, DTYPE) * decay * dt_s[None, :]
        acc += _dot(scores, x_s, DOT_FP32, DTYPE)
    x_l = tl.load(x_ptr + ((bi * T + t_l[:, None]) * H + h) * P + p[None, :], mask=lm[:, None] & pm[None, :],
                  other=0.0).to(tl.float32)
    if HAS_D:
        acc += tl.load(D_ptr + h).to(tl.float32) * x_l
    tl.store(y_ptr + ((bi * T + t_l[:, None]) * H + h) * P + p[None, :], acc, mask=lm[:, None] & pm[None, :])


def chunk_cumsum(dt, dt_bias, A, chunk_size, softplus, dt_limit):
    """(dt after bias/softplus/limits, its running sum times A), both [b, H, nc, L] fp32."""
    b, T, H = dt.shape
    nc = triton.cdiv(T, chunk_size)
    dtp = torch.empty(b, H, nc, chunk_size, device=dt.device, dtype=torch.float32)
    cs = torch.empty_like(dtp)
    block_h = min(16, triton.next_power_of_2(H))
    has_limit = dt_limit != (0.0, float("inf"))
    _chunk_cumsum_kernel[(b, nc, triton.cdiv(H, block_h))](
        dt, dt_bias if dt_bias is not None else A, A, dtp, cs, T, H, nc, float(dt_limit[0]), float(dt_limit[1]),
        L=chunk_size, HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus, HAS_LIMIT=has_limit,
        BLOCK_L=triton.next_power_of_2(chunk_size), BLOCK_H=block_h)
    return dtp, cs


def states_entering_chunks(x, B, dtp, cs, seq, initial_state):
    """(the state entering each chunk [b, nc, H, P, N], the final state [b, H, P, N]), fp32."""
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    nc, L = dtp.shape[2], dtp.shape[3]
    t = tiles(L, P, N, x.dtype)
    chunk_states = torch.empty(b, nc, H, P, N, device=x.device, dtype=torch.float32)
    _chunk_state_kernel[(b * nc, H)](
        x, B, dtp, cs, seq if seq is not None else cs, chunk_states, T, H, G, nc, P=P, N=N, L=L,
        HAS_SEQ=seq is not None, BLOCK_K=t["BLOCK_K"], BLOCK_P=t["BLOCK_P"], BLOCK_N=t["BLOCK_N"],
        DOT_FP32=dot_in_fp32(x.dtype), num_warps=4)
    states_in = torch.empty_like(chunk_states)
    final = torch.empty(b, H, P, N, device=x.device, dtype=torch.float32)
    block = min(1024, triton.next_power_of_2(P * N))
    _state_passing_kernel[(b, H, triton.cdiv(P * N, block))](
        chunk_states, cs, seq if seq is not None else cs, initial_state if initial_state is not None else cs,
        states_in, final, T, H, nc, PN=P * N, L=L, HAS_INIT=initial_state is not None, HAS_SEQ=seq is not None,
        BLOCK=block, num_warps=4)
    return states_in, final


def chunk_scan_fwd(x, B, C, dtp, cs, seq, states_in, D):
    """y [b, T, H, P] fp32."""
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    nc, L = dtp.shape[2], dtp.shape[3]
    t = tiles(L, P, N, x.dtype)
    y = torch.empty(b, T, H, P, device=x.device, dtype=torch.float32)
    _chunk_scan_fwd_kernel[(b * nc, H, triton.cdiv(L, t["BLOCK_M"]))](
        x, B, C, dtp, cs, seq if seq is not None else cs, states_in, D if D is not None else cs, y,
        T, H, G, nc, P=P, N=N, L=L, HAS_SEQ=seq is not None, HAS_D=D is not None,
        DOT_FP32=dot_in_fp32(x.dtype), num_warps=4, **t)
    return y
