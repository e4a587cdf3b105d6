"""Check a parallel layout against the model and batch before any work starts.

Every problem is one UserError line naming the field and what to change.
"""

from __future__ import annotations

from tessera.common.errors import UserError
from tessera.common.layout import ParallelLayout
from tessera.common.model_config import ModelConfig


def split_layers(num_layers: int, num_stages: int, explicit: list[int] | None = None) -> list[int]:
    """Layers per pipeline stage (stage = virtual stage when interleaved), in stage order.

    Automatic: as even as possible, the remainder going to the middle stages, since the first
    stage also holds the embedding and the last the head and loss.
    """
    if explicit is not None:
        if len(explicit) != num_stages:
            raise UserError(f"--pipeline-layers: {len(explicit)} values given but the layout has {num_stages} "
                            "stages (pipeline x virtual-stages); give one count per stage")
        if any(n < 1 for n in explicit):
            raise UserError("--pipeline-layers: every stage needs at least one layer")
        if sum(explicit) != num_layers:
            raise UserError(f"--pipeline-layers: counts sum to {sum(explicit)} but the model has {num_layers} layers")
        return list(explicit)
    if num_layers < num_stages:
        raise UserError(f"layout: {num_stages} pipeline stages (pipeline x virtual-stages) but the model has only "
                        f"{num_layers} layers; lower --pipeline-parallel or --virtual-stages")
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    # Hand the extra layers to the stages nearest the middle.
    order = sorted(range(num_stages), key=lambda s: (abs(s - (num_stages - 1) / 2), s))
    for s in order[:extra]:
        counts[s] += 1
    return counts


def validate_layout(
    cfg: ModelConfig,
    layout: ParallelLayout,
    *,
    seq_len: int,
    global_batch: int,
    micro_batch: int,
    sequence_parallel: bool = False,
    pipeline_layers: list[int] | None = None,
    world_size: int | None = None,
) -> list[int]:
    """Raise UserError on the first size that does not divide; return the layers per stage."""
    tp, pp, dp, v = layout.tensor, layout.pipeline, layout.data, layout.virtual_stages
    if world_size is not None and layout.world_size != world_size:
        raise UserError(f"layout: tensor x context x expert x data x pipeline = {layout.world_size} but "
                        f"{world_size} processes were launched; data parallel is world size / (tensor x pipeline)")
    if layout.context > 1 or layout.expert > 1:
        raise UserError("layout: context and expert parallel are not supported yet; set them to 1")
    if cfg.num_heads % tp:
        raise UserError(f"--tensor-parallel {tp} must divide num_heads ({cfg.num_heads})")
    if cfg.kv_heads % tp:
        raise UserError(f"--tensor-parallel {tp} must divide num_kv_heads ({cfg.kv_heads}); key/value heads are "
                        "split, not replicated, so tensor parallel cannot exceed them")
    if cfg.ffn_hidden_size % tp:
        raise UserError(f"--tensor-parallel {tp} must divide ffn_hidden_size ({cfg.ffn_hidden_size})")
    if cfg.vocab_size % tp:
        raise UserError(f"--tensor-parallel {tp} must divide vocab_size ({cfg.vocab_size}); pad the vocabulary "
                        f"to a multiple of {tp}")
    if sequence_parallel and tp > 1 and seq_len % tp:
        raise UserError(f"sequence parallel: seq_len ({seq_len}) must be divisible by --tensor-parallel {tp}")
    if seq_len > cfg.max_seq_len:
        raise UserError(f"seq_len ({seq_len}) exceeds the model's max_seq_len ({cfg.max_seq_len})")
    if v > 1 and pp == 1:
        raise UserError("--virtual-stages above 1 needs --pipeline-parallel above 1")
    counts = split_layers(cfg.num_layers, pp * v, pipeline_layers)
    if micro_batch < 1 or global_batch % (micro_batch * dp):
        raise UserError(f"global batch ({global_batch}) must be a multiple of micro batch ({micro_batch}) x "
                        f"data parallel ({dp})")
    n_micro = global_batch // (micro_batch * dp)
    if pp > 1 and n_micro < pp:
        raise UserError(f"pipeline: {n_micro} micro-batches per step but {pp} stages; 1F1B needs at least as many "
                        "micro-batches as stages (raise the global batch or lower the micro batch)")
    if v > 1 and n_micro % pp:
        raise UserError(f"interleaved pipeline: micro-batches per step ({n_micro}) must be a multiple of "
                        f"--pipeline-parallel ({pp})")
    return counts
