"""FP8 training (training.precision: fp8) through torchao's Float8 linear layers.

`training.precision: fp8` is bf16 autocast (tessera.trainer.precision) with every eligible
nn.Linear swapped for torchao's `Float8Linear`: its three matmuls (output, input gradient, weight
gradient) cast their operands to float8 e4m3 with dynamic scales and run on FP8 tensor cores;
master weights, gradients and optimizer state stay fp32 and everything else (norms, attention,
loss) stays bf16, as in torchtitan. Recipes (`training.fp8_recipe`), torchao's names:

- tensorwise: one scale per tensor. Fastest; torchtitan reports ~1.3-1.5x over bf16 on H100.
- rowwise: one scale per row (per token of activations and gradients, per output channel of
  weights); more accurate with outliers, somewhat slower.

The swap keeps module and parameter names (Float8Linear subclasses nn.Linear and keeps its
weight), so checkpoints are the same as for a bf16 run and interchange with it.
Not converted: the output head (torchtitan leaves it in bf16: the loss is sensitive to it) and
any Linear whose dimensions are not multiples of 16 (the FP8 GEMM's alignment requirement).
FP8 tensor cores exist from compute capability 8.9 (Ada, Hopper, Blackwell); elsewhere the run is
refused with one line. torchao's casts also run on CPU (emulated, slowly), which the tests use to
check the conversion.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from tessera.common.errors import UserError

RECIPES = ("tensorwise", "rowwise")
FP8_MIN_CAPABILITY = (8, 9)
_ALIGN = 16


def fp8_device_problem(device: torch.device) -> str | None:
    """Why `device` cannot train in FP8 (one line), or None when it can."""
    if device.type != "cuda":
        return (f"training.precision=fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+: Ada, "
                f"Hopper, Blackwell); this run is on {device.type}: use training.precision=bf16")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        return (f"training.precision=fp8 needs compute capability 8.9+ (Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: "
                f"use training.precision=bf16")
    return None


def _converts(module: nn.Module, fqn: str) -> bool:
    if not isinstance(module, nn.Linear):
        return True  # let torchao descend into containers
    if fqn.split(".")[-1] == "lm_head":
        return False
    return module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0


def convert_to_float8(model: nn.Module, recipe: str) -> list[str]:
    """Swap the eligible nn.Linear layers of `model` for torchao Float8Linear, in place.

    Returns the names of the converted layers. No device check (see `apply_float8`).
    """
    if recipe not in RECIPES:
        raise UserError(f"training.fp8_recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    if importlib.util.find_spec("torchao") is None:
        raise UserError("training.precision=fp8 needs torchao: pip install 'tessera-trainer[fp8]'")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    convert_to_float8_training(model, module_filter_fn=_converts, config=Float8LinearConfig.from_recipe_name(recipe))
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def apply_float8(model: nn.Module, recipe: str, device: torch.device) -> list[str]:
    """`convert_to_float8` after checking that `device` has FP8 tensor cores (UserError if not)."""
    problem = fp8_device_problem(device)
    if problem is not None:
        raise UserError(problem)
    converted = convert_to_float8(model, recipe)
    if not converted:
        raise UserError("training.precision=fp8: no Linear layer of this model has dimensions that are multiples "
                        f"of {_ALIGN}; use training.precision=bf16")
    return converted
