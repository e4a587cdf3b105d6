"""oneDNN-prepacked Linear layers (tessera.inference.worker.cpu_linear) compute what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import tiny_config
from torch import nn

from tessera.common.models.causal_lm.model import build_model
from tessera.inference.worker.cpu_linear import PackedLinear, onednn_available, pack_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_a_packed_linear_equals_nn_linear_for_any_row_count(bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(2, rows, 96)
    want = linear(x)
    got = PackedLinear(linear, batch_hint=64)(x)
    assert got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.parametrize("tie", [True, False])
def test_a_packed_model_gives_the_unpacked_models_logits(tie):
    cfg = tiny_config(tie_embeddings=tie)
    model = build_model(cfg, seed=0).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        want = model(tokens)
        packed = pack_linears(model)
        got = model(tokens)
    # q, k, v, o, gate, up, down per layer; never the head (Transformer.logits reads its weight).
    assert packed == 7 * cfg.num_layers
    assert [n for n, m in model.named_modules() if type(m) is nn.Linear] == ([] if tie else ["lm_head"])
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_the_aten_backend_and_non_cpu_float_weights_are_left_alone():
    model = build_model(tiny_config(), seed=0)
    assert pack_linears(model, backend="aten") == 0
    half = build_model(tiny_config(), seed=0).to(torch.float16)
    assert pack_linears(half) == 0
