"""FP8 training (tessera.trainer.fp8): refused with one line where there are no FP8 tensor cores;
the conversion swaps the model's Linear layers for torchao Float8Linear, keeping names, and its
loss and gradients track bf16 (torchao's casts run emulated on CPU); GPU runs marked `gpu`."""

from __future__ import annotations

import pytest
import torch

from tessera.common.errors import UserError
from tessera.common.model import build_model
from tessera.common.model_config import preset
from tessera.trainer.fp8 import apply_float8, convert_to_float8, fp8_device_problem


def _model():
    return build_model(preset("tiny", vocab_size=64, num_layers=2), seed=0)


def _loss_and_grads(model, tokens):
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
        logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_fp8_is_refused_on_cpu_with_one_line():
    model = _model()
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(UserError) as err:
        apply_float8(model, "tensorwise", torch.device("cpu"))
    message = str(err.value)
    assert "\n" not in message
    assert "training.precision=fp8 needs an NVIDIA GPU with FP8 tensor cores" in message and "on cpu" in message
    assert {n: type(m) for n, m in model.named_modules()} == before, "the model was left as it was"


def test_fp8_is_refused_on_a_gpu_before_ada(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    problem = fp8_device_problem(torch.device("cuda"))
    assert problem == ("training.precision=fp8 needs compute capability 8.9+ (Ada, Hopper, Blackwell); "
                       "NVIDIA A100-SXM4-80GB is 8.0: use training.precision=bf16")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_device_problem(torch.device("cuda")) is None


def test_unknown_recipe_is_refused():
    with pytest.raises(UserError, match="training.fp8_recipe 'delayed' is not one of tensorwise, rowwise"):
        convert_to_float8(_model(), "delayed")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_conversion_swaps_the_projections_but_not_the_head_and_keeps_names(recipe):
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    model = _model()
    names = list(model.state_dict())
    weight = model.layers["0"].attn.q_proj.weight
    converted = convert_to_float8(model, recipe)
    projections = [n for n, m in _model().named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert converted == projections and len(converted) == 2 * 7  # q k v o gate up down per layer
    assert not isinstance(model.lm_head, Float8Linear)
    assert list(model.state_dict()) == names, "checkpoint names are unchanged"
    assert model.layers["0"].attn.q_proj.weight is weight, "the optimizer's parameters are the model's"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_loss_and_grads_track_bf16(recipe):
    """Emulated on CPU: the FP8 model's loss is within 1% of the bf16 model's, its projection
    gradients within 25% normwise (e4m3 keeps 3 mantissa bits; measured 0.08-0.11 here)."""
    pytest.importorskip("torchao")
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss_bf16, grads_bf16 = _loss_and_grads(_model(), tokens)
    model = _model()
    convert_to_float8(model, recipe)
    loss_fp8, grads_fp8 = _loss_and_grads(model, tokens)
    assert abs(loss_fp8 - loss_bf16) / loss_bf16 < 0.01
    for name in grads_bf16:
        if "proj" in name:
            a, b = grads_fp8[name], grads_bf16[name]
            assert (a - b).norm() / b.norm() < 0.25, name
    assert all(torch.isfinite(g).all() for g in grads_fp8.values())


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_training_steps_track_bf16_on_gpu(recipe):
    """On an FP8 GPU, compiled: 20 AdamW steps with FP8 linears stay within 2% of bf16's loss."""
    if not torch.cuda.is_available() or fp8_device_problem(torch.device("cuda")) is not None:
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability 8.9+)")
    pytest.importorskip("torchao")
    device = torch.device("cuda")
    cfg = preset("tiny", vocab_size=256, num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                 ffn_hidden_size=512)
    tokens = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0)).to(device)

    def train(fp8: bool) -> float:
        model = build_model(cfg, device=device, seed=0)
        if fp8:
            apply_float8(model, recipe, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = torch.compile(lambda: _loss_and_grads(model, tokens)[0])
        for _ in range(20):
            loss = step()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss)

    bf16, fp8 = train(False), train(True)
    assert abs(fp8 - bf16) / bf16 < 0.02
