"""Each model kind's training objective, under the hook names the kind registry gives
(tessera.common.models.registry): its batch builder, its one-process step and its objective under
the parallel runtime, each loaded when asked for. Which names there are, and the check that refuses
a kind without them while the config is validated, are tessera.trainer.kinds' (light).

The parallel engine (tessera.trainer.parallel) runs a kind's objective (OBJECTIVES, under the
same `train_loss` name: what enters the pipeline's stages and the vocab-parallel loss;
tessera.trainer.objectives.objective says how one plugs in).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tessera.common.models.registry import stage_hook
from tessera.trainer.kinds import STAGE

if TYPE_CHECKING:
    from tessera.trainer.objectives.batches import MixtureBatches
    from tessera.trainer.objectives.step import TrainStep


@dataclass(frozen=True)
class TrainerKind:
    batches: type[MixtureBatches]  # (inputs, labels) batches from a mixture split
    step: type[TrainStep]  # one process: forward, the kind's loss, backward, optimizer step


def _next_token_batches() -> type[MixtureBatches]:
    from tessera.trainer.objectives.batches import MixtureBatches  # labels = the inputs shifted by one token

    return MixtureBatches


def _next_token_step() -> type[TrainStep]:
    from tessera.trainer.objectives.step import TrainStep  # mean next-token cross-entropy

    return TrainStep


BATCHES: dict[str, Callable[[], type[MixtureBatches]]] = {"next_token": _next_token_batches}
LOSSES: dict[str, Callable[[], type[TrainStep]]] = {"next_token": _next_token_step}


def _mlm_batches() -> type[MixtureBatches]:
    from tessera.trainer.objectives.mlm.batches import (
        MLMBatches,  # BERT sentence pairs, masks drawn per sample
    )

    return MLMBatches  # type: ignore[return-value]


def _mlm_step() -> type[TrainStep]:
    from tessera.trainer.objectives.mlm.loss import (
        MLMStep,  # masked-token cross-entropy (+ the binary head's)
    )

    return MLMStep


def _next_token_objective() -> type:
    from tessera.trainer.objectives.objective import NextToken

    return NextToken


def _mlm_objective() -> type:
    from tessera.trainer.objectives.mlm.objective import MaskedLM

    return MaskedLM


BATCHES["mlm"] = _mlm_batches
LOSSES["mlm"] = _mlm_step
# The parallel runtime's objective per train_loss name (tessera.trainer.objectives.objective).
OBJECTIVES: dict[str, Callable[[], type]] = {"next_token": _next_token_objective, "mlm": _mlm_objective}


def _span_batches() -> type[MixtureBatches]:
    from tessera.trainer.objectives.span.batches import SpanBatches  # T5 span corruption, drawn per sample

    return SpanBatches  # type: ignore[return-value]


def _span_step() -> type[TrainStep]:
    from tessera.trainer.objectives.span.loss import SpanStep  # the decoder's cross-entropy over the targets

    return SpanStep


def _span_objective() -> type:
    from tessera.trainer.objectives.span.objective import SpanCorruption

    return SpanCorruption


BATCHES["span"] = _span_batches
LOSSES["span"] = _span_step
OBJECTIVES["span"] = _span_objective


def _vision_language_batches() -> type[MixtureBatches]:
    from tessera.trainer.objectives.multimodal.batches import (
        VisionLanguageBatches,  # one sample per row, images whole
    )

    return VisionLanguageBatches  # type: ignore[return-value]


def _vision_language_step() -> type[TrainStep]:
    from tessera.trainer.objectives.multimodal.loss import (
        VisionLanguageStep,  # cross-entropy over the answer tokens
    )

    return VisionLanguageStep


def _vision_language_objective() -> type:
    from tessera.trainer.objectives.multimodal.objective import VisionLanguage

    return VisionLanguage


BATCHES["vision_language"] = _vision_language_batches
LOSSES["vision_language"] = _vision_language_step
OBJECTIVES["vision_language"] = _vision_language_objective


def batch_builder(cfg: Any, inputs: Any) -> Callable[..., MixtureBatches]:
    """The kind's batch builder bound to this run: what it needs beyond (split, seq_length,
    documents) it takes from the config and the checked inputs (`for_run`, when it has one)."""
    builder = trainer_kind(inputs.model).batches
    bind = getattr(builder, "for_run", None)
    return bind(cfg, inputs) if bind is not None else builder


def parallel_objective(model: Any) -> Any:
    """The parallel runtime's objective for `model`'s kind (a config), built for it."""
    return stage_hook(model, "train_loss", OBJECTIVES, STAGE)()(model)


def trainer_kind(model: Any) -> TrainerKind:
    """The trainer's code for `model`'s kind."""
    return TrainerKind(batches=stage_hook(model, "train_batch", BATCHES, STAGE)(),
                       step=stage_hook(model, "train_loss", LOSSES, STAGE)())
