"""SwiGLU (silu(gate) * up) in Triton, forward and backward, over flat contiguous elements.

Semantics are those of `swiglu_reference`: with sig = sigmoid(g) in fp32,
    h     = round(g * sig) * u                     (silu rounded to the input dtype, as F.silu)
    dup   = dh * round(g * sig)
    dgate = dh * u * sig * (1 + g * (1 - sig))
Registered as torch custom ops tessera::swiglu_fwd / swiglu_bwd with autograd and fake-tensor
rules; only gate and up are saved for the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, h_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g_raw = tl.load(g_ptr + offs, mask=mask, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(g_raw.dtype).to(tl.float32)
    tl.store(h_ptr + offs, (silu * u).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g_raw = tl.load(g_ptr + offs, mask=mask, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = (g * sig).to(g_raw.dtype).to(tl.float32)
    tl.store(du_ptr + offs, (dh * silu).to(du_ptr.dtype.element_ty), mask=mask)
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)


@torch.library.custom_op("tessera::swiglu_fwd", mutates_args=())
def _swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    h = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    n = gate.numel()
    if n > 0:
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, h, n, BLOCK=BLOCK, num_warps=4)
    return h


@_swiglu_fwd.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("tessera::swiglu_bwd", mutates_args=())
def _swiglu_bwd(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate in gate's dtype, dup in up's dtype)."""
    dh, gate, up = dh.contiguous(), gate.contiguous(), up.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n > 0:
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](dh, gate, up, dgate, dup, n, BLOCK=BLOCK, num_warps=4)
    return dgate, dup


@_swiglu_bwd.register_fake
def _(dh, gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format), torch.empty_like(
        up, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, dh):
    gate, up = ctx.saved_tensors
    dgate, dup = torch.ops.tessera.swiglu_bwd(dh, gate, up)
    return (dgate if ctx.needs_input_grad[0] else None), (dup if ctx.needs_input_grad[1] else None)


_swiglu_fwd.register_autograd(_backward, setup_context=_setup_context)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for same-shaped gate and up (any shape), differentiable in both."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    return torch.ops.tessera.swiglu_fwd(gate, up)
