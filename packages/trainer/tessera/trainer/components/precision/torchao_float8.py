"""FP8 training (training.precision: fp8) through torchao's Float8 linear layers.

Backends (`training.fp8_backend`, behind one interface: tessera.trainer.components.precision.float8):
torchao (this module, the default: every composition below) or NVIDIA Transformer Engine (`te`,
tessera.trainer.components.precision.te_float8, when installed: its Linear layers in the same places,
`eligible` below, with TE's recipes tensorwise (current scaling), blockwise and mxfp8; one
process, eager, no full recompute; refused with one line otherwise). Both keep state dicts those
of a bf16 run, so checkpoints interchange across backends.

`training.precision: fp8` is bf16 autocast (tessera.trainer.components.precision.mixed) with every eligible
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
  whole row, which the shard does not have); the trainer's config (TrainConfig) refuses it with
  rowwise, without FSDP, or with tensor parallel, in one line.
- tensor parallel (and sequence parallel): Tessera's ColumnParallelLinear/RowParallelLinear issue
  their collectives in their own forward, so they are not swapped (a Float8Linear would drop the
  collectives; torchao's own TP support is for DTensor layers). Instead their local-matmul hook
  (`local_linear`, tessera.common.parallel.layers) becomes `Float8LocalLinear`: torchao's casts
  and scaled matmuls, in torchao's autograd shape, with the amax of every operand the tensor
  ranks split taken over the tensor group (one MAX all-reduce), so the scales are global: those
  one process computes, as under torchtitan's Float8ColwiseParallel / Float8RowwiseParallel on
  DTensor (measurements: the comment above _SHARDS). Class, parameters and tags are unchanged:
  state dicts and checkpoints are the same as bf16's. The hook compiles as one graph (dynamo
  fullgraph + AOTAutograd, tested with aot_eager on CPU; the all-reduces are functional
  collectives). Over one tensor rank the layers are plain Linear layers with tags and are swapped
  for Float8Linear (tags kept). Not with FSDP float8 all-gather (refused by the trainer's config).
- the parallel runtime (training.precision=fp8 under torchrun, through TorchaoFloat8): converts
  each stage after the tensor-parallel swap and before compile and fully_shard; ZeRO-1 data
  parallel, FSDP (meta build, sharded init) and pipeline train like one process in fp8 over the
  same micro-batches (tests/parallel/test_fp8_parallel.py, emulated on CPU, within 1e-5); tensor
  parallel and tensor + sequence parallel within 1.5e-4 (bf16 partial sums, see there).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from torch import nn

from tessera.common.errors import UserError
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.parallel.layers import ColumnParallelLinear, RowParallelLinear, keep_tags
from tessera.trainer.config import TrainingConfig

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
    """The group size of one of Tessera's tensor-parallel Linear layers; None for anything else."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        import torch.distributed as dist

        return dist.get_world_size(module.group)
    return None


def eligible(module: nn.Linear, fqn: str) -> bool:
    """Which Linear layers train in FP8, under either backend (this one and fp8_te): not the output head; dimensions (local ones, for a tensor-parallel layer: what the GEMM
    sees) multiples of 16."""
    if fqn.split(".")[-1] == "lm_head":
        return False
    return module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0


def _converts(module: nn.Module, fqn: str) -> bool:
    if not isinstance(module, nn.Linear):
        return True  # let torchao descend into containers
    if (_tensor_parallel_size(module) or 1) > 1:
        return False  # keeps its class and collectives; its local matmul becomes Float8LocalLinear
    return eligible(module, fqn)


def float8_config(recipe: str, fsdp_float8_all_gather: bool = False):
    """torchao's Float8LinearConfig for `recipe`, with FSDP2's float8 all-gather when asked."""
    if recipe not in RECIPES:
        raise UserError(f"training.fp8_recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    if importlib.util.find_spec("torchao") is None:
        raise UserError("training.precision=fp8 needs torchao: pip install 'tessera-trainer[fp8]'")
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=True) if fsdp_float8_all_gather else config


