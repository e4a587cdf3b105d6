"""The Triton decoding state update (tessera.kernels.ssm.state_update_triton) against
`ssd_state_update_reference`: slot-indexed pools with padding rows, dt bias/softplus/limits, D
and z gating; and decoding token by token equals the chunked scan. CPU runs use Triton's
interpreter (fixture `triton_cpu`), tiny shapes."""

from __future__ import annotations

import pytest
import torch

from tessera.kernels import ssd_chunk_scan, ssd_state_update

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture
def spy(monkeypatch):
    """Counts calls into the Triton update, so a test cannot pass on the reference path."""
    from tessera.kernels.ssm import state_update_triton

    calls = {"update": 0}
    original = state_update_triton.ssd_state_update_triton

    def counted(*args, **kwargs):
        calls["update"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(state_update_triton, "ssd_state_update_triton", counted)
    return calls


def _step_inputs(b, H, P, G, N, g):
    return dict(x=torch.randn(b, H, P, generator=g), dt=torch.randn(b, H, generator=g), A=-torch.rand(H, generator=g),
                B=torch.randn(b, G, N, generator=g), C=torch.randn(b, G, N, generator=g), D=torch.randn(H, generator=g),
                z=torch.randn(b, H, P, generator=g), dt_bias=torch.randn(H, generator=g))


def test_the_triton_state_update_advances_only_its_slots_as_the_reference(triton_cpu, monkeypatch, spy):
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(6, 4, 5, 6, generator=g)
    slots = torch.tensor([4, -1, 1], dtype=torch.int32)
    i = _step_inputs(3, 4, 5, 2, 6, g)
    out = {}
    for triton in (True, False):
        monkeypatch.setenv("TESSERA_FORCE_TRITON", "1" if triton else "0")
        monkeypatch.setenv("TESSERA_DISABLE_TRITON", "0" if triton else "1")
        states = pool.clone()
        y = ssd_state_update(states, **i, dt_softplus=True, dt_limit=(0.05, 1.0), state_indices=slots)
        out[triton] = y, states
    assert spy["update"] == 1
    torch.testing.assert_close(out[True][0], out[False][0], **TOL)
    torch.testing.assert_close(out[True][1], out[False][1], **TOL)
    assert (out[True][0][1] == 0).all()  # the padding row
    untouched = [0, 2, 3, 5]
    assert torch.equal(out[True][1][untouched], pool[untouched])
    assert not torch.equal(out[True][1][[4, 1]], pool[[4, 1]])


def test_decoding_with_the_triton_update_equals_the_triton_chunked_scan(triton_cpu, monkeypatch, spy):
    monkeypatch.setenv("TESSERA_FORCE_TRITON", "1")
    g = torch.Generator().manual_seed(1)
    b, T, H, P, G, N = 2, 7, 2, 3, 1, 4
    x, dt = torch.randn(b, T, H, P, generator=g), torch.randn(b, T, H, generator=g)
    A, B, C, D = -torch.rand(H, generator=g), torch.randn(b, T, G, N, generator=g), torch.randn(b, T, G, N, generator=g), \
        torch.randn(H, generator=g)
    bias, init = torch.randn(H, generator=g), torch.randn(b, H, P, N, generator=g)
    y, final = ssd_chunk_scan(x, dt, A, B, C, 4, D, init, dt_bias=bias, dt_softplus=True)
    pool = torch.zeros(3, H, P, N)
    pool[[2, 0]] = init
    slots = torch.tensor([2, 0], dtype=torch.int32)
    steps = [ssd_state_update(pool, x[:, t], dt[:, t], A, B[:, t], C[:, t], D, dt_bias=bias, dt_softplus=True,
                              state_indices=slots) for t in range(T)]
    assert spy["update"] == T
    torch.testing.assert_close(torch.stack(steps, 1), y, **TOL)
    torch.testing.assert_close(pool[[2, 0]], final, **TOL)
    assert (pool[1] == 0).all()


@pytest.mark.gpu
def test_on_cuda_the_triton_state_update_equals_the_reference_on_a_pool(triton_cuda, monkeypatch, spy):
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(64, 80, 64, 128, generator=g)
    slots = torch.randperm(64, generator=g)[:33].to(torch.int32)
    slots[5] = -1
    i = _step_inputs(33, 80, 64, 1, 128, g)
    out = {}
    for triton in (True, False):
        monkeypatch.setenv("TESSERA_DISABLE_TRITON", "0" if triton else "1")
        states = pool.cuda()
        y = ssd_state_update(states, **{k: v.cuda() for k, v in i.items()}, dt_softplus=True,
                             state_indices=slots.cuda())
        out[triton] = y.cpu(), states.cpu()
    assert spy["update"] == 1
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-5, rtol=1e-5)
