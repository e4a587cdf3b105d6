"""RoPE on q/k and SwiGLU (Triton) against their PyTorch references: outputs and gradients.

CPU runs use Triton's interpreter (fixture `triton_cpu`); `@pytest.mark.gpu` repeats them compiled.
"""

from __future__ import annotations

import pytest
import torch

from tessera.kernels import rope_qk, rope_qk_reference, swiglu, swiglu_reference

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _rope_tables(cfg, positions):
    from tessera.common.layers.rope import RotaryEmbedding

    return RotaryEmbedding(cfg)(positions)


def _llama3_cfg(head_dim: int, max_seq_len: int = 64):
    """A config with Llama-3 scaled frequencies, so the kernel sees the tables the model uses; its
    table holds every position a case asks for (the GPU case runs 2048 positions)."""
    from tessera.common.models.causal_lm.config import preset

    return preset("tiny", vocab_size=64, num_layers=1, num_heads=4, num_kv_heads=2, hidden_size=4 * head_dim,
                  max_seq_len=max_seq_len, rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 16})


def _grads(fn, inputs, upstream):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(out, upstream)
    return [o.detach() for o in out], [t.grad for t in inputs]


ROPE_CASES = [
    # (batch, seq, q heads, kv heads, head_dim, dtype, positions per sample)
    (2, 5, 4, 2, 16, torch.float32, False),
    (1, 7, 3, 1, 24, torch.float32, True),  # head count and head_dim/2 not powers of two
    (2, 6, 8, 2, 32, torch.bfloat16, True),
]


def _check_rope(device, batch, seq, hq, hk, head_dim, dtype, per_sample):
    cfg = _llama3_cfg(head_dim, max_seq_len=max(64, seq))
    gen = torch.Generator().manual_seed(0)
    if per_sample:  # packed documents: positions restart inside a row, one table row per sample
        positions = torch.stack([torch.randperm(32, generator=gen)[:seq] for _ in range(batch)])
    else:
        positions = torch.arange(seq).unsqueeze(0)
    cos, sin = (t.to(device) for t in _rope_tables(cfg, positions))
    q = torch.randn(batch, seq, hq, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(batch, seq, hk, head_dim, generator=gen).to(device, dtype)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    got, got_grads = _grads(lambda q, k: rope_qk(q, k, cos, sin), [q, k], (dq, dk))
    want, want_grads = _grads(lambda q, k: rope_qk_reference(q, k, cos, sin), [q, k], (dq, dk))
    atol, rtol = TOLERANCES[dtype]
    for a, b in zip(got + got_grads, want + want_grads):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_kernel_matches_reference_on_cpu(triton_cpu, spy_triton, case):
    _check_rope(triton_cpu, *case)
    assert spy_triton.get("rope_qk_triton") == 1, "dispatcher did not run the Triton kernel"


def test_rope_reads_strided_heads_and_its_backward_inverts_it(triton_cpu):
    """q as a strided view (heads sliced from a wider projection); the backward is the inverse
    rotation, so for orthogonal rotations (cos^2 + sin^2 = 1) it undoes the forward."""
    cfg = _llama3_cfg(16)
    cos, sin = _rope_tables(cfg, torch.arange(5).unsqueeze(0))
    wide = torch.randn(2, 5, 6, 16)
    q, k = wide[:, :, :4], wide[:, :, 4:]
    assert not q.is_contiguous()
    got = rope_qk(q, k, cos, sin)
    want = rope_qk_reference(q, k, cos, sin)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    back = torch.ops.tessera.rope_qk(got[0], got[1], cos, sin, True)
    torch.testing.assert_close(back[0], q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(back[1], k, atol=1e-5, rtol=1e-5)


SWIGLU_CASES = [((4, 64), torch.float32), ((2, 3, 1000), torch.float32), ((3, 5, 300), torch.bfloat16)]


def _check_swiglu(device, shape, dtype):
    gen = torch.Generator().manual_seed(0)
    gate, up, dh = (torch.randn(shape, generator=gen).mul(3).to(device, dtype) for _ in range(3))
    got, got_grads = _grads(swiglu, [gate, up], (dh,))
    want, want_grads = _grads(swiglu_reference, [gate, up], (dh,))
    atol, rtol = TOLERANCES[dtype]
    for a, b in zip(got + got_grads, want + want_grads):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape,dtype", SWIGLU_CASES)
def test_swiglu_kernel_matches_reference_on_cpu(triton_cpu, spy_triton, shape, dtype):
    _check_swiglu(triton_cpu, shape, dtype)
    assert spy_triton.get("swiglu_triton") == 1, "dispatcher did not run the Triton kernel"


def test_swiglu_fp32_gradients_match_float64_autograd(triton_cpu):
    gen = torch.Generator().manual_seed(2)
    gate, up, dh = (torch.randn(6, 50, generator=gen) * 4 for _ in range(3))
    _, (dgate, dup) = _grads(swiglu, [gate, up], (dh,))
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    (g64 * torch.sigmoid(g64) * u64).backward(dh.double())
    torch.testing.assert_close(dgate.double(), g64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dup.double(), u64.grad, atol=1e-5, rtol=1e-5)


def test_custom_ops_pass_opcheck(triton_cpu):
    gate, up = torch.randn(3, 40, requires_grad=True), torch.randn(3, 40, requires_grad=True)
    torch.library.opcheck(torch.ops.tessera.swiglu_fwd, (gate, up))
    torch.library.opcheck(torch.ops.tessera.swiglu_bwd, (torch.randn(3, 40), gate.detach(), up.detach()))
    cos, sin = _rope_tables(_llama3_cfg(8), torch.arange(3).unsqueeze(0))
    q, k = torch.randn(1, 3, 2, 8, requires_grad=True), torch.randn(1, 3, 1, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.tessera.rope_qk, (q, k, cos, sin, False))


def test_dispatchers_leave_rope_and_swiglu_to_torch_compile(triton_cpu, spy_triton):
    cos, sin = _rope_tables(_llama3_cfg(8), torch.arange(3).unsqueeze(0))
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8)
    gate, up = torch.randn(3, 40), torch.randn(3, 40)

    def f(q, k, gate, up):
        return (*rope_qk(q, k, cos, sin), swiglu(gate, up))

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, gate, up)
    want = (*rope_qk_reference(q, k, cos, sin), swiglu_reference(gate, up))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert not spy_triton


@pytest.mark.gpu
@pytest.mark.parametrize("case", ROPE_CASES + [(4, 2048, 32, 8, 128, torch.bfloat16, False)])
def test_rope_kernel_matches_reference_on_cuda(triton_cuda, spy_triton, case):
    _check_rope(triton_cuda, *case)
    assert spy_triton.get("rope_qk_triton") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", SWIGLU_CASES + [((8192, 8192), torch.bfloat16)])
def test_swiglu_kernel_matches_reference_on_cuda(triton_cuda, spy_triton, shape, dtype):
    _check_swiglu(triton_cuda, shape, dtype)
    assert spy_triton.get("swiglu_triton") == 1