def convert_to_float8(model: nn.Module, recipe: str, fsdp_float8_all_gather: bool = False) -> list[str]:
    """Swap the eligible nn.Linear layers of `model` for torchao Float8Linear, in place.

    Tensor-parallel layers keep their class and get a float8 `local_linear`. Returns the
    names of the converted layers. No device check (see `apply_float8`). With
    `fsdp_float8_all_gather` (before `fully_shard`), FSDP2 gathers the weights in float8; then
    call `precompute_float8_scales` after every optimizer step. The option's combinations
    (tensorwise, FSDP, no tensor parallel) are checked by TrainConfig, not here.
    """
    config = float8_config(recipe, fsdp_float8_all_gather)
    parallel = [(name, m) for name, m in model.named_modules() if (_tensor_parallel_size(m) or 1) > 1]
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    # The parallel runtime's tags on parameters (tessera.common.parallel.layers) survive the swap:
    # float8 all-gather wraps each weight in a new Parameter.
    with keep_tags(model):
        convert_to_float8_training(model, module_filter_fn=_converts, config=config)
    for name, m in parallel:
        if eligible(m, name):
            m.local_linear = Float8LocalLinear(config, "column" if isinstance(m, ColumnParallelLinear) else "row",
                                               m.group)
    return [name for name, m in model.named_modules()
            if isinstance(m, Float8Linear) or isinstance(getattr(m, "local_linear", None), Float8LocalLinear)]


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
    return require_converted(convert_to_float8(model, recipe))


def require_converted(converted: list[str]) -> list[str]:
    """fp8 that converted no layer would silently train in bf16: refuse it (one line)."""
    if not converted:
        raise UserError("training.precision=fp8: no Linear layer of this model (of this rank's tensor-parallel "
                        f"slice) has dimensions that are multiples of {_ALIGN}; use training.precision=bf16")
    return converted


class TorchaoFloat8:
    """torchao behind tessera.trainer.components.precision.float8.Float8Backend."""

    recipes = RECIPES

    def problem(self, training: TrainingConfig, model: ModelConfig, device: torch.device,
                processes: int) -> str | None:
        if training.fp8_recipe not in RECIPES:
            return (f"training.fp8_recipe={training.fp8_recipe} is a Transformer Engine recipe: set "
                    f"training.fp8_backend=te, or use {' or '.join(RECIPES)} with torchao")
        return fp8_device_problem(device)

    def convert(self, model: nn.Module, recipe: str, fsdp_float8_all_gather: bool = False) -> list[str]:
        return require_converted(convert_to_float8(model, recipe, fsdp_float8_all_gather))

    def forward_context(self, recipe: str) -> None:
        return None  # Float8Linear casts inside its own forward

    def after_optimizer_step(self, model: nn.Module) -> None:
        precompute_float8_scales(model)


# ---- tensor parallel: float8 inside Tessera's Column/RowParallelLinear ----------------------------

# Global scales, not per shard (measured 2026-11-24, TP2 and TP2+SP against one-process fp8,
# emulated on CPU, tests/parallel/test_fp8_parallel.py's model with 4 key/value heads, 5 steps):
# tensorwise, per-shard scales are 3e-5 off at the first step in fp32 and 1.8e-4 over 5 steps
# under bf16 autocast, against 1e-7 and 7.8e-5 with global ones (the remainder: bf16 partial sums
# of the row-parallel layers, see the test). Rowwise measured the same either way (1.1e-4): its
# scales are powers of two, and a power-of-two scale does not change which fp8 value a number
# rounds to (outside the subnormal range). Cost of global: one small MAX all-reduce per cast on a
# split operand (a scalar for tensorwise, one value per token or channel for rowwise).
# Layer by layer over 2 ranks in fp32 (measured by hand): tensorwise output and both gradients
# within 1.4e-7 of Float8Linear; rowwise the weight gradient exact, the output (row) and input
# gradient (column) 2.3e-3 off, torchao's rowwise GEMM rounding its output to bf16 before the sum.

# Which dimension of each operand the tensor ranks split (None: whole on every rank), in the
# layouts torchao casts: input [..., in], weight_t [in, out], grad_output [tokens, out]. A column
# layer's input is whole (replicated, or all-gathered over the sequence under sequence parallel);
# a row layer's grad_output is whole (the all-reduce's backward is the identity, the
# reduce-scatter's an all-gather).
_SHARDS = {"column": dict(input=None, weight_t=1, grad_output=-1),
           "row": dict(input=-1, weight_t=0, grad_output=None)}


