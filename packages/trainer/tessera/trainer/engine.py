"""Execution engines: what the training loop asks of the layout it runs under.

The loop (tessera.trainer.trainer) owns everything that does not depend on the layout: the data
position, the LR schedule, evaluation, logging, checkpoints, stopping. It hands an engine this data-
parallel rank's rows of each global batch and asks for a few things, the `Engine` protocol:

    train_step(tokens, labels)  forward/backward over micro-batches, unscale + clip, optimizer step
                                -> StepResult(loss of the global batch, pre-clip grad norm, stepped,
                                              MoE router statistics)
    eval_batch(tokens, labels)  forward only -> (loss of the global batch, its counted tokens)
    params_norm()               global L2 norm of the weights
    components()                the stateful pieces to checkpoint: model, optimizer, loss scaler, RNGs
    seed(seed), set_lr(lr), lr, loss_scale, dp_rank, dp_size, any_rank(flag)

Two engines implement it: `LocalEngine` (one process, below: torch's AdamW, GradScaler, optional
torch.compile) and `tessera.trainer.parallel.engine.ParallelEngine` (tensor/pipeline/data
parallel, the parallel runtime's step and distributed optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from tessera.common.layers.moe import RouterStats
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.trainer.components.checkpoint.stateful import Stateful, seed_everything
from tessera.trainer.components.checkpoint.storage import local_components
from tessera.trainer.components.model_setup import prepare_model
from tessera.trainer.components.optimizer.optim import build_optimizer, set_lr
from tessera.trainer.components.precision.float8 import float8_backend
from tessera.trainer.components.precision.mixed import Precision
from tessera.trainer.config import OptimConfig, TrainingConfig
from tessera.trainer.objectives.documents import DocumentMasking, loss_token_count
from tessera.trainer.objectives.registry import parallel_objective, trainer_kind


@dataclass
class StepResult:
    loss: float  # global mean loss (unscaled)
    grad_norm: float  # pre-clip global norm of the unscaled gradients (inf/nan on fp16 overflow)
    stepped: bool = True  # False: a scaled step overflowed and was skipped (parameters unchanged)
    router: dict[str, float] = field(default_factory=dict)  # the step's MoE router statistics (moe_*), MTP loss (mtp_*)


class Engine(Protocol):
    dp_rank: int  # this process's data-parallel rank: which rows of a global batch it is given
    dp_size: int

    def train_step(self, tokens: torch.Tensor, labels: torch.Tensor) -> StepResult: ...

    def eval_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]: ...

    def params_norm(self) -> float: ...

    def components(self) -> dict[str, Stateful]: ...

    def seed(self, seed: int) -> None: ...

    def set_lr(self, lr: float) -> None: ...

    @property
    def lr(self) -> float: ...

    @property
    def loss_scale(self) -> float | None: ...

    def any_rank(self, flag: bool) -> bool: ...


def micro_batches(tokens: torch.Tensor, labels: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rows cut into consecutive micro-batches of `size` rows."""
    return [(tokens[i:i + size], labels[i:i + size]) for i in range(0, tokens.shape[0], size)]


class LocalEngine:
    """One plain process: the model itself, torch's AdamW, Precision (autocast, GradScaler), and the
    TrainStep (forward + loss, optionally compiled per block or as one graph; gradient accumulation)."""

    dp_rank, dp_size = 0, 1

    def __init__(self, model: ModelConfig, training: TrainingConfig, optim: OptimConfig,
                 documents: DocumentMasking | None, device: torch.device):
        t = training
        self.device = device
        self.micro_batch = t.micro_batch_size
        # Compilation is the step's (forward and loss in one graph), not the model's.
        self.model = prepare_model(model, device, t.seed, t.recompute, freeze=t.freeze,
                                   objective=parallel_objective(model))
        fp8_context = None  # e.g. Transformer Engine's FP8 autocast, entered inside torch's (Precision)
        self.float8 = float8_backend(t.fp8_backend) if t.precision == "fp8" else None  # checked by check_inputs
        if self.float8 is not None:
            self.float8.convert(self.model, t.fp8_recipe)
            fp8_context = self.float8.forward_context(t.fp8_recipe)
        self.optimizer = build_optimizer(self.model, optim)
        self.precision = Precision(t.precision, device, t.fp16_initial_scale, t.fp16_growth_interval, fp8_context)
        self.step = trainer_kind(model).step(self.model, self.optimizer, self.precision, optim.grad_clip,
                              t.loss_chunk_tokens, t.compile and t.compile_scope, documents)
        # MoE: router statistics of each step, and the balancing-bias update after it.
        self.router_stats = RouterStats(self.model) if getattr(model, "moe", None) is not None else None
        self.mtp = getattr(self.model, "mtp", None)  # multi-token prediction: its loss logged apart

    def train_step(self, tokens: torch.Tensor, labels: torch.Tensor) -> StepResult:
        batches = micro_batches(tokens, labels, self.micro_batch)
        if self.router_stats is not None:
            self.router_stats.prepare(len(batches))
        if self.mtp is not None:
            self.mtp.prepare(len(batches), self.precision.loss_scale or 1.0)
        loss_sum, grad_norm, stepped = self.step(batches, len(batches), self.device)
        if self.float8 is not None:
            self.float8.after_optimizer_step(self.model)
        router = self.router_stats.step() if self.router_stats is not None else {}
        router.update(self.mtp.metrics() if self.mtp is not None else {})
        return StepResult(float(loss_sum), float(grad_norm), stepped, router)

    @torch.no_grad()
    def eval_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
        """Mean token loss of the batch (micro-batch by micro-batch) and its counted tokens."""
        self.model.eval()
        per_token = self.step.per_token_loss
        total = torch.zeros((), device=self.device)
        batches = micro_batches(tokens, labels, self.micro_batch)
        for inputs, targets in batches:
            total += self.step.loss(inputs.to(self.device), targets.to(self.device),
                                    reduction="sum" if per_token else "mean")
        self.model.train()
        count = int(loss_token_count(labels))
        # eod_mask_loss: summed token losses over the counted tokens; else equal-sized micro-batch means.
        return float(total / max(count, 1)) if per_token else float(total / len(batches)), count

    @torch.no_grad()
    def params_norm(self) -> float:
        # The parameters that require gradients: training.freeze and the kind's objective
        # (model_setup.prepare_model: LLaVA's unread tower blocks) leave the others out, as they
        # do for the parallel engine, whose optimizers hold just these.
        norms = torch._foreach_norm([p.detach() for p in self.model.parameters() if p.requires_grad])
        return float(torch.linalg.vector_norm(torch.stack(norms)))

    def components(self) -> dict[str, Stateful]:
        return local_components(self.model, self.optimizer, self.precision)

    def seed(self, seed: int) -> None:
        seed_everything(seed)

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @property
    def loss_scale(self) -> float | None:
        return self.precision.loss_scale

    def any_rank(self, flag: bool) -> bool:
        return flag
