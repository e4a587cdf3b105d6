"""The hybrid kind's part of `validate_layout` (tessera.common.layout): what its Mamba layers lack
and how tensor parallel splits a pattern of mixed layers. Called through its registry entry."""

from __future__ import annotations

from typing import Any

from tessera.common.errors import UserError


def check_layout(cfg: Any, layout: Any) -> None:
    """Under context parallel each Mamba layer trades the sequence split for a head split
    (tessera.common.parallel.context_parallel): each of the tensor x context ranks holds whole heads
    and whole groups of B and C."""
    ranks = layout.tensor * layout.context
    if layout.context > 1 and cfg.mamba is not None and "M" in cfg.pattern:
        for field in ("num_heads", "num_groups"):
            value = getattr(cfg.mamba, field)
            if value % ranks:
                raise UserError(f"--context-parallel {layout.context} x --tensor-parallel {layout.tensor} must divide "
                                f"model.mamba.{field} ({value}): under context parallel each Mamba layer gives each "
                                "rank the whole sequence of its share of the heads and groups")


def check_tensor_parallel(cfg: Any, tp: int) -> None:
    """Each tensor rank holds whole Mamba heads and groups, whole attention (and key/value) heads, an
    equal slice of the MLPs and of the vocabulary, for the layer types the pattern uses."""
    used = set(cfg.pattern)
    if cfg.mamba is not None and "M" in used:
        for field in ("num_heads", "num_groups"):
            value = getattr(cfg.mamba, field)
            if value % tp:
                raise UserError(f"--tensor-parallel {tp} must divide model.mamba.{field} ({value}): each tensor "
                                "rank holds whole Mamba heads and whole groups of B and C")
    if "*" in used and cfg.num_heads is not None and cfg.kv_heads is not None:
        if cfg.num_heads % tp:
            raise UserError(f"--tensor-parallel {tp} must divide model.num_heads ({cfg.num_heads})")
        if cfg.kv_heads % tp:
            raise UserError(f"--tensor-parallel {tp} must divide model.num_kv_heads ({cfg.kv_heads}); key/value "
                            "heads are split, not replicated, so tensor parallel cannot exceed them")
    if "-" in used and cfg.ffn_hidden_size is not None and cfg.ffn_hidden_size % tp:
        raise UserError(f"--tensor-parallel {tp} must divide model.ffn_hidden_size ({cfg.ffn_hidden_size})")
    if cfg.vocab_size % tp:
        raise UserError(f"--tensor-parallel {tp} must divide model.vocab_size ({cfg.vocab_size}): the embedding "
                        "and head are split by vocabulary rows")
