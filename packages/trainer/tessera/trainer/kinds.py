"""What tessera-train runs for each model kind: its code under the hook names the kind registry
gives (tessera.common.models.registry). A kind whose names are not here is refused in one line
by `trainer_kind`, which `check_inputs` calls before reading anything.

The parallel engine (tessera.trainer.parallel) trains the next-token objective only (its
vocabulary-parallel loss, its pipeline schedule's labels); a kind with another objective adds
its own here and there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.common.models.registry import kind_of, stage_hook
from tessera.trainer.data import MixtureBatches
from tessera.trainer.step import TrainStep

STAGE = "tessera-train"


@dataclass(frozen=True)
class TrainerKind:
    batches: type[MixtureBatches]  # (inputs, labels) batches from a mixture split
    step: type[TrainStep]  # one process: forward, the kind's loss, backward, optimizer step


BATCHES: dict[str, type[MixtureBatches]] = {"next_token": MixtureBatches}  # tokens, labels = tokens shifted
LOSSES: dict[str, type[TrainStep]] = {"next_token": TrainStep}  # mean next-token cross-entropy


def trainer_kind(model: Any) -> TrainerKind:
    """The trainer's code for `model`'s kind (a config, or the config section's fields)."""
    kind = kind_of(model)
    return TrainerKind(batches=stage_hook(kind, "train_batch", BATCHES, STAGE),
                       step=stage_hook(kind, "train_loss", LOSSES, STAGE))
