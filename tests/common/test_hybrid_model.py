"""The hybrid model (tessera.common.models.hybrid): the Mamba-2 mixer decodes token by token
exactly what its chunked scan computes, packed documents run as if alone, the config refuses
what it cannot build in one line naming the field, and its counts match the module."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from tessera.common.models.hybrid.config import HybridConfig, MambaConfig
from tessera.common.models.hybrid.mamba import MambaMixer
from tessera.common.models.hybrid.model import build_model

MAMBA = dict(num_heads=4, head_dim=8, state_size=6, num_groups=2, chunk_size=8)


def tiny(pattern: str = "M-*EM", **over) -> HybridConfig:
    fields = dict(vocab_size=64, hidden_size=32, num_layers=len(pattern), pattern=pattern, mamba=MAMBA,
                  num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                  moe=dict(num_experts=4, top_k=2, ffn_hidden_size=16, score="sigmoid", num_shared_experts=1,
                           bias_balancing=True))
    return HybridConfig.model_validate({**fields, **over})


def _mixer(**over) -> MambaMixer:
    m = MambaConfig.model_validate({**MAMBA, **over})
    mixer = MambaMixer(m, 32, 1e-5)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mixer.parameters():  # everything random, norms and biases included, so nothing hides
            p.normal_(0.0, 0.3, generator=g)
        mixer.reset_ssm_parameters(g)
        mixer.D.normal_(0.0, 1.0, generator=g)
    return mixer.eval()


@pytest.mark.parametrize("over", [{}, {"conv_bias": False, "bias": True, "dt_limit_min": 0.05, "dt_limit_max": 0.2}])
def test_decoding_token_by_token_equals_the_chunked_scan_of_the_whole_sequence(over):
    mixer = _mixer(**over)
    h = torch.randn(2, 19, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = mixer(h)
        state = mixer.new_state(2, h.dtype)
        steps = torch.stack([mixer.step(h[:, t], state) for t in range(19)], 1)
        torch.testing.assert_close(steps, whole, atol=1e-5, rtol=1e-5)
        # Chunked prefill: two calls carrying the state, then decoding on from it.
        carried = mixer.new_state(2, h.dtype)
        parts = torch.cat([mixer(h[:, :7], state=carried), mixer(h[:, 7:], state=carried)], 1)
        torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)
        for k in carried.conv:
            torch.testing.assert_close(carried.conv[k], state.conv[k], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(carried.ssm, state.ssm, atol=1e-5, rtol=1e-5)


def test_the_state_of_a_sequence_does_not_grow_with_its_length():
    mixer = _mixer()
    state = mixer.new_state(1, torch.float32)
    sizes = []
    with torch.no_grad():
        for n in (3, 50):
            mixer(torch.randn(1, n, 32), state=state)
            sizes.append(sum(t.numel() for t in (*state.conv.values(), state.ssm)))
    assert sizes[0] == sizes[1] == 4 * 8 * 6 + (32 + 2 * 12) * 3


def test_packed_documents_give_each_document_what_it_gives_alone():
    cfg = tiny()
    model = build_model(cfg, seed=0).eval()
    lengths = [5, 9, 1, 11]  # a boundary on a chunk edge is not needed: the scan tests cover them
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 64, (1, sum(lengths)), generator=g)
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = model(tokens, document_ids=docs)
        unpacked = model(tokens)
        start = 0
        for n in lengths:
            alone = model(tokens[:, start:start + n])
            torch.testing.assert_close(packed[:, start:start + n], alone, atol=1e-5, rtol=1e-5)
            start += n
    assert not torch.allclose(packed[:, 5:], unpacked[:, 5:], atol=1e-3)  # the documents did see each other unpacked


@pytest.mark.parametrize("over, message", [
    (dict(pattern="M-X*E"), "pattern: 'X' (layer 2) is not a layer symbol; use M (Mamba-2), * (attention), - (MLP), "
                            "E (MoE)"),
    (dict(num_layers=6), "pattern: 5 symbols for num_layers=6; give one symbol per layer"),
    (dict(mamba={**MAMBA, "num_groups": 3}), "num_groups (3) must divide num_heads (4)"),
    (dict(num_kv_heads=3), "num_kv_heads (3) must divide num_heads (4)"),
    (dict(mamba=None), "mamba: the pattern has Mamba-2 layers (M) but no mamba section"),
    (dict(num_heads=None), "num_heads: the pattern has attention layers (*) but no num_heads"),
    (dict(ffn_hidden_size=None), "ffn_hidden_size: the pattern has MLP layers (-) but no ffn_hidden_size"),
    (dict(moe=None), "moe: the pattern has MoE layers (E) but no moe section"),
])
def test_a_config_the_model_cannot_build_is_refused_naming_the_field(over, message):
    with pytest.raises(ValidationError) as exc:
        tiny(**over)
    assert exc.value.error_count() == 1 and message in str(exc.value), str(exc.value)


def test_the_parameter_count_and_flops_follow_the_built_model():
    for cfg in (tiny(), tiny("MM", tie_embeddings=True, mamba={**MAMBA, "bias": True, "conv_bias": False})):
        model = build_model(cfg, seed=0)
        assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    cfg = tiny("M*-")  # dense: FLOPs = 6 x every matmul weight (the head's included) + attention + conv + scan
    model = build_model(cfg, seed=0)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    m = cfg.mamba
    conv = 2 * m.conv_kernel * (m.num_heads * m.head_dim + 2 * m.num_groups * m.state_size)
    scan = 2 * 8 * m.num_groups * m.state_size + m.num_heads * (2 * 8 * m.head_dim + 4 * m.head_dim * m.state_size)
    assert cfg.flops_per_token(100) == 6 * matmul + 12 * 32 * 100 + 3 * (conv + scan)


@pytest.mark.parametrize("gated", [True, False])
def test_the_grouped_gemm_experts_equal_the_expert_loop_for_swiglu_and_squared_relu(monkeypatch, gated):
    # The grouped path runs on CUDA sm90+ in bf16; torch._grouped_mm also runs forward on CPU, so
    # both paths are compared here (squared-ReLU experts have no gate_proj).
    from tessera.common.layers import moe

    experts = moe.Experts(4, 16, 8, gated)
    g = torch.Generator().manual_seed(0)
    for p in experts.parameters():
        torch.nn.init.normal_(p, generator=g)
    x, counts = torch.randn(10, 16, generator=g), [3, 0, 5, 2]  # an expert with no tokens
    loop = experts(x, counts)
    monkeypatch.setattr(moe, "_grouped_mm_ok", lambda _x: True)
    torch.testing.assert_close(experts(x, counts), loop, atol=1e-5, rtol=1e-5)
