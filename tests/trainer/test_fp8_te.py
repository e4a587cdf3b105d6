"""FP8 through Transformer Engine (training.fp8_backend: te, tessera.trainer.components.precision.te_float8): refused with
one line, exit 2, before any work, where TE cannot be imported, the machine or the recipe cannot
run it, or a composition cannot be made correct; the swap keeps names, Parameters and state dicts
those of nn.Linear (checkpoints interchange with bf16 and torchao runs); Precision enters TE's
autocast inside torch's. TE needs CUDA, so the runs themselves (parity with torchao and bf16, a
checkpoint round trip, the trainer end to end) are marked `gpu` and skip without TE."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from test_bad_input import run_expect_usage_error
from torch import nn

from tessera.common.errors import ArtifactError, UserError
from tessera.common.models.causal_lm.config import preset
from tessera.common.models.causal_lm.model import build_model
from tessera.trainer.components.precision import te_float8
from tessera.trainer.components.precision.mixed import Precision

TE_LINE = "training.fp8_backend=te needs NVIDIA Transformer Engine, which cannot be imported here"


@pytest.fixture
def no_te(monkeypatch):
    """transformer_engine.pytorch fails to import (absent, or installed without its CUDA libraries)."""
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)


def _model(**overrides):
    return build_model(preset("tiny", vocab_size=64, num_layers=2, **overrides), seed=0)


# ---- refusals: one line, exit 2, nothing written -------------------------------------------------


def test_te_backend_without_transformer_engine_is_refused_with_one_line_naming_the_extra(make_config, capsys,
                                                                                          tmp_path, no_te):
    err = run_expect_usage_error(["--config", str(make_config()), "training.precision=fp8",
                                  "training.fp8_backend=te"], capsys)
    assert TE_LINE in err and "pip install 'tessera-trainer[te]'" in err
    assert not (tmp_path / "run").exists(), "refused before any work"


@pytest.mark.parametrize("overrides, expected", [
    (["training.fp8_backend=te"], "training.fp8_backend=te is for training.precision=fp8 (this run is fp32)"),
    (["training.precision=fp8", "training.fp8_backend=te", "training.fp8_recipe=rowwise"],
     "training.fp8_recipe=rowwise has no Transformer Engine recipe"),
    (["training.precision=fp8", "training.fp8_recipe=blockwise"],
     "training.fp8_recipe=blockwise is a Transformer Engine recipe: set training.fp8_backend=te"),
    (["training.precision=fp8", "training.fp8_recipe=mxfp8"],
     "training.fp8_recipe=mxfp8 is a Transformer Engine recipe"),
    (["training.precision=fp8", "training.fp8_backend=te", "training.compile=true"],
     "training.fp8_backend=te does not compose with training.compile"),
    (["training.precision=fp8", "training.fp8_backend=te", "training.recompute=full"],
     "training.fp8_backend=te does not compose with training.recompute=full"),
    (["training.precision=fp8", "training.fp8_backend=te", "training.micro_batch_size=1", "training.seq_length=20"],
     "training.micro_batch_size x training.seq_length (1 x 20) to be a multiple of 8"),
    (["training.precision=fp8", "training.fp8_backend=te", "parallel.tensor=2"],
     "training.fp8_backend=te runs in one process (here: 2)"),
    (["training.precision=fp8", "training.fp8_backend=te", "parallel.pipeline=2"],
     "use training.fp8_backend=torchao under torchrun"),
])
def test_te_compositions_it_cannot_run_are_refused_before_any_work(make_config, capsys, tmp_path, overrides, expected):
    err = run_expect_usage_error(["--config", str(make_config()), *overrides], capsys)
    assert expected in err
    assert not (tmp_path / "run").exists()


def test_mxfp8_needs_tokens_in_multiples_of_32_where_the_others_need_8():
    """te.Linear's own check (TE 2.9 utils.assert_dim_for_fp8_exec) asks 8 tokens; MXFP8 blocks of 32."""
    assert te_float8.te_config_problem("tensorwise", False, "none", 1, 40) is None
    assert te_float8.te_config_problem("blockwise", False, "none", 1, 40) is None
    assert "(1 x 48) to be a multiple of 32 (TE's mxfp8 GEMMs)" in te_float8.te_config_problem("mxfp8", False, "none", 1,
                                                                                             48)


