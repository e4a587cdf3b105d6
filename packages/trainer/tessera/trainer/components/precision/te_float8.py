"""FP8 training through NVIDIA Transformer Engine (training.fp8_backend: te), the optional backend.

`training.precision: fp8` with `training.fp8_backend: te` is the same bf16 autocast over fp32
master weights as the torchao path (tessera.trainer.components.precision.torchao_float8), with the eligible nn.Linear layers (the
same rule, `tessera.trainer.components.precision.torchao_float8.eligible`: not the output head, dimensions multiples of 16)
swapped for `transformer_engine.pytorch.Linear` and the forward entered in TE's
`transformer_engine.pytorch.autocast(recipe=...)` inside torch's (tessera.trainer.components.precision.mixed).
The `te` extra installs it (`pip install 'tessera-trainer[te]'`, TE 2.9+, which has `autocast`
with `recipe=`; it needs CUDA: the library builds against the machine's CUDA toolkit).

Recipes (`training.fp8_recipe`): a name means the same scaling under either backend, or it is
refused with one line, never replaced by something else:
- tensorwise -> `Float8CurrentScaling(fp8_format=Format.HYBRID)` (TE's default format): one scale
  per tensor, computed from the tensor being cast (its amax now), e4m3 for inputs and weights and
  e5m2 for output gradients, fast accumulation in the forward GEMM only: what torchao's tensorwise
  recipe does (torchao 0.18: `Float8LinearConfig.from_recipe_name("tensorwise")` casts
  grad_output to float8_e5m2; Format.E4M3 would cast gradients to e4m3, other numbers). Not
  `DelayedScaling` (TE's default on Hopper), which scales by the largest amax of up to 1024
  earlier steps: other numbers than torchao's, and state (the amax history) a checkpoint must
  carry for exact resume, which TE keeps as a pickle in `_extra_state` (Tessera never unpickles
  checkpoint files).
- blockwise (TE only) -> `Float8BlockScaling(fp8_format=Format.E4M3)` (its default format):
  DeepSeek-V3's 1x128 blocks for activations and gradients, 128x128 blocks for weights,
  power-of-two scales (compute capability 9.0+ and CUDA 12.9+: TE's
  `is_fp8_block_scaling_available`).
- mxfp8 (TE only) -> `MXFP8BlockScaling(fp8_format=Format.E4M3)`: OCP MX, one power-of-two
  (E8M0) scale per 32 consecutive values (Blackwell, compute capability 10.x: TE's
  `is_mxfp8_available`).
- rowwise is torchao's (one scale per row) and TE has no per-row recipe: refused; blockwise is
  TE's finer-grained one. blockwise and mxfp8 under torchao are refused likewise.

The swap keeps module paths and shares the weight and bias Parameters (TE's own are built without
initialisation, on the same device, and replaced), so parameter names, the optimizer's state, DCP
checkpoints and HF export are those of a bf16 or torchao run. TE's modules add one state-dict
entry, `<layer>._extra_state` (fp8 metadata). Every recipe above is stateless (scales come from
the tensors being cast): TE's extra state then holds no scales (TE 2.17.1+ saves an empty tensor,
TE 2.9-2.17.0 a pickle of the recipe's settings, which the config rebuilds), so it is dropped from
the state dict and not required on load (`_hide_extra_state`). Checkpoints neither gain keys (a TE
checkpoint resumes under bf16 or torchao and back, and `tessera-ckpt` reads it as any other) nor
lose scaling state (there is none), so resume is exact. A state dict that does carry a non-empty
`<layer>._extra_state` (written by something else) is refused with one line before TE sees it:
TE 2.9-2.17.0's set_extra_state would unpickle it.

Refused with one line (exit 2) before any work: `TransformerEngineFloat8.problem`, which
tessera.trainer.inputs.check_inputs runs first:
- TE not importable (the import's own reason in the line), a device without FP8 tensor cores
  (`fp8_device_problem`, the torchao path's check), a recipe the GPU lacks (TE's own check).
- training.compile: TE's Linear.forward is excluded from dynamo (`no_torch_dynamo`), so the
  graph would break at every layer and the step's one graph of forward + loss would not exist.
- training.recompute=full: torch's checkpoint recomputes a block in backward outside TE's
  autocast, so the recomputed Linear layers would not run the forward's FP8 casts (TE has its
  own `te.distributed.checkpoint` for that); selective recomputes the attention core, which has
  no Linear layer, and composes.
- more than one process (torchrun): Tessera's parallel runtime issues its own collectives in its
  tensor-parallel layers (the reason torchao_float8.py gives for torchao's Float8Linear), shards with its
  own ZeRO-1 and FSDP2 code and enters its own autocast; TE's tensor parallel (tp_group,
  parallel_mode) is for TE's layers and the runtime converts through torchao only. Use
  fp8_backend=torchao there.
- micro_batch_size x seq_length not a multiple of 8 (32 for mxfp8), and under mxfp8 a layer whose
  dimensions are not multiples of 32 (from the model config, before anything is built): te.Linear checks its FP8 operands with `utils.assert_dim_for_fp8_exec` (TE
  2.9: tokens divisible by 8, features by 16, which torchao_float8.eligible already asks of the layers);
  MXFP8 needs both in multiples of its 32-value blocks.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from tessera.common.errors import ArtifactError, UserError
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.model import Transformer
from tessera.trainer.components.precision.torchao_float8 import (
    eligible,
    fp8_device_problem,
    require_converted,
)
from tessera.trainer.config import TrainingConfig


class TERecipe(NamedTuple):
    cls: str  # the recipe class in transformer_engine.common.recipe
    fp8_format: str  # its fp8_format, a member of transformer_engine.common.recipe.Format
    check: str  # TE's availability check for it, in transformer_engine.pytorch
    tokens: int  # micro_batch_size x seq_length must be a multiple of this (TE's assert_dim_for_fp8_exec: 8)
    features: int  # and a swapped layer's dimensions (fp8.eligible asks 16 of every recipe)


# What each fp8_recipe name means under TE: the one table. HYBRID = e4m3 forward, e5m2 gradients.
TE_RECIPES = {
    "tensorwise": TERecipe("Float8CurrentScaling", "HYBRID", "is_fp8_available", 8, 16),
    "blockwise": TERecipe("Float8BlockScaling", "E4M3", "is_fp8_block_scaling_available", 8, 16),
    "mxfp8": TERecipe("MXFP8BlockScaling", "E4M3", "is_mxfp8_available", 32, 32),
}
TE_INSTALL = "pip install 'tessera-trainer[te]'"


def te_recipe_problem(recipe: str) -> str | None:
    """Why `recipe` has no Transformer Engine meaning (one line), or None. Needs only the config."""
    if recipe in TE_RECIPES:
        return None
    return (f"training.fp8_recipe={recipe} has no Transformer Engine recipe (torchao scales per row; TE has "
            f"per-tensor and block scaling): with training.fp8_backend=te use one of {', '.join(TE_RECIPES)}, "
            "or training.fp8_backend=torchao")


def te_config_problem(recipe: str, compile: bool, recompute: str, micro_batch_size: int, seq_length: int) -> str | None:
    """What of a training section fp8_backend=te cannot run (one line), or None; the module
    docstring says why each is refused."""
    if problem := te_recipe_problem(recipe):
        return problem
    if compile:
        return ("training.fp8_backend=te does not compose with training.compile (TE's Linear runs outside "
                "torch.compile, breaking the graph at every layer); set training.compile=false or use "
                "training.fp8_backend=torchao")
    if recompute == "full":
        return ("training.fp8_backend=te does not compose with training.recompute=full (the recomputed blocks "
                "would run outside TE's FP8 autocast); use recompute none or selective, or "
                "training.fp8_backend=torchao")
    align = TE_RECIPES[recipe].tokens
    if (micro_batch_size * seq_length) % align:
        return (f"training.fp8_backend=te needs training.micro_batch_size x training.seq_length "
                f"({micro_batch_size} x {seq_length}) to be a multiple of {align} (TE's {recipe} GEMMs); "
                "change either")
    return None


def te_layout_problem(processes: int) -> str | None:
    """fp8_backend=te over more than one process (one line), or None."""
    if processes <= 1:
        return None
    return (f"training.fp8_backend=te runs in one process (here: {processes}): Tessera's parallel runtime "
            "converts through torchao, whose layers keep the runtime's collectives; use "
            "training.fp8_backend=torchao under torchrun")


def import_te():
    """transformer_engine.pytorch, or UserError naming the extra and the import's own reason."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except (ImportError, OSError, RuntimeError) as exc:  # absent, or present without its CUDA libraries
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise UserError(f"training.fp8_backend=te needs NVIDIA Transformer Engine, which cannot be imported here "
                        f"({reason}): {TE_INSTALL} on a CUDA machine, or use training.fp8_backend=torchao") from None


