"""The vision-language kind's part of `validate_layout` (tessera.common.layout): the tower's own
sizes; the language model's are the shared checks', run on `cfg.text`. Called through its registry
entry."""

from __future__ import annotations

from typing import Any

from tessera.common.errors import UserError


def check_layout(cfg: Any, layout: Any) -> Any:
    """The tower and projector split by the tensor size; the rest is the LM's (returned: the config
    the shared checks go on with)."""
    _check_vision_language(cfg, layout)
    return cfg.text


def _check_vision_language(cfg: Any, layout: Any) -> None:
    """LLaVA (common/models/vision_language/parallelize.py): each tensor rank holds whole tower heads
    and equal slices of the tower's MLPs (and of the projector, split by the LM's width, which the
    LM's own check covers), and under FSDP equal pieces of them along the tower's width; context
    parallel embeds whole rows on every context rank (objectives/multimodal/objective.py), which a
    later pipeline stage cannot."""
    if layout.context > 1 and layout.pipeline > 1:
        raise UserError(f"--context-parallel {layout.context} with --pipeline-parallel {layout.pipeline}: not built for "
                        "the vision-language kind (its first stage embeds whole rows before the context cut); set one "
                        "of them to 1")
    tp = layout.tensor
    for field in ("num_heads", "ffn_hidden_size"):
        value = getattr(cfg.vision, field)
        if value % tp:
            raise UserError(f"--tensor-parallel {tp} must divide model.vision.{field} ({value}): the vision tower's "
                            "blocks are split like the language model's")
    d, shards = cfg.vision.hidden_size, layout.fsdp_shards
    if layout.data_shard > 1 and tp > 1 and d % shards:
        # The tower's tensor-split weights and the projector's linear_1 are fully sharded along
        # their other dim, the tower's width, which FSDP2 cuts only evenly (the LM's own check
        # covers its hidden size).
        by = f"--data-shard {layout.data_shard}" + (f" x --expert-parallel {layout.expert}" if layout.expert > 1 else "")
        raise UserError(f"{by} with --tensor-parallel {tp} must divide model.vision.hidden_size ({d}): FSDP splits "
                        f"each tensor-parallel weight of the tower along its width, evenly; change "
                        f"{by.replace(' x ', ' or ')}, or use --tensor-parallel 1")
