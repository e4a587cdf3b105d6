"""The eager CPU paths of the RoPE and RMSNorm dispatchers (serving: fp32, no autograd) give the
references' values bit for bit, and training (autograd) and mixed dtypes keep the references."""

from __future__ import annotations

import pytest
import torch

from tessera.kernels import (
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
    rope_qk,
    rope_qk_reference,
)
from tessera.kernels import rmsnorm as rmsnorm_module
from tessera.kernels import rope as rope_module


def _tables(head_dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from tessera.common.model import RotaryEmbedding
    from tessera.common.model_config import preset

    cfg = preset("tiny", vocab_size=64, num_layers=1, num_heads=4, num_kv_heads=2, hidden_size=4 * head_dim,
                 max_seq_len=64, rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 16})
    return RotaryEmbedding(cfg)(positions)


@pytest.fixture
def eager_calls(monkeypatch):
    calls = {"rope": 0, "norm": 0}

    def spy(name, module, attr):
        real = getattr(module, attr)

        def wrapped(*args):
            calls[name] += 1
            return real(*args)
        monkeypatch.setattr(module, attr, wrapped)

    spy("rope", rope_module, "rope_qk_eager")
    spy("norm", rmsnorm_module, "rms_norm_eager")
    return calls


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("batch,seq,hq,hk,head_dim", [(1, 8, 8, 2, 64), (2, 5, 3, 1, 24)])
def test_cpu_rope_equals_the_reference_bit_for_bit(eager_calls, stacked, batch, seq, hq, hk, head_dim):
    g = torch.Generator().manual_seed(0)
    positions = torch.stack([torch.randperm(64, generator=g)[:seq] for _ in range(batch)])
    cos, sin = _tables(head_dim, positions)
    if stacked:  # slices of one q/k/v projection output, as the serving engine's merged GEMM gives
        qkv = torch.randn(batch, seq, (hq + 2 * hk) * head_dim, generator=g)
        q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
        q, k = q.view(batch, seq, hq, head_dim), k.view(batch, seq, hk, head_dim)
    else:
        q, k = torch.randn(batch, seq, hq, head_dim, generator=g), torch.randn(batch, seq, hk, head_dim, generator=g)
    with torch.inference_mode():
        got = rope_qk(q, k, cos, sin)
    want = rope_qk_reference(q, k, cos, sin)
    assert eager_calls["rope"] == 1
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_cpu_rope_signs_each_sin_table_once_and_never_reuses_another_tables(eager_calls):
    # Every layer of a forward passes the same table; the next forward passes a new one.
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 4, 16, generator=g), torch.randn(1, 4, 2, 16, generator=g)
    tables = [_tables(16, torch.tensor([p])) for p in ([0, 1, 2, 3], [7, 9, 11, 13], [0, 1, 2, 3])]
    with torch.inference_mode():
        for cos, sin in tables:
            for _layer in range(2):
                got = rope_qk(q, k, cos, sin)
                for a, b in zip(got, rope_qk_reference(q, k, cos, sin), strict=True):
                    assert torch.equal(a, b)
    assert eager_calls["rope"] == 6


def test_training_rope_and_norms_keep_the_references(eager_calls):
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    k = torch.randn(1, 3, 1, 8)
    cos, sin = _tables(8, torch.arange(3).unsqueeze(0))
    x, w = torch.randn(3, 32, requires_grad=True), torch.randn(32)
    rope_qk(q, k, cos, sin)[0].sum().backward()
    rms_norm(x, w, 1e-6).sum().backward()
    add_rms_norm(x, torch.randn(3, 32), w, 1e-6)[1].sum().backward()
    assert eager_calls == {"rope": 0, "norm": 0}
    with torch.no_grad():  # bf16 q: the reference computes in fp32 and rounds once
        rope_qk(q.detach().bfloat16(), k.bfloat16(), cos, sin)
    assert eager_calls["rope"] == 0


@pytest.mark.parametrize("shape,dtype", [((1, 8, 512), torch.float32), ((1, 64, 512), torch.float32),
                                         ((5, 3, 100), torch.float32)])
def test_cpu_rms_norms_equal_the_references_bit_for_bit(eager_calls, shape, dtype):
    g = torch.Generator().manual_seed(2)
    x, r = (torch.randn(shape, generator=g).mul(3).to(dtype) for _ in range(2))
    w = torch.randn(shape[-1], generator=g).to(dtype)
    with torch.inference_mode():
        got = rms_norm(x, w, 1e-5)
        got_s, got_n = add_rms_norm(x, r, w, 1e-5)
    want_s, want_n = add_rms_norm_reference(x, r, w, 1e-5)
    assert eager_calls["norm"] == 2
    assert torch.equal(got, rms_norm_reference(x, w, 1e-5)) and torch.equal(got_s, want_s) and torch.equal(got_n, want_n)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_bf16_norms_keep_the_reference(eager_calls, wdtype):
    # A bf16 x with an fp32 weight promotes to fp32 in the reference; with a bf16 weight torch's
    # rms_norm differs from it in the last bit.
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(64).to(wdtype)
    with torch.inference_mode():
        got = rms_norm(x, w, 1e-6)
    assert eager_calls["norm"] == 0
    assert torch.equal(got, rms_norm_reference(x, w, 1e-6))
