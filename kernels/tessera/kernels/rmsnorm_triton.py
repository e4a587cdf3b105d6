"""Fused RMSNorm in Triton: forward and backward, one row of the hidden dimension per program.

Semantics are those of `rms_norm_reference` (and Hugging Face's LlamaRMSNorm):
    n = (x.float() * rstd).to(x.dtype),  rstd = 1 / sqrt(mean(x.float()^2) + eps)
    y = weight * n                       (dtype: torch.promote_types(x.dtype, weight.dtype))
Both passes are registered as torch custom ops (tessera::rms_norm_fwd / rms_norm_bwd) with
autograd and fake-tensor rules, so torch.compile treats them as opaque ops.

The same kernels, with HAS_RESIDUAL set, fuse the pre-norm block's residual add
(tessera::add_rms_norm_fwd / add_rms_norm_bwd): s = x + residual is written once and normalised
from registers, and the backward adds the gradient arriving at s from later in the residual stream
(ds) to the norm's input gradient in fp32 before a single store.
The forward saves only rstd (fp32, one value per row) for the backward, which recomputes the
normalised row from x rather than storing it: that is the "fused" saving over the reference, whose
autograd graph keeps several full-size fp32 intermediates.

Backward, with g = dy * weight and xhat = x * rstd (all in fp32):
    dx      = rstd * (g - xhat * mean(g * xhat))
    dweight = sum over rows of dy * n
dweight is a reduction over every row; each program accumulates its rows into an fp32 partial
sum, and the few partial rows are then summed by torch (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A row is held in registers whole; beyond this many elements a single program would spill.
MAX_FUSED_HIDDEN = 65536


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, r_ptr, s_ptr, w_ptr, y_ptr, rstd_ptr,
    stride_x, stride_r, stride_s, stride_y,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # s = x + residual, rounded to s's dtype as torch's add does; the norm reads the rounded s.
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    # Round the normalised row to x's dtype before scaling, as the reference does.
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = normed * w
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr, w_ptr, dy_ptr, ds_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
    stride_x, stride_dy, stride_ds, stride_dx,
    n_rows, n_cols, rows_per_program,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = xf * rstd
        # dweight sees the normalised row after its rounding to x's dtype, as in the forward.
        dw_acc += dy * xhat.to(x.dtype).to(tl.float32)
        g = dy * w
        c = tl.sum(g * xhat, axis=0) / n_cols
        dx = rstd * (g - xhat * c)
        if HAS_RESIDUAL:
            dx += tl.load(ds_ptr + row * stride_ds + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw_acc, mask=mask)


def _launch_params(n_cols: int) -> tuple[int, int]:
    block_n = triton.next_power_of_2(n_cols)
    # Enough warps that each thread holds a handful of elements of the row.
    num_warps = min(max(block_n // 256, 1), 16)
    return block_n, num_warps


def _num_bwd_programs(n_rows: int, device: torch.device) -> int:
    """A few programs per SM on CUDA so the dweight partials stay few; fewer on the interpreter."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_rows, 4 * sms))
    return max(1, min(n_rows, 4))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_fwd(x2d, r2d, weight, eps):
    """(s or None, y, rstd); s = x + r when r2d is given, and the norm is over s."""
    x2d = _rows(x2d)
    n_rows, n_cols = x2d.shape
    s = None
    if r2d is not None:
        r2d = _rows(r2d)
        s = torch.empty((n_rows, n_cols), dtype=torch.promote_types(x2d.dtype, r2d.dtype), device=x2d.device)
    normed_dtype = x2d.dtype if s is None else s.dtype
    y = torch.empty((n_rows, n_cols), dtype=torch.promote_types(normed_dtype, weight.dtype), device=x2d.device)
    rstd = torch.empty((n_rows,), dtype=torch.float32, device=x2d.device)
    block_n, num_warps = _launch_params(n_cols)
    if n_rows > 0:
        _rms_norm_fwd_kernel[(n_rows,)](
            x2d, x2d if r2d is None else r2d, x2d if s is None else s, weight.contiguous(), y, rstd,
            x2d.stride(0), 0 if r2d is None else r2d.stride(0), 0 if s is None else s.stride(0), y.stride(0),
            n_cols, eps,
            HAS_RESIDUAL=r2d is not None, BLOCK_N=block_n, num_warps=num_warps,
        )
    return s, y, rstd


def _launch_bwd(dy2d, ds2d, x2d, weight, rstd):
    """(dx in x's dtype, dweight in weight's dtype); dx includes ds2d when given."""
    x2d, dy2d = _rows(x2d), _rows(dy2d)
    n_rows, n_cols = x2d.shape
    dx = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    n_programs = _num_bwd_programs(n_rows, x2d.device)
    dw_partial = torch.zeros((n_programs, n_cols), dtype=torch.float32, device=x2d.device)
    block_n, num_warps = _launch_params(n_cols)
    if ds2d is not None:
        ds2d = _rows(ds2d)
    if n_rows > 0:
        _rms_norm_bwd_kernel[(n_programs,)](
            x2d, weight.contiguous(), dy2d, dy2d if ds2d is None else ds2d, rstd, dx, dw_partial,
            x2d.stride(0), dy2d.stride(0), 0 if ds2d is None else ds2d.stride(0), dx.stride(0),
            n_rows, n_cols, triton.cdiv(n_rows, n_programs),
            HAS_RESIDUAL=ds2d is not None, BLOCK_N=block_n, num_warps=num_warps,
        )
    return dx, dw_partial.sum(0).to(weight.dtype)