def te_problem(recipe: str, device: torch.device, world_size: int = 1) -> str | None:
    """Every check of fp8_backend=te that needs the machine (one line), or None: one process, TE
    importable, FP8 tensor cores, and the recipe's own requirement (TE's check)."""
    if problem := te_layout_problem(world_size):
        return problem
    if problem := te_recipe_problem(recipe):
        return problem
    try:
        te = import_te()
    except UserError as exc:
        return str(exc)
    if problem := fp8_device_problem(device):
        return problem
    available, reason = getattr(te, TE_RECIPES[recipe].check)(return_reason=True)
    if not available:
        return (f"training.fp8_recipe={recipe} is not available on {torch.cuda.get_device_name(device)} "
                f"(Transformer Engine: {' '.join(str(reason).split())}); use training.fp8_recipe=tensorwise")
    return None


def te_recipe(recipe: str):
    """The Transformer Engine recipe object for `recipe` (TE_RECIPES)."""
    if problem := te_recipe_problem(recipe):
        raise UserError(problem)
    from transformer_engine.common import recipe as te_recipes

    spec = TE_RECIPES[recipe]
    return getattr(te_recipes, spec.cls)(fp8_format=getattr(te_recipes.Format, spec.fp8_format))


# ---- the swap -------------------------------------------------------------------------------------

