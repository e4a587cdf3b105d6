"""Which model kinds tessera-train trains, and the options each refuses: what validating a config
asks (tessera.trainer.config), light enough to load without torch (nothing of a kind's code is
imported here). The code itself, under the same hook names, is tessera.trainer.objectives.registry's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tessera.common.errors import UserError
from tessera.common.models.registry import kind_of, stage_hook

STAGE = "tessera-train"

# The hook names (tessera.common.models.registry's train_batch / train_loss) this trainer has code
# for: each names a batch builder, a one-process step and a parallel objective in
# tessera.trainer.objectives.registry (whose tables have exactly these keys).
TRAINED: tuple[str, ...] = ("next_token", "mlm", "span", "vision_language")


# Options a kind's model has nothing for, by kind: (the field, whether a config asks for it, what to
# do instead). Each is refused in one line while the config is validated, before any launch.
REFUSED_OPTIONS: dict[str, tuple[tuple[str, Callable[[Any], bool], str], ...]] = {  # of a TrainConfig
    "encoder": (
        ("parallel.context", lambda c: c.parallel.context > 1,
         "context parallel is not built for encoders (BERT's samples are one short pair of sentences); "
         "set parallel.context=1"),
    ),
    "hybrid": (
        ("data.reset_position_ids", lambda c: c.data.reset_position_ids,
         "a hybrid model has no positions to reset; data.reset_attention_mask alone keeps packed documents "
         "apart (attention within each document, the Mamba state restarted at each)"),
    ),
}


def check_options(model: Any, cfg: Any) -> None:
    """A one-line UserError naming the first option of `cfg` (a TrainConfig) that `model`'s kind
    has nothing for."""
    kind = kind_of(model)
    for field, asked, why in REFUSED_OPTIONS.get(kind.name, ()):
        if asked(cfg):
            raise UserError(f"{field}: {why} (model kind {kind.name!r})")


def refused_fields(model: Any) -> set[str]:
    """The option fields `model`'s kind refuses (tessera-plan's layout search skips them)."""
    return {field for field, _, _ in REFUSED_OPTIONS.get(kind_of(model).name, ())}


def check_trainable(model: Any) -> None:
    """A one-line UserError unless this trainer has a batch builder and a loss for `model`'s kind
    (a config, or the config section's fields)."""
    trained = dict.fromkeys(TRAINED)
    stage_hook(model, "train_batch", trained, STAGE)
    stage_hook(model, "train_loss", trained, STAGE)
