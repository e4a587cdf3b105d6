"""Fused RMSNorm (Triton) against rms_norm_reference: outputs, dx and dweight.

CPU runs use Triton's interpreter (fixture `triton_cpu`); the same checks run compiled on CUDA
when a GPU is present (`@pytest.mark.gpu`).
"""

from __future__ import annotations

import pytest
import torch

from tessera.kernels import rms_norm, rms_norm_reference

# (atol, rtol) per dtype. bf16/fp16 references round intermediates to the low-precision dtype
# where the kernel keeps fp32, so they agree to about one or two units in the last place.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}

CASES = [
    # (shape, x dtype, weight dtype)
    ((4, 64), torch.float32, torch.float32),
    ((2, 3, 100), torch.float32, torch.float32),  # 3-d input, hidden not a power of two
    ((5, 257), torch.bfloat16, torch.bfloat16),
    ((3, 7, 96), torch.float16, torch.float16),
    ((2, 4, 48), torch.bfloat16, torch.float32),  # fp32 master weight on bf16 activations
    ((1, 1, 1000), torch.float32, torch.float32),
]


def _inputs(shape, dtype, wdtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3.0).to(device=device, dtype=dtype)
    w = (1.0 + 0.5 * torch.randn(shape[-1], generator=g)).to(device=device, dtype=wdtype)
    dy = torch.randn(shape, generator=g).to(device=device, dtype=torch.promote_types(dtype, wdtype))
    return x, w, dy


def _forward_backward(fn, x, w, dy, eps):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = fn(x, w) if eps is None else fn(x, w, eps)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _check_against_reference(device, shape, dtype, wdtype, eps=1e-6):
    x, w, dy = _inputs(shape, dtype, wdtype, device)
    y, dx, dw = _forward_backward(rms_norm, x, w, dy, eps)
    y_ref, dx_ref, dw_ref = _forward_backward(rms_norm_reference, x, w, dy, eps)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(dx, dx_ref, atol=atol, rtol=rtol)
    # dweight sums over every row, so its absolute error grows with the row count.
    rows = x.numel() // shape[-1]
    torch.testing.assert_close(dw, dw_ref, atol=atol * rows**0.5, rtol=rtol)


@pytest.mark.parametrize("shape,dtype,wdtype", CASES)
def test_triton_matches_reference_on_cpu(triton_cpu, spy_triton, shape, dtype, wdtype):
    _check_against_reference(triton_cpu, shape, dtype, wdtype)
    assert spy_triton.get("rms_norm_triton") == 1, "dispatcher did not run the Triton kernel"


def test_fp32_gradients_match_float64_autograd(triton_cpu):
    """Independent of the reference: the kernel's gradients equal autograd of the formula in fp64."""
    x, w, dy = _inputs((6, 40), torch.float32, torch.float32, triton_cpu, seed=1)
    eps = 1e-5
    _, dx, dw = _forward_backward(rms_norm, x, w, dy, eps)
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    y64.backward(dy.double())
    torch.testing.assert_close(dx.double(), x64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw.double(), w64.grad, atol=1e-5, rtol=1e-5)


def test_strided_rows_and_frozen_weight(triton_cpu):
    """Rows with a stride wider than the hidden size (a slice of a wider activation); no dweight
    is computed when the weight needs no grad."""
    base = torch.randn(8, 160, requires_grad=True)
    x = base[:, :96]
    assert x.stride(0) == 160
    w = torch.randn(96)
    y = rms_norm(x, w, 1e-6)
    y.sum().backward()
    ref_base = base.detach().clone().requires_grad_()
    y_ref = rms_norm_reference(ref_base[:, :96], w, 1e-6)
    y_ref.sum().backward()
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(base.grad, ref_base.grad, atol=1e-5, rtol=1e-5)
    assert w.grad is None