def _drop_extra_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    # Every recipe of TE_RECIPES is stateless: TE's extra state then holds no scales (TE 2.17.1+
    # saves an empty tensor; 2.9-2.17.0 a pickle of the recipe's settings and flags, which the
    # config rebuilds). Nothing resume needs, and no pickle in Tessera's checkpoints.
    state_dict.pop(prefix + "_extra_state", None)


def _refuse_extra_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata, strict, missing_keys,
                        unexpected_keys, error_msgs) -> None:
    """Before loading: take `<layer>._extra_state` out of the state dict so that it never reaches
    TE's set_extra_state, which in TE 2.9-2.17.0 unpickles it. Empty (TE 2.17.1+'s for a stateless
    recipe) it is dropped; anything else is refused (Tessera's checkpoints never hold it)."""
    key = prefix + "_extra_state"
    state = state_dict.pop(key, None)
    if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
        return
    raise ArtifactError(f"{key}: the state dict holds Transformer Engine extra state, which Tessera never loads "
                        "(TE 2.9-2.17.0 unpickle it; Tessera's TE layers keep none): remove that key")


def _tolerate_missing_extra_state(module: nn.Module, incompatible_keys) -> None:
    for key in [k for k in incompatible_keys.missing_keys if k.endswith("._extra_state") or k == "_extra_state"]:
        incompatible_keys.missing_keys.remove(key)


def _hide_extra_state(module: nn.Module) -> None:
    """State dicts of `module` as a plain nn.Linear's: no `_extra_state` key saved, none required,
    none loaded (a non-empty one refused: _refuse_extra_state)."""
    module.register_state_dict_post_hook(_drop_extra_state)
    module.register_load_state_dict_pre_hook(_refuse_extra_state)
    module.register_load_state_dict_post_hook(_tolerate_missing_extra_state)


def _no_init(tensor: torch.Tensor) -> None:
    """TE's init_method: leave TE's own weight uninitialised (it is replaced; no RNG drawn)."""


def _te_linear(linear: nn.Linear) -> nn.Module:
    """A transformer_engine.pytorch.Linear holding `linear`'s weight and bias Parameters."""
    te = import_te()
    w = linear.weight
    layer = te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, params_dtype=w.dtype,
                      device=w.device, init_method=_no_init)
    layer.weight = w
    if linear.bias is not None:
        layer.bias = linear.bias
    return layer


