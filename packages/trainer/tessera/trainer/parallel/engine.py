"""The execution engine of every layout but one plain process (tessera.trainer.engine.Engine).

* building: process groups for the layout, then the runtime cuts the plain model (built on the
  meta device; only this rank's shards are allocated, initialised to the single-process weights
  of the run's seed) into pipeline chunks,
  swaps in tensor-parallel layers and wraps the parameters in data-parallel buckets with the
  (ZeRO-1) AdamW;
* the step: this data-parallel rank's rows of the global batch go to `runtime.train_step`, which
  does forward/backward over the micro-batches (pipeline schedule when pp > 1), the bucketed
  reductions, global-norm clipping and the optimizer step; fp16 adds the loss-scale policy
  (DynamicLossScale: the runtime unscales and detects overflow from the global gradient norm);
* evaluation: `runtime.eval_step` over this rank's rows of a global batch;
* checkpoint state: layout-free global tensors under the one-process names (model, optimizer),
  the scaler, and per-rank RNG streams (`rng.rank<R>.*`, with the tensor-parallel stream).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.common.layout import ParallelLayout
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.registry import kind_of
from tessera.common.parallel.state import build_groups, set_groups
from tessera.common.parallel.state_dict import load_model_state_dict
from tessera.trainer.components.checkpoint.stateful import RNGState, ScalerState, Stateful, seed_everything
from tessera.trainer.components.model_setup import apply_freeze, apply_recompute
from tessera.trainer.components.precision.mixed import DynamicLossScale
from tessera.trainer.config import OptimConfig, ParallelConfig, TrainingConfig
from tessera.trainer.engine import StepResult
from tessera.trainer.objectives.documents import DocumentMasking, loss_token_count
from tessera.trainer.objectives.registry import parallel_objective
from tessera.trainer.parallel.runtime import ParallelRuntime


class ParallelEngine:
    """A ParallelRuntime behind the loop's Engine interface."""

    def __init__(self, model: ModelConfig, layout: ParallelLayout, training: TrainingConfig, parallel: ParallelConfig,
                 optim: OptimConfig, documents: DocumentMasking | None, device: torch.device):
        t = training
        objective = parallel_objective(model)
        self.groups = build_groups(layout, device)
        set_groups(self.groups)
        # The rows of the global batch this rank reads: expert ranks read their own, as data ranks do.
        self.dp_rank, self.dp_size = self.groups.dp_ep_rank, self.groups.dp_ep
        self.documents = documents

        def builder():
            # On the meta device: the runtime allocates only this rank's shards and fills them
            # with the weights build_train_model(model, device, t.seed) would have (sharded_init).
            module = kind_of(model).build(model, device="meta", seed=None)
            apply_recompute(module, t.recompute)  # wraps bound forwards; survives the stage cut
            # training.freeze: requires_grad off before the cut; the stages keep it through the
            # tensor-parallel swap, and the optimizers take only parameters that require gradients.
            apply_freeze(module, t.freeze)
            return module

        self.runtime = ParallelRuntime.build(model, self.groups, training, parallel, optim, build_model=builder,
                                             per_token_loss=documents is not None and documents.per_token_loss,
                                             objective=objective)
        self.scaler = (DynamicLossScale(t.fp16_initial_scale, t.fp16_growth_interval)
                       if t.precision == "fp16" else None)

    def _model_inputs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Positions / document ids of packed documents (data.reset_*), else None."""
        return self.documents.model_inputs(tokens) if self.documents is not None else None

    def train_step(self, tokens: torch.Tensor, labels: torch.Tensor) -> StepResult:
        result = self.runtime.train_step(tokens, labels, self.scaler.scale if self.scaler else 1.0,
                                         self._model_inputs(tokens))
        if self.scaler is not None:
            self.scaler.update(overflowed=not result.stepped)
        return result

    def eval_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
        loss = self.runtime.eval_step(tokens, labels, self._model_inputs(tokens))
        # The runtime all-reduced the counted tokens over data-parallel ranks (per-token loss);
        # otherwise every token counts and each rank holds the same number of rows.
        count = self.runtime.token_count if self.runtime.per_token_loss else int(loss_token_count(labels)) * self.dp_size
        return loss, count

    def params_norm(self) -> float:
        """Counted once across ranks (collective)."""
        return self.runtime.optimizer.param_norm()

    def components(self) -> dict[str, Stateful]:
        # In this order: the optimizer is restored after the model (restore follows the dict's order).
        components: dict[str, Stateful] = {"model": ModelShards(self.runtime),
                                           "optimizer": OptimizerShards(self.runtime),
                                           "rng": RNGState(f"rng.rank{self.groups.rank}.", self.runtime.rng)}
        if self.scaler is not None:
            components["scaler"] = ScalerState(self.scaler)
        return components

    def seed(self, seed: int) -> None:
        seed_everything(seed)
        self.runtime.rng.seed_default()  # the default stream of this pipeline stage (same on tensor ranks)

    def set_lr(self, lr: float) -> None:
        for group in self.runtime.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        return self.runtime.optimizer.param_groups[0]["lr"]

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.loss_scale if self.scaler is not None else None

    def any_rank(self, flag: bool) -> bool:
        value = torch.tensor([1.0 if flag else 0.0], device=self.groups.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())


class ModelShards:
    """This rank's parameters as global DTensors under `model.<name>` (any layout reads them)."""

    def __init__(self, runtime: ParallelRuntime):
        self.runtime = runtime

    def state_dict(self) -> dict[str, object]:
        return self.runtime.model_state_dict()

    def load_template(self, stored: set[str]) -> dict[str, object]:
        return self.runtime.model_state_dict()

    def load_state_dict(self, state: dict[str, object]) -> None:
        load_model_state_dict(self.runtime.named_global_state(), state)  # type: ignore[arg-type]


class OptimizerShards:
    """The distributed optimizer's state as global tensors under the one-process keys (collective:
    gathers ZeRO shards per parameter); restored only when the checkpoint has optimizer state."""

    def __init__(self, runtime: ParallelRuntime):
        self.runtime = runtime

    def state_dict(self) -> dict[str, object]:
        return self.runtime.optimizer_state_dict()

    def load_template(self, stored: set[str]) -> dict[str, object]:
        return self.runtime.optimizer_state_dict() if any(k.startswith("optimizer.") for k in stored) else {}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.runtime.load_optimizer_state_dict(state)  # after the model: fp32 masters are re-read from it