# The kernels are wrapped as torch custom ops with autograd and fake-tensor rules, so that
# torch.compile (the trainer's --compile) treats them as opaque ops instead of tracing into the
# launch code, and autograd sees one node for the whole norm.


@torch.library.custom_op("tessera::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(x2d: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x2d [rows, hidden] -> (y [rows, hidden] in promote(x, weight) dtype, rstd fp32 [rows])."""
    _s, y, rstd = _launch_fwd(x2d, None, weight, eps)
    return y, rstd


@_rms_norm_fwd.register_fake
def _(x2d, weight, eps):
    y = x2d.new_empty(x2d.shape, dtype=torch.promote_types(x2d.dtype, weight.dtype))
    return y, x2d.new_empty((x2d.shape[0],), dtype=torch.float32)


@torch.library.custom_op("tessera::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(
    dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [rows, hidden] in x's dtype, dweight [hidden] in weight's dtype)."""
    return _launch_bwd(dy2d, None, x2d, weight, rstd)


@_rms_norm_bwd.register_fake
def _(dy2d, x2d, weight, rstd):
    return x2d.new_empty(x2d.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    x2d, weight, _eps = inputs
    _y, rstd = output
    ctx.save_for_backward(x2d, weight, rstd)


def _backward(ctx, dy2d, _drstd):
    x2d, weight, rstd = ctx.saved_tensors
    dx, dweight = torch.ops.tessera.rms_norm_bwd(dy2d, x2d, weight, rstd)
    return (dx if ctx.needs_input_grad[0] else None), (dweight if ctx.needs_input_grad[1] else None), None


_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("tessera::add_rms_norm_fwd", mutates_args=())
def _add_rms_norm_fwd(
    x2d: torch.Tensor, r2d: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s = x + r in promote(x, r) dtype, y = rms_norm(s) in promote(s, weight) dtype, rstd fp32 [rows])."""
    s, y, rstd = _launch_fwd(x2d, r2d, weight, eps)
    return s, y, rstd


@_add_rms_norm_fwd.register_fake
def _(x2d, r2d, weight, eps):
    s = x2d.new_empty(x2d.shape, dtype=torch.promote_types(x2d.dtype, r2d.dtype))
    y = x2d.new_empty(x2d.shape, dtype=torch.promote_types(s.dtype, weight.dtype))
    return s, y, x2d.new_empty((x2d.shape[0],), dtype=torch.float32)


@torch.library.custom_op("tessera::add_rms_norm_bwd", mutates_args=())
def _add_rms_norm_bwd(
    dy2d: torch.Tensor, ds2d: torch.Tensor, s2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d(x + r) [rows, hidden] in s's dtype: ds plus the norm's input gradient, dweight)."""
    return _launch_bwd(dy2d, ds2d, s2d, weight, rstd)


@_add_rms_norm_bwd.register_fake
def _(dy2d, ds2d, s2d, weight, rstd):
    return s2d.new_empty(s2d.shape), weight.new_empty(weight.shape)


def _add_setup_context(ctx, inputs, output) -> None:
    x2d, r2d, weight, _eps = inputs
    s, _y, rstd = output
    ctx.save_for_backward(s, weight, rstd)
    ctx.dtypes = (x2d.dtype, r2d.dtype)


def _add_backward(ctx, ds2d, dy2d, _drstd):
    s, weight, rstd = ctx.saved_tensors
    dsum, dweight = torch.ops.tessera.add_rms_norm_bwd(dy2d, ds2d, s, weight, rstd)
    x_dtype, r_dtype = ctx.dtypes
    return (
        dsum.to(x_dtype) if ctx.needs_input_grad[0] else None,
        dsum.to(r_dtype) if ctx.needs_input_grad[1] else None,
        dweight if ctx.needs_input_grad[2] else None,
        None,
    )


_add_rms_norm_fwd.register_autograd(_add_backward, setup_context=_add_setup_context)


def _check(x: torch.Tensor, weight: torch.Tensor) -> int:
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {n_cols}")
    if n_cols > MAX_FUSED_HIDDEN:
        raise ValueError(f"rms_norm_triton: hidden size {n_cols} exceeds {MAX_FUSED_HIDDEN}")
    return n_cols


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (any leading dims), differentiable in x and weight."""
    n_cols = _check(x, weight)
    y, _rstd = torch.ops.tessera.rms_norm_fwd(x.reshape(-1, n_cols), weight, eps)
    return y.reshape(x.shape[:-1] + (n_cols,))


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) with s = x + residual, one pass; differentiable in x, residual and weight."""
    n_cols = _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual shape {tuple(residual.shape)} differs from {tuple(x.shape)}")
    s, y, _rstd = torch.ops.tessera.add_rms_norm_fwd(
        x.reshape(-1, n_cols), residual.reshape(-1, n_cols), weight, eps
    )
    return s.reshape(x.shape), y.reshape(x.shape)
