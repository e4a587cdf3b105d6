"""The hybrid kind's part of `validate_layout` (tessera.common.layout): what its Mamba layers lack
and how tensor parallel splits a pattern of mixed layers. Called through its registry entry."""

from __future__ import annotations

from typing import Any

from tessera.common.errors import UserError


def check_layout(cfg: Any, layout: Any) -> None:
    """Context parallel is built for attention only: a hybrid model's Mamba layers would need their
    scan state and convolution window passed from rank to rank along the sequence (Megatron's
    MambaContextParallel instead all-to-alls heads for sequence), which Tessera does not have."""
    if layout.context > 1:
        raise UserError(f"--context-parallel {layout.context} (parallel.context): hybrid models (model.kind: hybrid) "
                        "have no context-parallel Mamba layers; set it to 1 and split the sequence's work with "
                        "--tensor-parallel and --sequence-parallel instead")


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