MXFP8_LAYER_LINE = ("training.fp8_recipe=mxfp8 needs the linear layers' dimensions to be multiples of 32; "
                    "layers.0.mlp.gate_proj is 64 -> 176: use training.fp8_recipe=tensorwise")


def test_mxfp8_refuses_a_layer_whose_dimensions_are_not_multiples_of_32_in_the_config(make_config, capsys, tmp_path,
                                                                                      monkeypatch):
    """From the model config, before anything is built (no model, no TE import: check_inputs refuses it)."""
    monkeypatch.setattr(te_float8, "import_te", lambda: pytest.fail("refused before TE is imported"))
    config = make_config(model={"hidden_size": 64, "ffn_hidden_size": 176})  # 11 x 16: FP8-eligible, not MXFP8-able
    err = run_expect_usage_error(["--config", str(config), "training.precision=fp8", "training.fp8_backend=te",
                                  "training.fp8_recipe=mxfp8"], capsys)
    assert MXFP8_LAYER_LINE in err
    assert not (tmp_path / "run").exists()


def test_convert_to_te_refuses_the_same_layers_before_swapping_any(monkeypatch):
    monkeypatch.setattr(te_float8, "import_te", lambda: None)
    model = _model()  # the tiny preset's MLP width, 176
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(UserError, match="^" + MXFP8_LAYER_LINE):
        te_float8.convert_to_te(model, "mxfp8")
    assert {n: type(m) for n, m in model.named_modules()} == before


# transformer_engine.common.recipe.Format (TE 2.9+): each member's largest forward and backward
# (gradient) values, i.e. the float8 dtype of each direction: 448 is e4m3's, 57344 e5m2's.
_TE_FORMAT_MAX = {"E4M3": (448.0, 448.0), "HYBRID": (448.0, 57344.0)}


def test_tensorwise_under_te_casts_gradients_to_the_float8_dtype_torchaos_tensorwise_does():
    torchao_float8 = pytest.importorskip("torchao.float8")
    ao = torchao_float8.Float8LinearConfig.from_recipe_name("tensorwise")
    max_fwd, max_bwd = _TE_FORMAT_MAX[te_float8.TE_RECIPES["tensorwise"].fp8_format]
    assert max_bwd == torch.finfo(ao.cast_config_grad_output.target_dtype).max
    assert max_fwd == torch.finfo(ao.cast_config_input.target_dtype).max
    assert max_fwd == torch.finfo(ao.cast_config_weight.target_dtype).max