def test_custom_ops_pass_opcheck_and_compile(triton_cpu):
    """The ops' schemas, fake-tensor and autograd rules are consistent (torch.library.opcheck),
    and torch.compile traces the dispatcher without a graph break, giving the eager results."""
    x = torch.randn(5, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    y, rstd = torch.ops.tessera.rms_norm_fwd(x, w, 1e-6)
    torch.library.opcheck(torch.ops.tessera.rms_norm_fwd, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.tessera.rms_norm_bwd, (torch.randn_like(y), x.detach(), w.detach(), rstd.detach()))

    from tessera.kernels.rmsnorm_triton import rms_norm_triton

    compiled = torch.compile(lambda x, w: rms_norm_triton(x, w, 1e-6), backend="aot_eager", fullgraph=True)
    dy = torch.randn(5, 40)
    _, dx, dw = _forward_backward(compiled, x, w, dy, None)
    y_ref, dx_ref, dw_ref = _forward_backward(rms_norm_reference, x, w, dy, 1e-6)
    torch.testing.assert_close(compiled(x, w), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, dx_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, dw_ref, atol=1e-5, rtol=1e-5)


def test_dispatcher_leaves_the_norm_to_torch_compile(triton_cpu, spy_triton):
    """Under torch.compile the dispatcher traces the PyTorch expression (inductor fuses it with
    its neighbours); eager calls still take the kernel."""
    x = torch.randn(3, 40)
    w = torch.randn(40)
    compiled = torch.compile(lambda x, w: rms_norm(x, w, 1e-6), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w), rms_norm_reference(x, w, 1e-6))
    assert spy_triton.get("rms_norm_triton", 0) == 0
    rms_norm(x, w, 1e-6)
    assert spy_triton["rms_norm_triton"] == 1


def test_model_forward_backward_with_triton_kernels(triton_cpu, spy_triton, monkeypatch):
    """The shared model (tiny preset) gives the same loss and grads with every kernel it dispatches
    to (RMSNorm, RMSNorm fused with the residual add, RoPE on q/k, SwiGLU) as without."""
    from tessera.common.models.causal_lm.config import preset
    from tessera.common.models.causal_lm.model import build_model

    cfg = preset("tiny", vocab_size=64, num_layers=1)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))

    def loss_and_grads(model):
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    layers = cfg.num_layers
    expected_calls = {"rms_norm_triton": layers + 1, "add_rms_norm_triton": layers, "rope_qk_triton": layers,
                      "swiglu_triton": layers}
    loss_k, grads_k = loss_and_grads(build_model(cfg, seed=0))
    assert spy_triton == expected_calls
    monkeypatch.setenv("TESSERA_FORCE_TRITON", "0")  # same model through the references
    loss_r, grads_r = loss_and_grads(build_model(cfg, seed=0))
    assert spy_triton == expected_calls
    torch.testing.assert_close(loss_k, loss_r, atol=1e-5, rtol=1e-5)
    assert grads_k.keys() == grads_r.keys() and grads_k
    for name in grads_k:
        torch.testing.assert_close(grads_k[name], grads_r[name], atol=1e-5, rtol=1e-4, msg=name)


def test_dispatcher_uses_reference_on_cpu_unless_forced(monkeypatch, spy_triton):
    x, w = torch.randn(3, 32), torch.randn(32)
    expected = rms_norm_reference(x, w, 1e-6)
    for env in (
        {"TESSERA_FORCE_TRITON": None, "TRITON_INTERPRET": "1"},  # interpreter alone does not force
        {"TESSERA_FORCE_TRITON": "1", "TRITON_INTERPRET": None},  # forcing needs the interpreter on CPU
        {"TESSERA_FORCE_TRITON": "1", "TRITON_INTERPRET": "1", "TESSERA_DISABLE_TRITON": "1"},
    ):
        for key in ("TESSERA_FORCE_TRITON", "TRITON_INTERPRET", "TESSERA_DISABLE_TRITON"):
            if env.get(key) is None:
                monkeypatch.delenv(key, raising=False)
            else:
                monkeypatch.setenv(key, env[key])
        assert torch.equal(rms_norm(x, w, 1e-6), expected)
    assert "rms_norm_triton" not in spy_triton


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,wdtype", CASES + [((4096, 4096), torch.bfloat16, torch.bfloat16)])
def test_triton_matches_reference_on_cuda(triton_cuda, spy_triton, shape, dtype, wdtype):
    _check_against_reference(triton_cuda, shape, dtype, wdtype)
    assert spy_triton.get("rms_norm_triton") == 1
