"""RMSNorm fused with the residual add (Triton) against add_rms_norm_reference: both outputs
(the new residual stream and the normed activation) and the gradients of x, residual and weight.

CPU runs use Triton's interpreter (fixture `triton_cpu`); `@pytest.mark.gpu` repeats them compiled.
"""

from __future__ import annotations

import pytest
import torch

from tessera.kernels import add_rms_norm, add_rms_norm_reference

# (atol, rtol) by the dtype of the sum s. The reference rounds the norm's input gradient to s's
# dtype before adding the residual-stream gradient; the kernel adds in fp32 and rounds once.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}

CASES = [
    # (shape, x dtype, residual dtype, weight dtype)
    ((4, 64), torch.float32, torch.float32, torch.float32),
    ((2, 3, 100), torch.float32, torch.float32, torch.float32),  # hidden not a power of two
    ((5, 257), torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ((2, 4, 48), torch.bfloat16, torch.bfloat16, torch.float32),  # fp32 master weight
    ((3, 5, 96), torch.float32, torch.bfloat16, torch.float32),  # fp32 stream + bf16 autocast output
]


def _inputs(shape, dtype, rdtype, wdtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2.0).to(device=device, dtype=dtype)
    r = torch.randn(shape, generator=g).to(device=device, dtype=rdtype)
    w = (1.0 + 0.5 * torch.randn(shape[-1], generator=g)).to(device=device, dtype=wdtype)
    s_dtype = torch.promote_types(dtype, rdtype)
    ds = torch.randn(shape, generator=g).to(device=device, dtype=s_dtype)
    dy = torch.randn(shape, generator=g).to(device=device, dtype=torch.promote_types(s_dtype, wdtype))
    return x, r, w, ds, dy


def _run(fn, x, r, w, ds, dy, eps=1e-6):
    x, r, w = (t.detach().clone().requires_grad_() for t in (x, r, w))
    s, y = fn(x, r, w, eps)
    torch.autograd.backward((s, y), (ds, dy))
    return s.detach(), y.detach(), x.grad, r.grad, w.grad


def _check(device, shape, dtype, rdtype, wdtype):
    x, r, w, ds, dy = _inputs(shape, dtype, rdtype, wdtype, device)
    got = _run(add_rms_norm, x, r, w, ds, dy)
    want = _run(add_rms_norm_reference, x, r, w, ds, dy)
    atol, rtol = TOLERANCES[got[0].dtype]
    for name, a, b in zip(("s", "y", "dx", "dresidual"), got[:4], want[:4]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=name)
    rows = x.numel() // shape[-1]
    torch.testing.assert_close(got[4], want[4], atol=atol * rows**0.5, rtol=rtol, msg="dweight")


@pytest.mark.parametrize("shape,dtype,rdtype,wdtype", CASES)
def test_fused_add_norm_matches_reference_on_cpu(triton_cpu, spy_triton, shape, dtype, rdtype, wdtype):
    _check(triton_cpu, shape, dtype, rdtype, wdtype)
    assert spy_triton.get("add_rms_norm_triton") == 1, "dispatcher did not run the Triton kernel"


def test_fp32_gradients_match_float64_autograd(triton_cpu):
    """Independent of the reference: gradients of <s, ds> + <y, dy> equal fp64 autograd of the formula."""
    x, r, w, ds, dy = _inputs((6, 40), torch.float32, torch.float32, torch.float32, triton_cpu, seed=1)
    _, _, dx, dr, dw = _run(add_rms_norm, x, r, w, ds, dy, eps=1e-5)
    x64, r64, w64 = (t.double().requires_grad_() for t in (x, r, w))
    s64 = x64 + r64
    y64 = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    torch.autograd.backward((s64, y64), (ds.double(), dy.double()))
    for got, want in ((dx, x64.grad), (dr, r64.grad), (dw, w64.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_custom_ops_pass_opcheck(triton_cpu):
    x, r = torch.randn(5, 40, requires_grad=True), torch.randn(5, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    torch.library.opcheck(torch.ops.tessera.add_rms_norm_fwd, (x, r, w, 1e-6))
    s, y, rstd = torch.ops.tessera.add_rms_norm_fwd(x.detach(), r.detach(), w.detach(), 1e-6)
    torch.library.opcheck(torch.ops.tessera.add_rms_norm_bwd, (torch.randn_like(y), torch.randn_like(s), s, w.detach(), rstd))


def test_dispatcher_leaves_the_add_and_norm_to_torch_compile(triton_cpu, spy_triton):
    x, r, w = torch.randn(3, 40), torch.randn(3, 40), torch.randn(40)
    compiled = torch.compile(lambda x, r, w: add_rms_norm(x, r, w, 1e-6), backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(x, r, w), add_rms_norm_reference(x, r, w, 1e-6)):
        torch.testing.assert_close(got, want)
    assert spy_triton.get("add_rms_norm_triton", 0) == 0
    add_rms_norm(x, r, w, 1e-6)
    assert spy_triton["add_rms_norm_triton"] == 1


def test_dispatcher_uses_reference_on_cpu_unless_forced(monkeypatch, spy_triton):
    monkeypatch.delenv("TESSERA_FORCE_TRITON", raising=False)
    x, r, w = torch.randn(3, 32), torch.randn(3, 32), torch.randn(32)
    for got, want in zip(add_rms_norm(x, r, w, 1e-6), add_rms_norm_reference(x, r, w, 1e-6)):
        assert torch.equal(got, want)
    assert "add_rms_norm_triton" not in spy_triton


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,rdtype,wdtype", CASES + [((4096, 4096), torch.bfloat16, torch.bfloat16, torch.bfloat16)])
def test_fused_add_norm_matches_reference_on_cuda(triton_cuda, spy_triton, shape, dtype, rdtype, wdtype):
    _check(triton_cuda, shape, dtype, rdtype, wdtype)
    assert spy_triton.get("add_rms_norm_triton") == 1
