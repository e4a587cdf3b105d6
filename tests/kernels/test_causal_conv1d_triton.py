"""The Triton causal conv1d (tessera.kernels.ssm.conv_triton) against `causal_conv1d_reference`:
y, the final state and the gradients of x, weight, bias and the initial state, over packed
documents; and its in-place one-token update over a slot-indexed pool against the reference
update. CPU runs use Triton's interpreter (fixture `triton_cpu`), tiny shapes."""

from __future__ import annotations

import pytest
import torch

from tessera.kernels import causal_conv1d, causal_conv1d_update

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture
def spy(monkeypatch):
    """Counts calls into the Triton entry points, so a test cannot pass on the reference path."""
    from tessera.kernels.ssm import conv_triton

    calls = {}
    for name in ("causal_conv1d_triton", "causal_conv1d_update_triton"):
        def counted(*args, _name=name, _original=getattr(conv_triton, name), **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(conv_triton, name, counted)
    return calls


def _run(monkeypatch, triton: bool, x, w, bias, init, seq_idx, silu):
    monkeypatch.setenv("TESSERA_FORCE_TRITON", "1" if triton else "0")
    monkeypatch.setenv("TESSERA_DISABLE_TRITON", "0" if triton else "1")  # the reference on CUDA too
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w, bias, init)]
    y, last = causal_conv1d(leaves[0], leaves[1], leaves[2], seq_idx, leaves[3], silu)
    g = torch.Generator().manual_seed(3)
    ((y * torch.randn(y.shape, generator=g)).sum() + (last * torch.randn(last.shape, generator=g)).sum()).backward()
    return [y.detach(), last.detach()] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("T, channels, with_docs, bias, silu", [
    (37, 70, False, True, True),  # two tiles of tokens and of channels
    (9, 5, True, True, True),  # documents of 2, 5, 2 tokens
    (2, 5, True, False, False),  # shorter than the window: the final state reaches into the initial state
])
def test_the_triton_convolution_equals_the_reference_with_its_gradients(triton_cpu, monkeypatch, spy, T, channels,
                                                                        with_docs, bias, silu):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, T, channels, generator=g), torch.randn(channels, 4, generator=g)
    b, init = torch.randn(channels, generator=g) if bias else None, torch.randn(2, channels, 3, generator=g)
    seq_idx = None
    if with_docs:  # the second row: one document, so its initial state is read
        first = torch.tensor([0, 0, 1, 1, 1, 1, 1, 2, 2][:T]) if T == 9 else torch.tensor([0, 1])
        seq_idx = torch.stack([first, torch.full_like(first, 5)]).to(torch.int32)
    got = _run(monkeypatch, True, x, w, b, init, seq_idx, silu)
    want = _run(monkeypatch, False, x, w, b, init, seq_idx, silu)
    assert spy == {"causal_conv1d_triton": 1}
    for name, a, r in zip(("y", "final state", "dx", "dweight", "dbias", "dinit"), got, want):
        torch.testing.assert_close(a, r, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_the_triton_update_moves_only_its_slots_windows_and_decodes_what_the_whole_sequence_gives(
        triton_cpu, monkeypatch, spy):
    monkeypatch.setenv("TESSERA_FORCE_TRITON", "1")
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 6, 70, generator=g), torch.randn(70, 4, generator=g), torch.randn(70, generator=g)
    whole, last = causal_conv1d(x, w, b)
    pool = torch.full((5, 70, 3), float("nan"))  # slots nobody owns hold NaN: reading one fails the test
    pool[[3, 0]] = 0.0
    slots = torch.tensor([3, -1, 0], dtype=torch.int32)  # a padding row between the two sequences
    steps = []
    for t in range(6):
        xt = torch.stack([x[0, t], torch.randn(70, generator=g), x[1, t]])
        y = causal_conv1d_update(xt, pool, w, b, state_indices=slots)
        assert (y[1] == 0).all()
        steps.append(y[[0, 2]])
    assert spy == {"causal_conv1d_triton": 1, "causal_conv1d_update_triton": 6}
    torch.testing.assert_close(torch.stack(steps, 1), whole, **TOL)
    torch.testing.assert_close(pool[[3, 0]], last, atol=0, rtol=0)
    assert pool[[1, 2, 4]].isnan().all()
    monkeypatch.setenv("TESSERA_FORCE_TRITON", "0")  # the reference update does the same in place
    ref_pool = torch.zeros(2, 70, 3)
    for t in range(6):
        ref_y = causal_conv1d_update(x[:, t], ref_pool, w, b)
    torch.testing.assert_close(ref_y, whole[:, -1], **TOL)
    torch.testing.assert_close(ref_pool, last, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_triton_convolution_equals_the_reference(triton_cuda, monkeypatch, dtype):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 1000, 5376, generator=g), torch.randn(5376, 4, generator=g) * 0.5
    b, init = torch.randn(5376, generator=g), torch.randn(2, 5376, 3, generator=g)
    x, w, b, init = (t.to("cuda", dtype) for t in (x, w, b, init))
    seq_idx = torch.repeat_interleave(torch.arange(2), torch.tensor([333, 667]))[None].expand(2, -1).to("cuda")
    got = _run(monkeypatch, True, x, w, b, init, seq_idx, True)
    want = _run(monkeypatch, False, x, w, b, init, seq_idx, True)
    # bf16: the kernel accumulates in fp32 where the reference rounds after every tap.
    tol = TOL if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for name, a, r in zip(("y", "final state", "dx", "dweight", "dbias", "dinit"), got, want):
        scale = max(1.0, r.abs().max().item()) if name in ("dweight", "dbias") else 1.0
        torch.testing.assert_close(a.float(), r.float(), atol=tol["atol"] * scale, rtol=tol["rtol"],
                                   msg=lambda m, n=name: f"{n}: {m}")