def test_te_recipe_builds_each_recipe_with_the_format_of_its_table_row(monkeypatch):
    """te_recipe against a stand-in of transformer_engine.common.recipe (TE needs CUDA)."""
    made = types.SimpleNamespace(Format=types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID"))
    for name in ("Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"):
        setattr(made, name, lambda fp8_format, name=name: (name, fp8_format))
    common = types.ModuleType("transformer_engine.common")
    common.recipe = made
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", made)
    assert {name: te_float8.te_recipe(name) for name in te_float8.TE_RECIPES} == {
        "tensorwise": ("Float8CurrentScaling", "HYBRID"),
        "blockwise": ("Float8BlockScaling", "E4M3"),
        "mxfp8": ("MXFP8BlockScaling", "E4M3"),
    }


def test_te_accepts_selective_recompute_whose_region_has_no_linear_layer():
    from tessera.trainer.config import TrainingConfig

    t = TrainingConfig(precision="fp8", fp8_backend="te", recompute="selective", fp8_recipe="blockwise")
    assert te_float8.te_config_problem(t.fp8_recipe, t.compile, t.recompute, t.micro_batch_size, t.seq_length) is None


def test_te_under_torchrun_is_refused_before_the_import_and_the_device():
    problem = te_float8.te_problem("tensorwise", torch.device("cuda"), world_size=2)
    assert problem.startswith("training.fp8_backend=te runs in one process (here: 2)") and "\n" not in problem


def test_a_transformer_engine_that_fails_to_import_gives_its_reason_in_the_line(no_te):
    problem = te_float8.te_problem("tensorwise", torch.device("cpu"))
    assert problem.startswith(TE_LINE) and "halted" in problem and "\n" not in problem
    with pytest.raises(UserError, match=TE_LINE):
        te_float8.convert_to_te(_model())


def _fake_te(monkeypatch, block_scaling: tuple[bool, str]):
    """transformer_engine.pytorch's availability checks, as TE documents them (return_reason=True ->
    (bool, reason)), on a CUDA device of capability 9.0."""
    te = types.SimpleNamespace(is_fp8_available=lambda return_reason=False: (True, ""),
                               is_fp8_block_scaling_available=lambda return_reason=False: block_scaling,
                               is_mxfp8_available=lambda return_reason=False: (
                                   False, "Device compute capability 10.0 or higher required for MXFP8 execution."))
    monkeypatch.setattr(te_float8, "import_te", lambda: te)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")


def test_the_device_check_is_the_torchao_paths_and_each_recipe_gets_tes_own(monkeypatch):
    _fake_te(monkeypatch, (False, "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."))
    assert te_float8.te_problem("tensorwise", torch.device("cpu")).startswith(
        "training.precision=fp8 needs an NVIDIA GPU with FP8 tensor cores"), "fp8.fp8_device_problem's line"
    cuda = torch.device("cuda")
    assert te_float8.te_problem("tensorwise", cuda) is None
    assert te_float8.te_problem("blockwise", cuda) == (
        "training.fp8_recipe=blockwise is not available on NVIDIA H100 80GB HBM3 (Transformer Engine: FP8 block "
        "scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9.); use training.fp8_recipe=tensorwise")
    assert "Device compute capability 10.0 or higher required for MXFP8" in te_float8.te_problem("mxfp8", cuda)


def test_every_recipe_and_backend_the_config_offers_is_one_of_the_float8_interface():
    from typing import get_args

    from tessera.trainer.components.precision.float8 import float8_backend
    from tessera.trainer.config import TrainingConfig

    backends = get_args(TrainingConfig.model_fields["fp8_backend"].annotation)
    offered = set(get_args(TrainingConfig.model_fields["fp8_recipe"].annotation))
    assert offered == {recipe for name in backends for recipe in float8_backend(name).recipes}
    assert float8_backend("te").recipes == tuple(te_float8.TE_RECIPES)
    assert te_float8.te_recipe_problem("tensorwise") is None and te_float8.te_recipe_problem("rowwise") is not None


# ---- the swap: names, Parameters and state dicts of nn.Linear ------------------------------------


class _StandIn(nn.Module):
    """In place of transformer_engine.pytorch.Linear (which needs CUDA): what the swap relies on of
    it. Holds the Linear's Parameters, and has TE's extra state: an empty uint8 tensor under a
    stateless recipe (TransformerEngineBaseModule.get_extra_state)."""

    def __init__(self, linear: nn.Linear, extra: torch.Tensor | None = None):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.extra = torch.empty(0, dtype=torch.uint8) if extra is None else extra

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = state
        self.loaded_extra_state = True


def test_swap_keeps_names_parameters_and_state_dict_of_nn_linear():
    model, plain = _model(), _model()
    params = dict(model.named_parameters())
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    swapped = te_float8.swap_linears(model, _StandIn)
    projections = [n for n, m in plain.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    assert swapped == projections and len(swapped) == 2 * 7, "same eligibility as torchao's (fp8.eligible)"
    assert isinstance(model.layers["0"].attn.q_proj, _StandIn) and type(model.lm_head) is nn.Linear
    assert dict(model.named_parameters()) == params, "the optimizer's Parameters, under the same names"
    assert list(model.state_dict()) == list(plain.state_dict()), "no _extra_state keys in checkpoints"
    assert torch.equal(model(tokens), plain(tokens))
    # A bf16/torchao run's weights load strictly, and back.
    fresh = build_model(preset("tiny", vocab_size=64, num_layers=2), seed=1)
    model.load_state_dict(fresh.state_dict(), strict=True)
    assert torch.equal(model.layers["1"].mlp.down_proj.weight, fresh.layers["1"].mlp.down_proj.weight)
    plain.load_state_dict(model.state_dict(), strict=True)


def test_layers_with_dimensions_not_multiples_of_16_stay_linear():
    model = _model(ffn_hidden_size=40)
    swapped = te_float8.swap_linears(model, _StandIn)
    assert swapped == [f"layers.{i}.attn.{p}_proj" for i in range(2) for p in "qkvo"]
    assert type(model.layers["0"].mlp.gate_proj) is nn.Linear and type(model.layers["1"].mlp.down_proj) is nn.Linear


def test_tes_pickled_extra_state_of_older_versions_stays_out_of_checkpoints_too():
    """TE 2.9-2.17.0 save a stateless recipe's settings as a pickle (bytes in a uint8 tensor) instead
    of an empty tensor: dropped as well, so no checkpoint holds a pickle or an extra key."""
    model, plain = _model(), _model()
    te_float8.swap_linears(model, lambda linear: _StandIn(linear, extra=torch.ones(8, dtype=torch.uint8)))
    assert list(model.state_dict()) == list(plain.state_dict())


def test_extra_state_in_a_state_dict_never_reaches_tes_set_extra_state():
    """TE 2.9-2.17.0's set_extra_state unpickles what it is given: a pickled blob under
    `<layer>._extra_state` is refused with one line naming the key; an empty one (TE 2.17.1+'s) is
    dropped. Neither reaches set_extra_state."""
    import pickle

    model = _model()
    te_float8.swap_linears(model, _StandIn)
    blob = torch.frombuffer(bytearray(pickle.dumps({"recipe": "anything"})), dtype=torch.uint8)
    state = {**model.state_dict(), "layers.0.attn.q_proj._extra_state": blob}
    with pytest.raises(ArtifactError, match=r"^layers\.0\.attn\.q_proj\._extra_state: the state dict holds "
                                            r"Transformer Engine extra state"):
        model.load_state_dict(state, strict=True)
    state["layers.0.attn.q_proj._extra_state"] = torch.empty(0, dtype=torch.uint8)
    model.load_state_dict(state, strict=True)
    assert not any(getattr(m, "loaded_extra_state", False) for m in model.modules())


def test_precision_enters_tes_autocast_inside_torchs_for_each_forward():
    seen = []

    @contextlib.contextmanager
    def fp8_context():
        seen.append(("enter", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        yield
        seen.append(("exit", torch.is_autocast_enabled("cpu")))

    precision = Precision("fp8", torch.device("cpu"), fp8_context=fp8_context)
    ctx = precision.autocast()
    assert seen == [], "entered by `with`, not when made"
    with ctx:
        assert torch.is_autocast_enabled("cpu")
    assert seen == [("enter", True, torch.bfloat16), ("exit", True)]
    with pytest.raises(ValueError, match="an FP8 context is for precision fp8, not bf16"):
        Precision("bf16", torch.device("cpu"), fp8_context=fp8_context)


# ---- on an FP8 GPU with Transformer Engine installed ---------------------------------------------


def _needs_te_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("transformer_engine.pytorch")
    problem = te_float8.te_problem("tensorwise", torch.device("cuda"))
    if problem:
        pytest.skip(problem)


def _gpu_config():
    return preset("tiny", vocab_size=256, num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  ffn_hidden_size=512)


def _train(model, precision: Precision, tokens, steps: int, opt=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        with precision.autocast():
            logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses, opt


@pytest.mark.gpu
def test_te_recipes_are_the_ones_documented():
    pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.common import recipe

    made = {name: te_float8.te_recipe(name) for name in te_float8.TE_RECIPES}
    assert type(made["tensorwise"]) is recipe.Float8CurrentScaling
    assert type(made["blockwise"]) is recipe.Float8BlockScaling
    assert type(made["mxfp8"]) is recipe.MXFP8BlockScaling
    assert {n: r.fp8_format for n, r in made.items()} == {n: getattr(recipe.Format, spec.fp8_format)
                                                          for n, spec in te_float8.TE_RECIPES.items()}
    torchao_float8 = pytest.importorskip("torchao.float8")
    ao = torchao_float8.Float8LinearConfig.from_recipe_name("tensorwise")
    assert made["tensorwise"].fp8_format.value.max_bwd == torch.finfo(ao.cast_config_grad_output.target_dtype).max
    assert not any(r.delayed() for r in made.values()), "stateless: nothing for a checkpoint to keep"


@pytest.mark.gpu
def test_te_training_steps_track_torchao_and_bf16_on_gpu():
    """20 eager AdamW steps: TE tensorwise (current scaling) within 2% of bf16's final loss, as the
    torchao GPU test's bound, and of torchao tensorwise's (the same scaling; not yet measured)."""
    _needs_te_gpu()
    pytest.importorskip("torchao")
    from tessera.trainer.components.precision.torchao_float8 import apply_float8

    device = torch.device("cuda")
    tokens = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0)).to(device)
    bf16 = _train(build_model(_gpu_config(), device=device, seed=0), Precision("bf16", device), tokens, 20)[0][-1]
    ao_model = build_model(_gpu_config(), device=device, seed=0)
    apply_float8(ao_model, "tensorwise", device)
    torchao = _train(ao_model, Precision("fp8", device), tokens, 20)[0][-1]
    te_model = build_model(_gpu_config(), device=device, seed=0)
    te = _train(te_model, Precision("fp8", device, fp8_context=te_float8.apply_te(te_model, "tensorwise", device)[1]),
                tokens, 20)[0][-1]
    assert abs(te - bf16) / bf16 < 0.02
    assert abs(te - torchao) / torchao < 0.02


@pytest.mark.gpu
def test_te_checkpoint_round_trip_resumes_like_the_uninterrupted_run_and_loads_into_bf16():
    """2 + 2 steps through a state dict (model and AdamW) equal 4 uninterrupted steps: current
    scaling carries no state; the TE model's state dict loads strictly into a plain model."""
    _needs_te_gpu()
    device = torch.device("cuda")
    tokens = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0)).to(device)

    def te_run():
        model = build_model(_gpu_config(), device=device, seed=0)
        return model, Precision("fp8", device, fp8_context=te_float8.apply_te(model, "tensorwise", device)[1])

    model, precision = te_run()
    whole, _ = _train(model, precision, tokens, 4)
    first, second = te_run(), te_run()
    _, opt = _train(*first, tokens, 2)
    saved = {k: v.clone() for k, v in first[0].state_dict().items()}
    assert list(saved) == list(build_model(_gpu_config(), device=device, seed=0).state_dict())
    second[0].load_state_dict(saved, strict=True)
    opt2 = torch.optim.AdamW(second[0].parameters(), lr=1e-3)
    opt2.load_state_dict(opt.state_dict())
    resumed, _ = _train(*second, tokens, 2, opt2)
    assert resumed == pytest.approx(whole[2:], rel=1e-6)
    a = torch.cat([p.flatten() for p in second[0].parameters()])
    b = torch.cat([p.flatten() for p in model.parameters()])
    assert (a - b).norm() / b.norm() < 1e-6
    build_model(_gpu_config(), device=device, seed=1).load_state_dict(saved, strict=True)


@pytest.mark.gpu
def test_the_trainer_trains_and_resumes_with_te_on_gpu(make_config, tmp_path):
    """tessera-train end to end with fp8_backend=te (the fixtures' d=32 model: every projection
    swapped), 4 steps, then --resume to 6."""
    _needs_te_gpu()
    from tessera.trainer.cli import main as train_main

    training = {"precision": "fp8", "fp8_backend": "te", "device": "cuda", "steps": 6, "exit_after_steps": 4,
                "save_interval": 4}
    config = make_config(training=training)
    assert train_main(["--config", str(config), "--quiet"]) == 0
    assert train_main(["--config", str(config), "--quiet", "--resume"]) == 0
    assert (tmp_path / "run" / "checkpoints").is_dir()
