"""Mamba-2's causal depthwise conv1d in Triton (our own code for mamba's causal_conv1d): the
whole sequence forward and backward, and the one-token update in a pool of conv states.

Semantics are `causal_conv1d_reference`'s (tessera.kernels.causal_conv1d): x [b, T, channels]
channels last, weight [channels, K], y_t = act(bias + sum_k w[k] x_{t-K+1+k}), inputs before the
start taken from `initial_state` [b, channels, K-1] (zeros without it), taps reaching into an
earlier document (`seq_idx`) masked. Accumulation in fp32; y in x's dtype.

Backward: `_conv_bwd_kernel` recomputes the pre-activation, writes d(pre) and each tile's partial
sums for dweight and dbias; `_conv_bwd_dx_kernel` correlates d(pre) with the taps into dx and,
for the K-1 positions before the start, d(initial_state). The final state is a masked copy of the
last K-1 inputs, done (and differentiated) in torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_T, BLOCK_C = 32, 64


@triton.jit
def _tap(x_ptr, init_ptr, seq_ptr, bi, t, c, T, CH, k, seq_t, seq0, tm, cm,
         K: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr):
    """The input tap k reads for outputs t: x[t - (K-1) + k], from the initial state before 0."""
    j = t - (K - 1) + k
    v = tl.load(x_ptr + (bi * T + j[:, None]) * CH + c[None, :], mask=((j >= 0) & tm)[:, None] & cm[None, :],
                other=0.0).to(tl.float32)
    if HAS_INIT:
        v += tl.load(init_ptr + (bi * CH + c[None, :]) * (K - 1) + (K - 1) + j[:, None],
                     mask=((j < 0) & tm)[:, None] & cm[None, :], other=0.0).to(tl.float32)
    if HAS_SEQ:
        doc = tl.load(seq_ptr + bi * T + tl.maximum(j, 0), mask=tm, other=-1)
        doc = tl.where(j >= 0, doc, seq0)
        v = tl.where((doc == seq_t)[:, None], v, 0.0)
    return v


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, bias_ptr, seq_ptr, init_ptr, y_ptr, T, CH, K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    bi = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    tm, cm = t < T, c < CH
    seq_t, seq0 = 0, 0
    if HAS_SEQ:
        seq_t = tl.load(seq_ptr + bi * T + t, mask=tm, other=-1)
        seq0 = tl.load(seq_ptr + bi * T)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        v = _tap(x_ptr, init_ptr, seq_ptr, bi, t, c, T, CH, k, seq_t, seq0, tm, cm, K, HAS_INIT, HAS_SEQ)
        acc += v * tl.load(w_ptr + c * K + k, mask=cm, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + (bi * T + t[:, None]) * CH + c[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=tm[:, None] & cm[None, :])


@triton.jit
def _conv_bwd_kernel(x_ptr, w_ptr, bias_ptr, seq_ptr, init_ptr, dy_ptr, dpre_ptr, dw_ptr, db_ptr, T, CH, NTB,
                     K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_INIT: tl.constexpr,
                     SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    bi = tl.program_id(0).to(tl.int64)
    tb = tl.program_id(1)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    tm, cm = t < T, c < CH
    seq_t, seq0 = 0, 0
    if HAS_SEQ:
        seq_t = tl.load(seq_ptr + bi * T + t, mask=tm, other=-1)
        seq0 = tl.load(seq_ptr + bi * T)
    tc = tm[:, None] & cm[None, :]
    dpre = tl.load(dy_ptr + (bi * T + t[:, None]) * CH + c[None, :], mask=tc, other=0.0).to(tl.float32)
    if SILU:
        pre = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        if HAS_BIAS:
            pre += tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]
        for k in tl.static_range(K):
            v = _tap(x_ptr, init_ptr, seq_ptr, bi, t, c, T, CH, k, seq_t, seq0, tm, cm, K, HAS_INIT, HAS_SEQ)
            pre += v * tl.load(w_ptr + c * K + k, mask=cm, other=0.0).to(tl.float32)[None, :]
        sig = tl.sigmoid(pre)
        dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
    dpre = tl.where(tc, dpre, 0.0)
    tl.store(dpre_ptr + (bi * T + t[:, None]) * CH + c[None, :], dpre, mask=tc)
    part = (bi * NTB + tb) * CH + c
    tl.store(db_ptr + part, tl.sum(dpre, axis=0), mask=cm)
    for k in tl.static_range(K):
        v = _tap(x_ptr, init_ptr, seq_ptr, bi, t, c, T, CH, k, seq_t, seq0, tm, cm, K, HAS_INIT, HAS_SEQ)
        tl.store(dw_ptr + part * K + k, tl.sum(dpre * v, axis=0), mask=cm)


@triton.jit
def _conv_bwd_dx_kernel(dpre_ptr, w_ptr, seq_ptr, dx_ptr, dinit_ptr, T, CH, K: tl.constexpr,
                        HAS_SEQ: tl.constexpr, HAS_INIT: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    bi = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T) - (K - 1)  # input positions, from -(K-1)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    jm, cm = j < T, c < CH
    if HAS_SEQ:
        doc_j = tl.load(seq_ptr + bi * T + tl.maximum(j, 0), mask=jm, other=-1)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(K):
        t = j + (K - 1) - k  # the output that reads input j through tap k
        ok = (t >= 0) & (t < T)
        if HAS_SEQ:
            ok = ok & (tl.load(seq_ptr + bi * T + t, mask=ok, other=-2) == doc_j)
        d = tl.load(dpre_ptr + (bi * T + t[:, None]) * CH + c[None, :], mask=ok[:, None] & cm[None, :], other=0.0)
        acc += d * tl.load(w_ptr + c * K + k, mask=cm, other=0.0).to(tl.float32)[None, :]
    tl.store(dx_ptr + (bi * T + j[:, None]) * CH + c[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=((j >= 0) & jm)[:, None] & cm[None, :])
    if HAS_INIT:
        tl.store(dinit_ptr + (bi * CH + c[None, :]) * (K - 1) + (K - 1) + j[:, None], acc,
                 mask=(j < 0)[:, None] & cm[None, :])


@triton.jit
def _conv_update_kernel(x_ptr, state_ptr, idx_ptr, w_ptr, bias_ptr, y_ptr, CH, s_slot, s_ch, s_k,
                        K: tl.constexpr, HAS_IDX: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if HAS_IDX:
        slot = tl.load(idx_ptr + i).to(tl.int64)
    else:
        slot = i
    cm = (c < CH) & ((c * 0 + slot) >= 0)  # a negative slot is a padding row: nothing read or written
    base = state_ptr + tl.maximum(slot, 0) * s_slot + c * s_ch
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(K):
        if k < K - 1:
            v = tl.load(base + k * s_k, mask=cm, other=0.0)
        else:
            v = tl.load(x_ptr + i * CH + c, mask=cm, other=0.0)
        acc += v.to(tl.float32) * tl.load(w_ptr + c * K + k, mask=cm, other=0.0).to(tl.float32)
        if k > 0:  # the window moves one token on
            tl.store(base + (k - 1) * s_k, v.to(state_ptr.dtype.element_ty), mask=cm)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + i * CH + c, acc.to(y_ptr.dtype.element_ty), mask=c < CH)


def _final_state(x, initial_state, seq_idx, K):
    """The last K-1 inputs of the last token's document [b, channels, K-1], as the reference."""
    b, T, ch = x.shape
    history = initial_state.transpose(1, 2).to(x.dtype) if initial_state is not None else x.new_zeros(b, K - 1, ch)
    last = torch.cat([history, x], dim=1)[:, -(K - 1):] if K > 1 else x[:, :0]
    if seq_idx is not None and K > 1:
        docs = torch.cat([seq_idx[:, :1].expand(b, K - 1), seq_idx], dim=1)[:, -(K - 1):]
        last = last * (docs == seq_idx[:, -1:])[..., None].to(x.dtype)
    return last.transpose(1, 2)


class CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx, initial_state, silu):
        x, weight = x.contiguous(), weight.contiguous()
        b, T, ch = x.shape
        K = weight.shape[-1]
        seq = seq_idx.to(torch.int32).contiguous() if seq_idx is not None else None
        init = initial_state.contiguous() if initial_state is not None and K > 1 else None
        y = torch.empty_like(x)
        if T > 0:
            _conv_fwd_kernel[(b, triton.cdiv(T, BLOCK_T), triton.cdiv(ch, BLOCK_C))](
                x, weight, bias if bias is not None else weight, seq if seq is not None else x,
                init if init is not None else x, y, T, ch, K=K, HAS_BIAS=bias is not None, HAS_SEQ=seq is not None,
                HAS_INIT=init is not None, SILU=silu, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=4)
        ctx.save_for_backward(x, weight, bias, seq, init)
        ctx.silu, ctx.init_dtype = silu, initial_state.dtype if initial_state is not None else None
        ctx.set_materialize_grads(False)
        return y, _final_state(x, initial_state, seq, K)

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, weight, bias, seq, init = ctx.saved_tensors
        b, T, ch = x.shape
        K = weight.shape[-1]
        ntb = triton.cdiv(T, BLOCK_T)
        dy = dy.contiguous() if dy is not None else torch.zeros_like(x)
        dpre = torch.empty(b, T, ch, device=x.device, dtype=torch.float32)
        dw_part = torch.empty(b, ntb, ch, K, device=x.device, dtype=torch.float32)
        db_part = torch.empty(b, ntb, ch, device=x.device, dtype=torch.float32)
        dx = torch.empty_like(x)
        dinit = torch.zeros(b, ch, K - 1, device=x.device, dtype=torch.float32)
        flags = dict(K=K, HAS_SEQ=seq is not None, HAS_INIT=init is not None, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C,
                     num_warps=4)
        seq_arg, init_arg = seq if seq is not None else x, init if init is not None else x
        if T > 0:
            _conv_bwd_kernel[(b, ntb, triton.cdiv(ch, BLOCK_C))](
                x, weight, bias if bias is not None else weight, seq_arg, init_arg, dy, dpre, dw_part, db_part, T, ch,
                ntb, HAS_BIAS=bias is not None, SILU=ctx.silu, **flags)
            _conv_bwd_dx_kernel[(b, triton.cdiv(T + K - 1, BLOCK_T), triton.cdiv(ch, BLOCK_C))](
                dpre, weight, seq_arg, dx, dinit, T, ch, **flags)
        if dfinal is not None and K > 1:  # the final state copies (masked) the last K-1 inputs
            d_pad = F.pad(_final_state_grad(dfinal, seq, b, T, K), (0, 0, T, 0))  # [b, K-1+T, channels]
            dx = dx + d_pad[:, K - 1:].to(dx.dtype)
            dinit = dinit + d_pad[:, :K - 1].transpose(1, 2)
        dweight = dw_part.sum((0, 1)).to(weight.dtype)
        dbias = db_part.sum((0, 1)).to(bias.dtype) if bias is not None else None
        return dx, dweight, dbias, None, dinit.to(ctx.init_dtype) if ctx.init_dtype is not None else None, None


