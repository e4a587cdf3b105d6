"""The SSD chunked scan's backward in Triton, and the autograd Function over both directions.

With, per chunk and head, xdt_s = x_s dt_s, cs the running sum of dt A, K[l, s] =
exp(cs_l - cs_s) on the causal same-document mask, M = (C B^T) * K, e_l = exp(cs_l) where token
l continues the entering state's document, w_s = exp(cs_last - cs_s) where s is in the chunk's
last document, the forward is

    y_l = sum_s M[l, s] xdt_s + e_l S_in C_l + D x_l,   chunk_state = sum_s w_s xdt_s B_s^T,
    S_in[c + 1] = decay_c S_in[c] + chunk_state[c]      (decay_c = exp(cs_last) or 0 at a reset).

The backward runs the same decomposition in reverse:
1. `_bwd_dstates_kernel`: what each chunk's outputs ask of its entering state, (e dy)^T C;
2. `_state_passing_bwd_kernel`: those carried backwards across chunks, giving the gradient of
   each chunk's end state, of the initial state, and of each decay;
3. `_bwd_source_kernel`: per token in its role as a source (s): dx, the dt of xdt, dB, and the
   cumsum gradient from K's and w's dependence on cs_s;
4. `_bwd_target_kernel`: per token as a target (l): dC and the cumsum gradient on cs_l.
The states are recomputed rather than saved (one [b, nc, H, P, N] tensor less per layer). The
cumsum's gradient becomes dt's and A's through a reverse cumulative sum, and softplus/limits
through their derivatives, in a few elementwise torch ops on [b, H, T]-sized tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessera.kernels.ssm.ssd_fwd_triton import (
    _dot,
    chunk_cumsum,
    chunk_scan_fwd,
    dot_in_fp32,
    states_entering_chunks,
    tiles,
)


@triton.jit
def _bwd_dstates_kernel(dy_ptr, C_ptr, cs_ptr, seq_ptr, dsl_ptr, T, H, G, NC, P: tl.constexpr, N: tl.constexpr,
                        L: tl.constexpr, HAS_SEQ: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    bi, c = pid // NC, pid % NC
    h = tl.program_id(1)
    g = h // (H // G)
    p, n = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    pm, nm = p < P, n < N
    chunk_len = tl.minimum(L, T - c * L)
    cs_base = ((bi * H + h) * NC + c) * L
    if HAS_SEQ:
        entering = tl.load(seq_ptr + bi * T + tl.maximum(c * L - 1, 0))
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, chunk_len, BLOCK_K):
        lo = k0 + tl.arange(0, BLOCK_K)
        lm = lo < chunk_len
        t = c * L + lo
        e = tl.where(lm, tl.exp(tl.load(cs_ptr + cs_base + lo, mask=lm, other=0.0)), 0.0)
        if HAS_SEQ:
            e = tl.where(tl.load(seq_ptr + bi * T + t, mask=lm, other=-1) == entering, e, 0.0)
        dy = tl.load(dy_ptr + ((bi * T + t[:, None]) * H + h) * P + p[None, :], mask=lm[:, None] & pm[None, :],
                     other=0.0).to(tl.float32)
        C_l = tl.load(C_ptr + ((bi * T + t[:, None]) * G + g) * N + n[None, :], mask=lm[:, None] & nm[None, :],
                      other=0.0)
        acc += _dot(tl.trans(dy * e[:, None]), C_l, DOT_FP32, C_ptr.dtype.element_ty)
    tl.store(dsl_ptr + (((bi * NC + c) * H + h) * P + p[:, None]) * N + n[None, :], acc,
             mask=pm[:, None] & nm[None, :])


@triton.jit
def _state_passing_bwd_kernel(dsl_ptr, sin_ptr, cs_ptr, seq_ptr, dfinal_ptr, dend_ptr, ddecay_ptr, dinit_ptr,
                              T, H, NC, NBLK, PN: tl.constexpr, L: tl.constexpr, HAS_DFINAL: tl.constexpr,
                              HAS_SEQ: tl.constexpr, BLOCK: tl.constexpr):
    bi = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    blk = tl.program_id(2)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < PN
    if HAS_DFINAL:
        grad = tl.load(dfinal_ptr + (bi * H + h) * PN + offs, mask=m, other=0.0).to(tl.float32)
    else:
        grad = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(NC):
        c = NC - 1 - i
        at = ((bi * NC + c) * H + h) * PN + offs
        tl.store(dend_ptr + at, grad, mask=m)
        decay = tl.exp(tl.load(cs_ptr + ((bi * H + h) * NC + c) * L + L - 1))
        if HAS_SEQ:
            last = tl.load(seq_ptr + bi * T + tl.minimum((c + 1) * L, T) - 1)
            prev = tl.load(seq_ptr + bi * T + tl.maximum(c * L - 1, 0))
            decay = tl.where(last == prev, decay, 0.0)
        # d decay / d cs_last = decay: this block's share of the gradient of cs at the chunk's end.
        dd = tl.sum(grad * tl.load(sin_ptr + at, mask=m, other=0.0), axis=0) * decay
        tl.store(ddecay_ptr + ((bi * H + h) * NC + c) * NBLK + blk, dd)
        grad = grad * decay + tl.load(dsl_ptr + at, mask=m, other=0.0)
    tl.store(dinit_ptr + (bi * H + h) * PN + offs, grad, mask=m)


@triton.jit
def _bwd_source_kernel(x_ptr, B_ptr, C_ptr, dy_ptr, dtp_ptr, cs_ptr, seq_ptr, dend_ptr, D_ptr,
                       dx_ptr, ddt_ptr, dB_ptr, dcs_ptr, dcs_state_ptr, dD_ptr, T, H, G, NC,
                       P: tl.constexpr, N: tl.constexpr, L: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
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
    s = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    sm = s < chunk_len
    t_s = c * L + s
    xp_s = ((bi * T + t_s[:, None]) * H + h) * P + p[None, :]
    x_s = tl.load(x_ptr + xp_s, mask=sm[:, None] & pm[None, :], other=0.0).to(tl.float32)
    dt_s = tl.load(dtp_ptr + cs_base + s, mask=sm, other=0.0)
    cs_s = tl.load(cs_ptr + cs_base + s, mask=sm, other=0.0)
    B_s = tl.load(B_ptr + ((bi * T + t_s[:, None]) * G + g) * N + n[None, :], mask=sm[:, None] & nm[None, :],
                  other=0.0)
    xdt = x_s * dt_s[:, None]
    w = tl.where(sm, tl.exp(tl.load(cs_ptr + cs_base + L - 1) - cs_s), 0.0)
    if HAS_SEQ:
        seq_s = tl.load(seq_ptr + bi * T + t_s, mask=sm, other=-1)
        seq_last = tl.load(seq_ptr + bi * T + c * L + chunk_len - 1)
        w = tl.where(seq_s == seq_last, w, 0.0)
    # The chunk-state term: chunk_state = sum_s w_s xdt_s B_s^T, its gradient Gend [P, N].
    Gend = tl.load(dend_ptr + (((bi * NC + c) * H + h) * P + p[:, None]) * N + n[None, :],
                   mask=pm[:, None] & nm[None, :], other=0.0)
    GB = _dot(B_s, tl.trans(Gend), DOT_FP32, DTYPE)  # [BLOCK_K, BLOCK_P]
    dxdt = GB * w[:, None]
    dB = _dot(xdt, Gend, DOT_FP32, DTYPE) * w[:, None]
    tl.store(dcs_state_ptr + cs_base + s, -w * tl.sum(xdt * GB, axis=1), mask=sm)
    dcs = tl.zeros([BLOCK_K], dtype=tl.float32)
    for l0 in range(tl.program_id(2) * BLOCK_K, chunk_len, BLOCK_M):
        lo = l0 + tl.arange(0, BLOCK_M)
        lm = lo < chunk_len
        t_l = c * L + lo
        C_l = tl.load(C_ptr + ((bi * T + t_l[:, None]) * G + g) * N + n[None, :], mask=lm[:, None] & nm[None, :],
                      other=0.0)
        dy_l = tl.load(dy_ptr + ((bi * T + t_l[:, None]) * H + h) * P + p[None, :], mask=lm[:, None] & pm[None, :],
                       other=0.0).to(tl.float32)
        cs_l = tl.load(cs_ptr + cs_base + lo, mask=lm, other=0.0)
        keep = (s[:, None] <= lo[None, :]) & sm[:, None] & lm[None, :]
        if HAS_SEQ:
            keep = keep & (seq_s[:, None] == tl.load(seq_ptr + bi * T + t_l, mask=lm, other=-2)[None, :])
        K = tl.exp(tl.where(keep, cs_l[None, :] - cs_s[:, None], float("-inf")))  # [s, l]
        MT = _dot(B_s, tl.trans(C_l), DOT_FP32, DTYPE) * K
        dMT = _dot(xdt, tl.trans(dy_l), DOT_FP32, DTYPE)
        dxdt += _dot(MT, dy_l, DOT_FP32, DTYPE)
        dB += _dot(dMT * K, C_l, DOT_FP32, DTYPE)
        dcs -= tl.sum(dMT * MT, axis=1)
    dy_s = tl.load(dy_ptr + xp_s, mask=sm[:, None] & pm[None, :], other=0.0).to(tl.float32)
    dx = dxdt * dt_s[:, None]
    if HAS_D:
        dx += tl.load(D_ptr + h).to(tl.float32) * dy_s
        tl.store(dD_ptr + (bi * T + t_s) * H + h, tl.sum(dy_s * x_s, axis=1), mask=sm)
    tl.store(dx_ptr + xp_s, dx.to(dx_ptr.dtype.element_ty), mask=sm[:, None] & pm[None, :])
    tl.store(ddt_ptr + cs_base + s, tl.sum(dxdt * x_s, axis=1), mask=sm)
    tl.store(dB_ptr + ((bi * T + t_s[:, None]) * H + h) * N + n[None, :], dB, mask=sm[:, None] & nm[None, :])
    tl.store(dcs_ptr + cs_base + s, dcs, mask=sm)


@triton.jit
def _bwd_target_kernel(x_ptr, B_ptr, C_ptr, dy_ptr, dtp_ptr, cs_ptr, seq_ptr, sin_ptr, dC_ptr, dcs_ptr,
                       T, H, G, NC, P: tl.constexpr, N: tl.constexpr, L: tl.constexpr, HAS_SEQ: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
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
    dy_l = tl.load(dy_ptr + ((bi * T + t_l[:, None]) * H + h) * P + p[None, :], mask=lm[:, None] & pm[None, :],
                   other=0.0).to(tl.float32)
    S = tl.load(sin_ptr + (((bi * NC + c) * H + h) * P + p[:, None]) * N + n[None, :],
                mask=pm[:, None] & nm[None, :], other=0.0)
    e = tl.where(lm, tl.exp(cs_l), 0.0)
    if HAS_SEQ:
        seq_l = tl.load(seq_ptr + bi * T + t_l, mask=lm, other=-1)
        e = tl.where(seq_l == tl.load(seq_ptr + bi * T + tl.maximum(c * L - 1, 0)), e, 0.0)
    DS = _dot(dy_l, S, DOT_FP32, DTYPE)  # [BLOCK_M, BLOCK_N]
    dC = DS * e[:, None]
    dcs = e * tl.sum(DS * C_l.to(tl.float32), axis=1)
    hi = tl.minimum(chunk_len, (tl.program_id(2) + 1) * BLOCK_M)
    for k0 in range(0, hi, BLOCK_K):
        s = k0 + tl.arange(0, BLOCK_K)
        sm = s < chunk_len
        t_s = c * L + s
        B_s = tl.load(B_ptr + ((bi * T + t_s[:, None]) * G + g) * N + n[None, :], mask=sm[:, None] & nm[None, :],
                      other=0.0)
        x_s = tl.load(x_ptr + ((bi * T + t_s[:, None]) * H + h) * P + p[None, :], mask=sm[:, None] & pm[None, :],
                      other=0.0).to(tl.float32)
        cs_s = tl.load(cs_ptr + cs_base + s, mask=sm, other=0.0)
        xdt = x_s * tl.load(dtp_ptr + cs_base + s, mask=sm, other=0.0)[:, None]
        keep = (s[None, :] <= lo[:, None]) & sm[None, :] & lm[:, None]
        if HAS_SEQ:
            keep = keep & (tl.load(seq_ptr + bi * T + t_s, mask=sm, other=-2)[None, :] == seq_l[:, None])
        K = tl.exp(tl.where(keep, cs_l[:, None] - cs_s[None, :], float("-inf")))  # [l, s]
        dM = _dot(dy_l, tl.trans(xdt), DOT_FP32, DTYPE)
        dC += _dot(dM * K, B_s, DOT_FP32, DTYPE)
        dcs += tl.sum(dM * K * _dot(C_l, tl.trans(B_s), DOT_FP32, DTYPE), axis=1)
    tl.store(dC_ptr + ((bi * T + t_l[:, None]) * H + h) * N + n[None, :], dC, mask=lm[:, None] & nm[None, :])
    tl.store(dcs_ptr + cs_base + lo, dcs, mask=lm)


def _unchunk(t: torch.Tensor, T: int) -> torch.Tensor:
    """[b, H, nc, L] -> [b, T, H]."""
    return t.flatten(2)[:, :, :T].transpose(1, 2)


def _backward(dy, dfinal, x, dt, A, B, C, D, dt_bias, init, seq, chunk_size, softplus, dt_limit):
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    dtp, cs = chunk_cumsum(dt, dt_bias, A, chunk_size, softplus, dt_limit)
    states_in, _ = states_entering_chunks(x, B, dtp, cs, seq, init)
    nc, L = dtp.shape[2], dtp.shape[3]
    tl_ = tiles(L, P, N, x.dtype)
    fp32, seq_arg = dot_in_fp32(x.dtype), seq if seq is not None else cs
    dy = dy.contiguous() if dy is not None else torch.zeros(b, T, H, P, device=x.device)
    common = dict(P=P, N=N, L=L, HAS_SEQ=seq is not None, DOT_FP32=fp32, num_warps=4)
    blocks = dict(BLOCK_K=tl_["BLOCK_K"], BLOCK_P=tl_["BLOCK_P"], BLOCK_N=tl_["BLOCK_N"])
    dsl = torch.empty_like(states_in)
    _bwd_dstates_kernel[(b * nc, H)](dy, C, cs, seq_arg, dsl, T, H, G, nc, **blocks, **common)

    block = min(1024, triton.next_power_of_2(P * N))
    nblk = triton.cdiv(P * N, block)
    dend, dinit = torch.empty_like(states_in), torch.empty(b, H, P, N, device=x.device)
    ddecay = torch.empty(b, H, nc, nblk, device=x.device)
    _state_passing_bwd_kernel[(b, H, nblk)](
        dsl, states_in, cs, seq_arg, dfinal.contiguous() if dfinal is not None else cs, dend, ddecay, dinit,
        T, H, nc, nblk, PN=P * N, L=L, HAS_DFINAL=dfinal is not None, HAS_SEQ=seq is not None, BLOCK=block,
        num_warps=4)

    dx = torch.empty_like(x)
    ddt_xdt, dcs, dcs_state, dcs_target = (torch.zeros_like(cs) for _ in range(4))
    dB_heads, dC_heads = (torch.empty(b, T, H, N, device=x.device) for _ in range(2))
    dD_tokens = torch.empty(b, T, H, device=x.device) if D is not None else None
    grid = (b * nc, H, triton.cdiv(L, tl_["BLOCK_M"]))
    _bwd_source_kernel[grid](
        x, B, C, dy, dtp, cs, seq_arg, dend, D if D is not None else cs, dx, ddt_xdt, dB_heads, dcs, dcs_state,
        dD_tokens if D is not None else cs, T, H, G, nc, HAS_D=D is not None, BLOCK_M=tl_["BLOCK_M"], **blocks,
        **common)
    _bwd_target_kernel[grid](x, B, C, dy, dtp, cs, seq_arg, states_in, dC_heads, dcs_target, T, H, G, nc,
                             BLOCK_M=tl_["BLOCK_M"], **blocks, **common)

    # The cumsum's gradient: both roles, the chunk-state weights (w_s = exp(cs_last - cs_s) gives
    # -dw w to cs_s and +dw w to cs_last) and the decays (to cs_last); then back through the sum.
    dcs += dcs_target + dcs_state
    dcs[..., L - 1] += ddecay.sum(-1) - dcs_state.sum(-1)
    da = dcs.flip(-1).cumsum(-1).flip(-1)
    ddt_proc = ddt_xdt + da * A.float()[None, :, None, None]
    dA = (da * dtp).sum((0, 2, 3))
    ddt = _unchunk(ddt_proc, T)
    dt_bias_grad = None
    if softplus or dt_bias is not None or dt_limit != (0.0, float("inf")):
        raw = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
        if dt_limit != (0.0, float("inf")):  # clamp passes the gradient where its input is within the limits
            pre = torch.nn.functional.softplus(raw) if softplus else raw
            ddt = ddt * ((pre >= dt_limit[0]) & (pre <= dt_limit[1]))
        if softplus:
            ddt = ddt * torch.where(raw <= 20.0, torch.sigmoid(raw), 1.0)
        if dt_bias is not None:
            dt_bias_grad = ddt.sum((0, 1)).to(dt_bias.dtype)
    dB = dB_heads.view(b, T, G, H // G, N).sum(3).to(B.dtype)
    dC = dC_heads.view(b, T, G, H // G, N).sum(3).to(C.dtype)
    dD = dD_tokens.sum((0, 1)).to(D.dtype) if D is not None else None
    dinit = dinit.to(init.dtype) if init is not None else None
    return dx, ddt.to(dt.dtype), dA.to(A.dtype), dB, dC, dD, dt_bias_grad, dinit


class SSDChunkScan(torch.autograd.Function):
    """(y [b, T, H, P] fp32, final state [b, H, P, N] fp32) with Triton forward and backward."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, dt_bias, initial_state, seq_idx, chunk_size, softplus, dt_limit):
        x, dt, B, C = x.contiguous(), dt.contiguous(), B.contiguous(), C.contiguous()
        A = A.contiguous()
        init = initial_state.contiguous() if initial_state is not None else None
        seq = seq_idx.to(torch.int32).contiguous() if seq_idx is not None else None
        dtp, cs = chunk_cumsum(dt, dt_bias, A, chunk_size, softplus, dt_limit)
        states_in, final = states_entering_chunks(x, B, dtp, cs, seq, init)
        y = chunk_scan_fwd(x, B, C, dtp, cs, seq, states_in, D)
        ctx.save_for_backward(x, dt, A, B, C, D, dt_bias, init, seq)
        ctx.options = (chunk_size, softplus, dt_limit)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, D, dt_bias, init, seq = ctx.saved_tensors
        grads = _backward(dy, dfinal, x, dt, A, B, C, D, dt_bias, init, seq, *ctx.options)
        return (*grads, None, None, None, None)


def ssd_chunk_scan_triton(x, dt, A, B, C, chunk_size, D=None, initial_state=None, seq_idx=None, dt_bias=None,
                          dt_softplus=False, dt_limit=(0.0, float("inf"))):
    return SSDChunkScan.apply(x, dt, A, B, C, D, dt_bias, initial_state, seq_idx, chunk_size, dt_softplus,
                              tuple(float(v) for v in dt_limit))
