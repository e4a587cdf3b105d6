"""The encoder-decoder kind's part of `validate_layout` (tessera.common.layout): the dimensions
not built for it. Called through its registry entry."""

from __future__ import annotations

from typing import Any

from tessera.common.errors import UserError


def check_layout(cfg: Any, layout: Any) -> None:
    pp = layout.pipeline
    if pp > 1 or layout.context > 1:
        raise UserError(f"--pipeline-parallel {pp} / --context-parallel {layout.context}: not built for the "
                        "encoder-decoder kind (T5): Megatron gives encoder and decoder their own pipeline stages, "
                        "Tessera's pipeline cuts one stack of layers; set both to 1 and split with tensor, sequence, "
                        "data or fully sharded data parallel")
