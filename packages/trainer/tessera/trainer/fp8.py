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

Composition (issue #19), what holds and what is refused:
- compile: Float8Linear's casts and scaled matmuls are traced by torch.compile; TrainStep's graph
  of forward + loss fuses the amax/scale/cast chains into neighbouring kernels (torchao's own
  recommendation: without compile the casts cost more than the FP8 GEMMs save). Checked by hand on
  CPU (emulated, tiny model, 2026-11-24): compiled and eager fp8 TrainSteps agree to 2e-5..1e-4
  over 3 steps; not a CPU test (inductor took 158 s there), the compiled GPU test is marked gpu.
- recompute (`training.recompute`): the wrappers in model_setup checkpoint blocks or attention
  cores around the converted layers; the recomputed forward casts again with the same dynamic
  scales (they depend only on the tensors), so gradients equal the stored-activation run's.
- FSDP: `fsdp_float8_all_gather=True` builds torchao's `enable_fsdp_float8_all_gather` config:
  each weight is cast to float8 before FSDP2's all-gather (half the bytes of bf16), with one scale
  per tensor for the whole unsharded weight; the scales of all weights are then computed in one
  all-reduce after each optimizer step by `precompute_float8_scales` (torchao's
  `precompute_float8_dynamic_scale_for_fsdp`). Tensorwise only (torchao: a rowwise scale needs the
  whole row, which the shard does not have); rowwise with it is refused with one line.
- tensor parallel: refused with one line. Tessera's tensor-parallel layers subclass nn.Linear and
  issue their collectives in their own forward; torchao's swap would replace them with a plain
  Float8Linear and drop the collectives (torchao's TP support is for DTensor layers instead). Over
  one tensor rank they are plain Linear layers with tags, and are converted (tags kept).
- the parallel runtime (`ParallelConfig.fp8_recipe`, set by the trainer under torchrun): converts
  each stage after the tensor-parallel swap and before compile and fully_shard; ZeRO-1 data
  parallel, FSDP (meta build, sharded init) and pipeline train like one process in fp8 over the
  same micro-batches (tests/parallel/test_fp8_parallel.py, emulated on CPU, within 1e-5).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from torch import nn

from tessera.common.errors import UserError
from tessera.common.parallel.layers import PARALLEL_TAGS

RECIPES = ("tensorwise", "rowwise")
FP8_MIN_CAPABILITY = (8, 9)
_ALIGN = 16


def fp8_device_problem(device: torch.device) -> str | None:
    """Why `device` cannot train in FP8 (one line), or None when it can."""
    if device.type != "cuda":
        return (f"training.precision=fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+: Ada, "
                f"Hopper, Blackwell); this run is on {device.type}: use training.precision=bf16")
    if not torch.cuda.is_available():
        return ("training.precision=fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+: Ada, "
                "Hopper, Blackwell); no CUDA device is available here: use training.precision=bf16")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        return (f"training.precision=fp8 needs compute capability 8.9+ (Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: "
                f"use training.precision=bf16")
    return None


def _tensor_parallel_size(module: nn.Module) -> int | None:
    """The group size of one of Tessera's tensor-parallel Linear layers (an nn.Linear subclass with
    its own collectives); None for anything else."""
    if isinstance(module, nn.Linear) and type(module) is not nn.Linear and hasattr(module, "group"):
        import torch.distributed as dist

        return dist.get_world_size(module.group)
    return None


def _converts(module: nn.Module, fqn: str) -> bool:
    if not isinstance(module, nn.Linear):
        return True  # let torchao descend into containers
    if type(module) is not nn.Linear and _tensor_parallel_size(module) != 1:
        return False  # its own forward: only a tensor-parallel layer over one rank is a plain Linear
    if fqn.split(".")[-1] == "lm_head":
        return False
    return module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0


def float8_config(recipe: str, fsdp_float8_all_gather: bool = False):
    """torchao's Float8LinearConfig for `recipe`, with FSDP2's float8 all-gather when asked."""
    if recipe not in RECIPES:
        raise UserError(f"training.fp8_recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise UserError(f"float8 all-gather under FSDP needs training.fp8_recipe=tensorwise (one scale per weight; "
                        f"a {recipe} scale needs whole rows, which a shard does not hold); use tensorwise")
    if importlib.util.find_spec("torchao") is None:
        raise UserError("training.precision=fp8 needs torchao: pip install 'tessera-trainer[fp8]'")
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=True) if fsdp_float8_all_gather else config


def convert_to_float8(model: nn.Module, recipe: str, fsdp_float8_all_gather: bool = False) -> list[str]:
    """Swap the eligible nn.Linear layers of `model` for torchao Float8Linear, in place.

    Returns the names of the converted layers. No device check (see `apply_float8`). With
    `fsdp_float8_all_gather` (before `fully_shard`), FSDP2 gathers the weights in float8; then
    call `precompute_float8_scales` after every optimizer step.
    """
    config = float8_config(recipe, fsdp_float8_all_gather)
    parallel = [name for name, m in model.named_modules() if (_tensor_parallel_size(m) or 1) > 1]
    if parallel:
        raise UserError(f"training.precision=fp8 does not compose with tensor parallel yet ({parallel[0]} is a "
                        f"{type(model.get_submodule(parallel[0])).__name__}, whose collectives a Float8Linear would "
                        "drop); use parallel.tensor=1 or training.precision=bf16")
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    # The parallel runtime's tags on parameters (tessera.common.parallel.layers) survive the swap:
    # float8 all-gather wraps each weight in a new Parameter.
    tags = {n: {k: getattr(p, k) for k in PARALLEL_TAGS if hasattr(p, k)} for n, p in model.named_parameters()}
    convert_to_float8_training(model, module_filter_fn=_converts, config=config)
    for n, p in model.named_parameters():
        for k, v in tags.get(n, {}).items():
            setattr(p, k, v)
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def precompute_float8_scales(model: nn.Module) -> bool:
    """After an optimizer step under FSDP with float8 all-gather: every weight's scale in one
    all-reduce (torchao's precompute_float8_dynamic_scale_for_fsdp), so the next forward's
    all-gathers need none. False (and nothing done) when no layer gathers in float8."""
    from torchao.float8.float8_linear import Float8Linear

    if not any(isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather for m in model.modules()):
        return False
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
    return True


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
