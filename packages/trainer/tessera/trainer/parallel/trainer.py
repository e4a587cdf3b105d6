"""The training loop under any parallel layout: `Trainer`'s loop, the runtime's step.

`ParallelTrainer` keeps everything of `tessera.trainer.trainer.Trainer` that does not depend on
the layout (config, data position, LR schedule, metrics, evaluation cadence, checkpoint files,
SIGTERM handling) and replaces four things with `ParallelRuntime` calls:

* building: process groups for the layout, then the runtime cuts the plain model (built from
  the run's seed, so every layout starts from the single-process weights) into pipeline chunks,
  swaps in tensor-parallel layers and wraps the parameters in data-parallel buckets with the
  (ZeRO-1) AdamW;
* the step: this data-parallel rank's rows of the global batch go to `runtime.train_step`, which
  does forward/backward over the micro-batches (pipeline schedule when pp > 1), the bucketed
  reductions, global-norm clipping and the optimizer step;
* evaluation: `runtime.eval_step` over whole global batches of the valid split;
* checkpoint state: `runtime.state_dict()` (layout-free global tensors under the one-process
  names) plus per-rank RNG streams, written and read by tessera.trainer.checkpointing.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from tessera.common.checkpoint import read_sidecar
from tessera.common.parallel.state import build_groups, set_groups
from tessera.trainer.checkpointing import (
    AsyncCheckpointer,
    TrainState,
    read_checkpoint,
    rng_state_tensors,
    set_rng_state_tensors,
    stored_keys,
    write_checkpoint,
)
from tessera.trainer.data import MixtureBatches
from tessera.trainer.model_setup import apply_recompute, build_train_model
from tessera.trainer.parallel.runtime import OptimConfig, ParallelConfig, ParallelRuntime
from tessera.trainer.precision import DynamicLossScale, Precision
from tessera.trainer.trainer import Trainer


class ParallelTrainer(Trainer):
    """Trainer whose step, evaluation and checkpoint state run on a ParallelRuntime."""

    def build_step(self) -> None:
        cfg, t, p = self.cfg, self.cfg.training, self.cfg.parallel
        self.groups = build_groups(self.inputs.layout, self.rt.device)
        set_groups(self.groups)

        def builder():
            model = build_train_model(self.model_cfg, self.rt.device, t.seed)
            apply_recompute(model, t.recompute)  # wraps bound forwards; survives the stage cut
            return model

        self.runtime = ParallelRuntime.build(
            self.model_cfg, self.groups,
            ParallelConfig(seq_len=t.seq_length, global_batch=t.global_batch_size, micro_batch=t.micro_batch_size,
                           sequence_parallel=p.sequence_parallel, distributed_optimizer=p.distributed_optimizer,
                           bucket_numel=p.bucket_numel, seed=t.seed,
                           autocast_bf16=t.precision == "bf16", autocast_fp16=t.precision == "fp16",
                           per_token_loss=self.inputs.documents is not None and self.inputs.documents.eod_mask_loss),
            OptimConfig(lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
                        weight_decay=cfg.optim.weight_decay, max_grad_norm=cfg.optim.grad_clip or None),
            build_model=builder)
        self.optimizer = self.runtime.optimizer  # param_groups: the LR schedule and the log read them
        # Autocast is the runtime's; fp16 adds the loss-scale policy (the runtime unscales,
        # detects overflow from the global gradient norm and skips the step).
        self.scaler = (DynamicLossScale(t.fp16_initial_scale, t.fp16_growth_interval)
                       if t.precision == "fp16" else None)
        self.precision = self.scaler or Precision("fp32", self.rt.device)  # .loss_scale for the log

    @property
    def dp_rank(self) -> int:
        return self.groups.dp_rank

    def _rows(self, data, first_sample: int, per_rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's rows of the global batch starting at `first_sample` (per_rank rows
        each; default: the full global batch's share)."""
        per_rank = per_rank or self.plan.per_rank
        start = first_sample + self.dp_rank * per_rank
        return data.batch(np.arange(start, start + per_rank))

    def _model_inputs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Positions / document ids of packed documents (data.reset_*), else None."""
        documents = self.inputs.documents
        return documents.model_inputs(tokens) if documents is not None else None

    # ---- steps -------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float, bool]:
        for group in self.optimizer.param_groups:
            group["lr"] = self.schedule(self.state.step)
        plan = self.plan_at(self.state.consumed_samples)
        tokens, labels = self._rows(self.train_data, self.state.consumed_samples, plan.per_rank)
        result = self.runtime.train_step(tokens, labels, self.scaler.scale if self.scaler else 1.0,
                                         self._model_inputs(tokens))
        if self.scaler is not None:
            self.scaler.update(overflowed=not result.stepped)
        self.advance()  # a skipped step still consumes its data, as in one process
        return result.loss, result.grad_norm, result.stepped

    def params_norm(self) -> float:
        """Global L2 norm of the parameters, counted once across ranks (collective)."""
        return self.runtime.optimizer.param_norm()

    def evaluate(self, data: MixtureBatches | None = None) -> float:
        """Mean loss over the first whole global batches of `data` (default: the valid split) covering
        eval_iters micro-batches per data-parallel rank (the same samples every time)."""
        data = data if data is not None else self.valid_data
        assert data is not None
        calls = math.ceil(self.cfg.training.eval_iters / self.plan.num_micro_batches)
        per_token = self.runtime.pcfg.per_token_loss
        total, counted = 0.0, 0
        for c in range(calls):
            tokens, labels = self._rows(data, c * self.cfg.training.global_batch_size)
            loss = self.runtime.eval_step(tokens, labels, self._model_inputs(tokens))
            # eod_mask_loss: each batch's per-token mean weighted by its counted tokens (the global
            # per-token mean, as in one process).
            total += loss * self.runtime.token_count if per_token else loss
            counted += self.runtime.token_count if per_token else 0
        return total / max(counted, 1) if per_token else total / calls

    # ---- checkpoint state --------------------------------------------------------------------
    def _rng_prefix(self) -> str:
        # Per rank: dropout streams differ across pipeline stages and (inside tensor-parallel
        # regions) tensor ranks, so each rank keeps its own under its global rank.
        return f"rng.rank{self.groups.rank}."

    def _rng_state(self) -> dict[str, torch.Tensor]:
        return {**rng_state_tensors(), **self.runtime.rng.state_dict()}

    def write_checkpoint(self, background: AsyncCheckpointer | None = None) -> Path:
        state = dict(self.runtime.state_dict())  # collective: gathers ZeRO shards per parameter
        state.update({self._rng_prefix() + k: v for k, v in self._rng_state().items()})
        if self.scaler is not None:
            state.update({f"scaler.{k}": v for k, v in self.scaler.state_tensors().items()})
        return write_checkpoint(self.cfg.checkpoint_dir, state, self.state, self.sidecar(), self.inputs.tokenizer,
                                self.cfg.checkpoint.keep_last, background)

    def load(self, directory: Path) -> None:
        """Model and optimizer from a checkpoint of any layout (or of one process); the RNG
        streams only when it was saved under this same layout (else they stay as seeded)."""
        sidecar = read_sidecar(directory)
        stored = stored_keys(directory)
        with_optimizer = any(k.startswith("optimizer.") for k in stored)
        state = dict(self.runtime.model_state_dict())
        if with_optimizer:
            state.update(self.runtime.optimizer_state_dict())
        state.update({f"train_state.{k}": v for k, v in TrainState().tensors().items()})
        rng_keys = {}
        if sidecar.layout == self.inputs.layout:
            rng_keys = {self._rng_prefix() + k: v for k, v in self._rng_state().items()
                        if self._rng_prefix() + k in stored}
        state.update(rng_keys)
        scaler_keys = {}
        if self.scaler is not None and "scaler.scale" in stored:  # else: fp16 resumed from fp32/bf16
            scaler_keys = {f"scaler.{k}": v for k, v in self.scaler.state_tensors().items()}
        state.update(scaler_keys)
        read_checkpoint(directory, state)
        if scaler_keys:
            self.scaler.load_state_tensors({k.removeprefix("scaler."): state[k] for k in scaler_keys})
        self.runtime.load_state_dict(state)
        self.state = TrainState.from_tensors({k.removeprefix("train_state."): v for k, v in state.items()
                                              if k.startswith("train_state.")})
        if rng_keys:
            rng = {k.removeprefix(self._rng_prefix()): v for k, v in rng_keys.items()}
            set_rng_state_tensors(rng)
            self.runtime.rng.load_state_dict(rng)
        elif self.groups.rank == 0:
            self.say(f"note: {directory} was saved under layout {sidecar.layout.short()}; RNG streams re-seeded "
                     f"for {self.inputs.layout.short()} (only dropout draws differ from an uninterrupted run)")

    def load_weights(self, directory: Path) -> None:
        """Model tensors only, from a checkpoint of any layout (checkpoint.init_from)."""
        state = dict(self.runtime.model_state_dict())
        read_checkpoint(directory, state)
        self.runtime.load_state_dict(state)

    def seed(self) -> None:
        super().seed()
        self.runtime.rng.seed_default()  # the default stream of this pipeline stage (same on tensor ranks)