def _final_state_grad(dfinal, seq, b, T, K):
    """The final state's gradient as one over the last K-1 padded positions [b, K-1, channels]."""
    g = dfinal.transpose(1, 2).float()
    if seq is not None:
        docs = torch.cat([seq[:, :1].expand(b, K - 1), seq], dim=1)[:, -(K - 1):]
        g = g * (docs == seq[:, -1:])[..., None]
    return g


def causal_conv1d_triton(x, weight, bias=None, seq_idx=None, initial_state=None, silu=True):
    return CausalConv1d.apply(x, weight, bias, seq_idx, initial_state, silu)


def causal_conv1d_update_triton(x, conv_state, weight, bias=None, silu=True, state_indices=None):
    b, ch = x.shape
    K = weight.shape[-1]
    y = torch.empty_like(x)
    if b == 0:
        return y
    idx = state_indices.contiguous() if state_indices is not None else None
    weight, x = weight.contiguous(), x.contiguous()
    strides = conv_state.stride() if K > 1 else (0, 0, 0)
    _conv_update_kernel[(b, triton.cdiv(ch, BLOCK_C))](
        x, conv_state, idx if idx is not None else x, weight, bias if bias is not None else weight, y, ch, *strides,
        K=K, HAS_IDX=idx is not None, HAS_BIAS=bias is not None, SILU=silu, BLOCK_C=BLOCK_C, num_warps=2)
    return y