def _swappable(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The layers fp8.eligible picks; plain nn.Linear only (subclasses, Tessera's tensor-parallel
    layers, keep their own forward and collectives)."""
    return [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and eligible(m, name)]


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> list[str]:
    """Replace every eligible nn.Linear of `model` (_swappable) by `make(linear)`, in place, with
    state dicts kept those of nn.Linear (_hide_extra_state). Returns the swapped layers' names."""
    swapped = []
    for name, module in _swappable(model):
        parent_name, _, child = name.rpartition(".")
        replacement = make(module)
        _hide_extra_state(replacement)
        setattr(model.get_submodule(parent_name), child, replacement)
        swapped.append(name)
    return swapped


def te_layers_problem(model: nn.Module, recipe: str) -> str | None:
    """A layer `recipe` would swap whose dimensions it cannot take (mxfp8: multiples of 32), one
    line, or None. Reads only module types and shapes: `model` may be on the meta device."""
    if problem := te_recipe_problem(recipe):
        return problem
    align = TE_RECIPES[recipe].features
    for name, m in _swappable(model):
        if m.in_features % align or m.out_features % align:
            return (f"training.fp8_recipe={recipe} needs the linear layers' dimensions to be multiples of "
                    f"{align}; {name} is {m.in_features} -> {m.out_features}: use training.fp8_recipe=tensorwise")
    return None


def te_model_problem(cfg: ModelConfig, recipe: str) -> str | None:
    """te_layers_problem for the model `cfg` describes, built on the meta device (no memory, no
    GPU): check_inputs refuses it before anything is built."""
    with torch.device("meta"):
        return te_layers_problem(Transformer(cfg), recipe)


def convert_to_te(model: nn.Module, recipe: str = "tensorwise") -> list[str]:
    """Swap the eligible nn.Linear layers of `model` for Transformer Engine Linear layers sharing
    their Parameters; the names of the swapped layers. No device check (see apply_te). A layer
    the recipe cannot take (te_layers_problem; the trainer's config has refused it already) is
    refused with one line, before anything is swapped."""
    import_te()
    if problem := te_layers_problem(model, recipe):
        raise UserError(problem)
    return swap_linears(model, _te_linear)


def apply_te(model: nn.Module, recipe: str,
             device: torch.device) -> tuple[list[str], Callable[[], contextlib.AbstractContextManager]]:
    """Check the machine (te_problem), swap the layers (convert_to_te, refusing a model that
    converts none). Returns the swapped layers' names and what Precision enters inside torch's
    autocast for each forward: TE's autocast with the recipe."""
    if problem := te_problem(recipe, device):
        raise UserError(problem)
    return require_converted(convert_to_te(model, recipe)), te_forward_context(recipe)


def te_forward_context(recipe: str) -> Callable[[], contextlib.AbstractContextManager]:
    """TE's autocast with the recipe, entered by Precision inside torch's for each forward."""
    te, fp8_recipe = import_te(), te_recipe(recipe)
    return lambda: te.autocast(enabled=True, recipe=fp8_recipe)


class TransformerEngineFloat8:
    """Transformer Engine behind tessera.trainer.components.precision.float8.Float8Backend."""

    recipes = tuple(TE_RECIPES)

    def problem(self, training: TrainingConfig, model: ModelConfig, device: torch.device,
                processes: int) -> str | None:
        """The config's, the layout's, the layers' and the machine's checks, in that order."""
        t = training
        return (te_config_problem(t.fp8_recipe, t.compile, t.recompute, t.micro_batch_size, t.seq_length)
                or te_layout_problem(processes) or te_model_problem(model, t.fp8_recipe)
                or te_problem(t.fp8_recipe, device, processes))

    def convert(self, model: nn.Module, recipe: str, fsdp_float8_all_gather: bool = False) -> list[str]:
        if fsdp_float8_all_gather:
            raise ValueError("fsdp_float8_all_gather is torchao's; Transformer Engine runs in one process")
        return require_converted(convert_to_te(model, recipe))

    def forward_context(self, recipe: str) -> Callable[[], contextlib.AbstractContextManager]:
        return te_forward_context(recipe)

    def after_optimizer_step(self, model: nn.Module) -> None:
        pass  # every recipe of TE_RECIPES is stateless