def _cast(t: torch.Tensor, cast, config, mm_config, role, axis: int, shard: int | None, group):
    """torchao's dynamic float8 cast of `t` (hp_tensor_to_float8_dynamic), with the amax taken
    over the tensor group (MAX) when the scale spans the dimension the ranks split: always for
    tensorwise, for rowwise (axiswise, reducing over `axis`) when `axis` is the split one."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

    if cast.scaling_type is ScalingType.DISABLED:
        return t
    axiswise = get_maybe_axiswise_dim(axis, cast.scaling_granularity)
    with torch.no_grad():
        amax = tensor_to_amax(t, scaling_granularity=cast.scaling_granularity, axiswise_dim=axiswise)
        split = shard is not None and (cast.scaling_granularity is ScalingGranularity.TENSORWISE
                                       or axis % t.ndim == shard % t.ndim)
        if split:
            import torch.distributed._functional_collectives as funcol

            amax = funcol.all_reduce(amax, "max", group)
            if isinstance(amax, funcol.AsyncCollectiveTensor):
                amax = amax.wait()
        scale = amax_to_scale(amax, cast.target_dtype, round_scales_to_power_of_2=config.round_scales_to_power_of_2)
    return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, mm_config, role, axiswise)


class _ShardedFloat8Matmul(torch.autograd.Function):
    """x @ weight_t on one tensor rank's shards with torchao's three float8 GEMMs (the shape of
    torchao's matmul_with_hp_or_float8_args), each cast's scale global over the tensor group."""

    @staticmethod
    def forward(ctx, x, weight_t, mm_config, config, shards, group):
        from torchao.float8.float8_training_tensor import GemmInputRole

        ctx.save_for_backward(x, weight_t)
        ctx.mm_config, ctx.config, ctx.shards, ctx.group = mm_config, config, shards, group
        x8 = _cast(x, config.cast_config_input, config, mm_config, GemmInputRole.INPUT, -1, shards["input"], group)
        w8 = _cast(weight_t, config.cast_config_weight, config, mm_config, GemmInputRole.WEIGHT, 0,
                   shards["weight_t"], group)
        y = torch.mm(x8.reshape(-1, x8.shape[-1]), w8)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        from torchao.float8.float8_training_tensor import GemmInputRole

        x, weight_t = ctx.saved_tensors
        c, mm, shards, group = ctx.config, ctx.mm_config, ctx.shards, ctx.group
        go = grad.reshape(-1, grad.shape[-1])
        go8 = _cast(go, c.cast_config_grad_output, c, mm, GemmInputRole.GRAD_OUTPUT, -1, shards["grad_output"], group)
        w8 = _cast(weight_t, c.cast_config_weight_for_grad_input, c, mm, GemmInputRole.WEIGHT, -1,
                   shards["weight_t"], group)
        grad_x = torch.mm(go8, w8.t()).reshape(*grad.shape[:-1], weight_t.shape[0])
        go8 = _cast(go, c.cast_config_grad_output_for_grad_weight, c, mm, GemmInputRole.GRAD_OUTPUT, 0,
                    shards["grad_output"], group)
        x8 = _cast(x.reshape(-1, x.shape[-1]), c.cast_config_input_for_grad_weight, c, mm, GemmInputRole.INPUT, 0,
                   shards["input"], group)
        grad_w = torch.mm(go8.t(), x8)
        return grad_x, grad_w.t(), None, None, None, None


class Float8LocalLinear:
    """F.linear in float8 for the local shard of a ColumnParallelLinear ("column") or
    RowParallelLinear ("row"): set as its `local_linear`, between the layer's own collectives.
    Float8Linear.forward's steps (autocast input cast, torchao's casts, bias added in the output's
    dtype) with global scales (see _cast)."""

    def __init__(self, config, kind: str, group):
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        self.config, self.kind, self.shards, self.group = config, kind, _SHARDS[kind], group
        self.mm_config = LinearMMConfig(*(ScaledMMConfig(config.emulate, gemm.use_fast_accum, False,
                                                         config.pad_inner_dim)
                                          for gemm in (config.gemm_config_output, config.gemm_config_grad_input,
                                                       config.gemm_config_grad_weight)))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_autocast_enabled():  # as Float8Linear: the output in the autocast dtype
            x = x.to(torch.get_autocast_gpu_dtype())
        y = _ShardedFloat8Matmul.apply(x, weight.t(), self.mm_config, self.config, self.shards, self.group)
        return y if bias is None else y + bias.to(y.dtype)

    def __repr__(self) -> str:
        return f"Float8LocalLinear({self.kind}, emulate={self.config.emulate})"
