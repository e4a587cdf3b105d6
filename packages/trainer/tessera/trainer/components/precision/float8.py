"""training.precision=fp8: what the trainer asks of a float8 backend, and the one place one is picked.

Two backends (training.fp8_backend) swap the same linear layers (`torchao_float8.eligible`) and
keep state dicts those of a bf16 run, so checkpoints interchange: torchao's Float8Linear
(`torchao_float8`, the default, every layout) and NVIDIA Transformer Engine (`te_float8`,
optional, one process). The trainer reaches them only through `Float8Backend`: `problem` before
any work (tessera.trainer.inputs.check_inputs), `convert` where the model or a pipeline stage is
built, `forward_context` around each forward (Precision), `after_optimizer_step` after each step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from tessera.common.models.causal_lm.config import ModelConfig
from tessera.trainer.components.precision.te_float8 import TransformerEngineFloat8
from tessera.trainer.components.precision.torchao_float8 import TorchaoFloat8
from tessera.trainer.config import TrainingConfig


class Float8Backend(Protocol):
    recipes: tuple[str, ...]  # the training.fp8_recipe names it implements

    def problem(self, training: TrainingConfig, model: ModelConfig, device: torch.device,
                processes: int) -> str | None:
        """Why this run cannot train in float8 here (one line: config, layout, layers, machine), or None."""

    def convert(self, model: nn.Module, recipe: str, fsdp_float8_all_gather: bool = False) -> list[str]:
        """Swap the eligible linear layers of `model` in place; their names (refusing a model with none)."""

    def forward_context(self, recipe: str) -> Callable[[], contextlib.AbstractContextManager] | None:
        """What each forward enters inside torch's autocast, or None."""

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Bring float8 state up to date with the stepped weights (FSDP's float8 all-gather scales)."""


_BACKENDS: dict[str, Float8Backend] = {"torchao": TorchaoFloat8(), "te": TransformerEngineFloat8()}


def float8_backend(name: str) -> Float8Backend:
    """The backend training.fp8_backend names."""
    return _BACKENDS[name]
