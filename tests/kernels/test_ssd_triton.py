"""The Triton SSD chunked scan (tessera.kernels.ssm) against `ssd_chunk_scan_reference`: outputs,
final states and every gradient, with dt bias, softplus and limits, D, an initial state, packed
documents (`seq_idx`) and a sequence carried across two calls; and the hybrid mixer through the
Triton dispatchers against itself on the references. CPU runs use Triton's interpreter (fixture
`triton_cpu`), tiny shapes."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.kernels import ssd_chunk_scan

# The kernel sums in another order than the reference (and the backward's chain through the
# cumulative sums is long), so fp32 agrees to a few ulps relative to the largest value.
TOL = dict(atol=5e-5, rtol=1e-4)
NAMES = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state")


@pytest.fixture
def spy(monkeypatch):
    """Counts calls into the Triton scan, so a test cannot pass on the reference path."""
    from tessera.kernels.ssm import ssd_bwd_triton

    calls = {"scan": 0}
    original = ssd_bwd_triton.ssd_chunk_scan_triton

    def counted(*args, **kwargs):
        calls["scan"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(ssd_bwd_triton, "ssd_chunk_scan_triton", counted)
    return calls


def _inputs(b, T, H, P, G, N, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(b, T, H, P, generator=g).to(dtype), dt=(torch.randn(b, T, H, generator=g) * 0.5).to(dtype),
                A=-(torch.rand(H, generator=g) * 2 + 0.1), B=torch.randn(b, T, G, N, generator=g).to(dtype),
                C=torch.randn(b, T, G, N, generator=g).to(dtype), D=torch.randn(H, generator=g),
                dt_bias=torch.randn(H, generator=g) * 0.3, initial_state=torch.randn(b, H, P, N, generator=g))


def _run(monkeypatch, triton: bool, inputs: dict, chunk: int, **options):
    """(y, final, grads by name) of one forward and backward with random output gradients."""
    monkeypatch.setenv("TESSERA_FORCE_TRITON", "1" if triton else "0")
    monkeypatch.setenv("TESSERA_DISABLE_TRITON", "0" if triton else "1")  # the reference on CUDA too
    leaves = {k: v.clone().requires_grad_() if v is not None else None for k, v in inputs.items()}
    y, final = ssd_chunk_scan(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk, leaves["D"],
                              leaves["initial_state"], dt_bias=leaves["dt_bias"], **options)
    g = torch.Generator().manual_seed(7)
    ((y * torch.randn(y.shape, generator=g)).sum() + (final * torch.randn(final.shape, generator=g)).sum()).backward()
    return y.detach(), final.detach(), {k: v.grad for k, v in leaves.items() if v is not None}


def _check(monkeypatch, spy, inputs, chunk, tol=TOL, scaled=False, **options):
    """`scaled`: every tolerance relative to the largest reference value (low-precision operands)."""
    y, final, grads = _run(monkeypatch, True, inputs, chunk, **options)
    assert spy["scan"] == 1
    y_ref, final_ref, grads_ref = _run(monkeypatch, False, inputs, chunk, **options)
    assert spy["scan"] == 1 and y.dtype == torch.float32
    for got, want in ((y, y_ref), (final, final_ref)):
        atol = tol["atol"] * (max(1.0, want.abs().max().item()) if scaled else 1.0)
        torch.testing.assert_close(got, want, atol=atol, rtol=tol["rtol"])
    for name in grads_ref:
        assert grads[name].dtype == inputs[name].dtype, name
        scale = grads_ref[name].abs().max().item()  # sums over many tokens: relative to the largest
        torch.testing.assert_close(grads[name], grads_ref[name], atol=tol["atol"] * max(1.0, scale), rtol=tol["rtol"],
                                   msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("T, chunk, H, G, options", [
    (37, 8, 4, 2, dict(dt_softplus=True)),  # T not a multiple of the chunk, 2 heads per group
    (21, 6, 2, 2, dict(dt_softplus=True, dt_limit=(0.05, 0.6))),  # chunk not a power of two; limits clamp
    (75, 128, 2, 1, dict(dt_softplus=True)),  # one chunk of two row tiles, shorter than the chunk
])
def test_the_triton_scan_equals_the_reference_with_all_its_gradients(triton_cpu, monkeypatch, spy, T, chunk, H, G,
                                                                     options):
    _check(monkeypatch, spy, _inputs(1, T, H, 3, G, 5), chunk, **options)


def test_without_D_dt_bias_or_initial_state_the_triton_scan_equals_the_reference(triton_cpu, monkeypatch, spy):
    inputs = _inputs(1, 19, 2, 4, 1, 3)
    inputs.update(D=None, dt_bias=None, initial_state=None, dt=inputs["dt"].abs())
    _check(monkeypatch, spy, inputs, 8)


def test_packed_documents_reset_the_triton_scans_state_as_the_references(triton_cpu, monkeypatch, spy):
    lengths = [3, 5, 1, 20]  # boundaries inside a chunk, on an 8-token chunk edge, a one-token document
    row = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    seq_idx = torch.stack([row, torch.full_like(row, 3)]).to(torch.int32)  # and a row of one document
    _check(monkeypatch, spy, _inputs(2, 29, 2, 3, 1, 4), 8, seq_idx=seq_idx, dt_softplus=True)


def test_a_sequence_scanned_by_triton_in_two_calls_carries_its_state_exactly(triton_cpu, monkeypatch):
    monkeypatch.setenv("TESSERA_FORCE_TRITON", "1")
    i = _inputs(1, 30, 2, 3, 1, 4)
    whole, whole_final = ssd_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], 8, i["D"], dt_bias=i["dt_bias"],
                                        dt_softplus=True)
    cut = slice(0, 11), slice(11, 30)
    first, state = ssd_chunk_scan(*(i[k][:, cut[0]] if k != "A" else i[k] for k in ("x", "dt", "A", "B", "C")), 8,
                                  i["D"], dt_bias=i["dt_bias"], dt_softplus=True)
    second, final = ssd_chunk_scan(*(i[k][:, cut[1]] if k != "A" else i[k] for k in ("x", "dt", "A", "B", "C")), 8,
                                   i["D"], state, dt_bias=i["dt_bias"], dt_softplus=True)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, **TOL)
    torch.testing.assert_close(final, whole_final, **TOL)


def test_the_triton_scan_on_fp16_inputs_stays_within_fp16_rounding_of_the_reference(triton_cpu, monkeypatch, spy):
    # fp16 matmul operands (the GPU's tensor-core path): the reference keeps fp32 throughout.
    _check(monkeypatch, spy, _inputs(1, 20, 2, 4, 1, 4, dtype=torch.float16), 8, tol=dict(atol=2e-2, rtol=2e-2),
           dt_softplus=True)


def test_the_hybrid_mixer_through_the_triton_kernels_equals_it_on_the_references(triton_cpu, monkeypatch, spy):
    from tessera.common.models.hybrid.config import MambaConfig
    from tessera.common.models.hybrid.mamba import MambaMixer

    m = MambaConfig(num_heads=2, head_dim=4, state_size=4, num_groups=1, chunk_size=8, dt_limit_max=0.5)
    mixer = MambaMixer(m, 16, 1e-5)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0.0, 0.3, generator=g)
        mixer.reset_ssm_parameters(g)
    h = torch.randn(2, 13, 16, generator=g)
    seq_idx = torch.tensor([[0] * 6 + [1] * 7, [0] * 13])

    def run(triton: bool):
        monkeypatch.setenv("TESSERA_FORCE_TRITON", "1" if triton else "0")
        mixer.zero_grad()
        x = h.clone().requires_grad_()
        state = mixer.new_state(2, torch.float32)
        y = mixer(x, seq_idx=seq_idx, state=state)
        y.pow(2).sum().backward()
        with torch.no_grad():  # then two decoding steps from the prefilled state
            steps = torch.stack([mixer.step(h[:, t], state) for t in (3, 8)], 1)
        grads = {n: p.grad.clone() for n, p in mixer.named_parameters()}
        return y.detach(), x.grad, grads, steps, state

    y, dx, grads, steps, state = run(True)
    assert spy["scan"] == 1
    y_ref, dx_ref, grads_ref, steps_ref, state_ref = run(False)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(dx, dx_ref, **TOL)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-4 * max(1.0, grad.abs().max().item()), rtol=1e-4,
                                   msg=lambda msg, n=name: f"{n}: {msg}")
    torch.testing.assert_close(steps, steps_ref, **TOL)
    torch.testing.assert_close(state.ssm, state_ref.ssm, **TOL)
    for k in state.conv:
        torch.testing.assert_close(state.conv[k], state_ref.conv[k], **TOL)
    assert not math.isnan(y.sum().item())


def test_on_cpu_the_mamba_dispatchers_run_the_references_unless_forced(monkeypatch):
    pytest.importorskip("triton")
    from tessera.kernels import causal_conv1d, causal_conv1d_update, ssd_state_update
    from tessera.kernels.ssm import conv_triton, ssd_bwd_triton, state_update_triton

    def refuse(*args, **kwargs):
        raise AssertionError("a Triton kernel ran on CPU without TESSERA_FORCE_TRITON")

    for module, name in ((ssd_bwd_triton, "ssd_chunk_scan_triton"), (conv_triton, "causal_conv1d_triton"),
                         (conv_triton, "causal_conv1d_update_triton"), (state_update_triton, "ssd_state_update_triton")):
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.delenv("TESSERA_FORCE_TRITON", raising=False)
    i = _inputs(1, 5, 2, 3, 1, 4)
    ssd_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], 4, i["D"])
    causal_conv1d(torch.randn(1, 5, 3), torch.randn(3, 4))
    causal_conv1d_update(torch.randn(1, 3), torch.zeros(1, 3, 3), torch.randn(3, 4))
    ssd_state_update(torch.zeros(1, 2, 3, 4), i["x"][:, 0], i["dt"][:, 0], i["A"], i["B"][:, 0], i["C"][:, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, chunk", [(torch.float32, 128), (torch.bfloat16, 256), (torch.float16, 64)])
def test_on_cuda_the_triton_scan_equals_the_reference_at_mamba2_head_sizes(triton_cuda, monkeypatch, spy, dtype,
                                                                          chunk):
    # head_dim 64, state 128, 4 heads per group, packed documents, 600 tokens (not whole chunks).
    inputs = {k: v.cuda() for k, v in _inputs(2, 600, 8, 64, 2, 128, dtype=dtype).items()}
    row = torch.repeat_interleave(torch.arange(3), torch.tensor([100, 257, 243]))
    seq_idx = torch.stack([row, torch.zeros_like(row)]).to(torch.int32).cuda()
    tol = TOL if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)  # bf16/fp16 matmul operands
    _check(monkeypatch, spy, inputs, chunk, tol=tol, scaled=True, seq_idx=seq_idx, dt_softplus=True)
