"""`tessera-ckpt reshard`: rewrite a checkpoint partitioned for another parallel layout.

Stored tensors are global and layout-invariant, so the *values* never change; what changes is
which file holds which block. The output has one DCP file per rank of the target layout holding
exactly that rank's blocks (partition.py), so at load time each rank reads only its own file,
and the sidecar records the new layout with its layer split (`pipeline_layers`, resolved by the
trainer's rule, so any split the trainer runs, uneven, explicit or interleaved, is accepted). Training state travels too: optimizer tensors shaped like
a parameter are partitioned like it (and split over data-parallel ranks); everything else (scalars,
pickled scheduler/RNG state) is copied byte for byte into rank 0's file.

One process, no process group, one global tensor in memory at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tessera.ckpt_convert.dcp_writer import Chunk, ShardedDcpWriter, whole
from tessera.ckpt_convert.exporters.hf import expected_model_shapes
from tessera.ckpt_convert.kinds import check_convertible
from tessera.ckpt_convert.partition import match_param, model_chunks, state_chunks
from tessera.ckpt_convert.progress import Progress
from tessera.ckpt_convert.source import CheckpointSource
from tessera.common.checkpoint import (
    CHECKPOINT_KIND,
    MODEL_PREFIX,
    TOKENIZER_DIR,
    finalize_checkpoint,
    is_checkpoint_output,
    iter_dir_name,
    write_pointer,
)
from tessera.common.fileio import atomic_directory, check_output_directory, fsync_tree
from tessera.common.layout import ParallelLayout, validate_layout
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.models.causal_lm.hf.adapter import VOCAB_PARAMS
from tessera.common.models.encoder.model import VOCAB_PARAMS as ENCODER_VOCAB_PARAMS
from tessera.common.tokenizer import copy_tokenizer_files


def plan(src: CheckpointSource, layout: ParallelLayout,
         target: Any = None) -> tuple[dict[str, list[Chunk]], dict[str, int]]:
    """(DCP key -> the chunks each target rank stores, for every tensor in the checkpoint; DCP key ->
    new row count for the vocabulary tensors, and their optimizer state, when `target` re-pads the
    vocabulary)."""
    cfg = src.sidecar.model
    target = target or cfg
    expected = expected_model_shapes(cfg)  # the stored ones match it: CheckpointSource checked them
    out: dict[str, list[Chunk]] = {}
    resize: dict[str, int] = {}

    def shape_of(key: str, param: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if param in VOCAB_PARAMS + ENCODER_VOCAB_PARAMS and target is not cfg and target.vocab_rows != cfg.vocab_rows:
            resize[key] = target.vocab_rows
            return (target.vocab_rows, *shape[1:])
        return shape

    for key, spec in src.tensor_specs.items():
        if key.startswith(MODEL_PREFIX) and key[len(MODEL_PREFIX):] in expected:
            name = key[len(MODEL_PREFIX):]
            out[key] = model_chunks(name, shape_of(key, name, spec.shape), target, layout)
            continue
        param = match_param(key, expected, spec.shape) if not key.startswith(MODEL_PREFIX) else None
        out[key] = state_chunks(param, shape_of(key, param, spec.shape), target, layout) if param \
            else whole(spec.shape)
    return out, resize


def repad_rows(tensor: torch.Tensor, vocab_size: int, rows: int) -> torch.Tensor:
    """A vocabulary tensor (or its optimizer state) cut to its vocab_size real rows and zero-padded
    to `rows`: the padding is zero wherever it comes from (init, import, training: no gradient)."""
    real = tensor[:vocab_size]
    return torch.cat([real, real.new_zeros(rows - vocab_size, *real.shape[1:])])


def reshard(checkpoint: str | Path, output: str | Path, layout: ParallelLayout, overwrite: bool = False,
            quiet: bool = False, sync: bool = True) -> Path:
    """`sync=False`: no fsync of the output (see options.NO_SYNC_HELP); still renamed when whole."""
    src = CheckpointSource(checkpoint)
    output = Path(output)
    check_output_directory(output, overwrite, [src.directory], CHECKPOINT_KIND, is_checkpoint_output)
    # Megatron re-pads the vocabulary for each tensor-parallel size; here the rows are kept wherever
    # the new size divides them (a checkpoint stays layout-free) and re-padded when it does not.
    check_convertible(src.sidecar.model, "reshard")
    src.tokenizer()  # copied into the output: refused here if it does not fit the model
    cfg = src.sidecar.model
    # Hybrid models are never padded: their vocabulary must divide by the tensor size as it is.
    target_cfg = cfg.refit_for(layout.tensor) if isinstance(cfg, ModelConfig) else cfg
    validate_layout(target_cfg, layout)  # the trainer's check, without its batch and world-size parts
    layout = layout.resolved(target_cfg.num_layers)
    chunks, resize = plan(src, layout, target_cfg)
    planner_data = src.metadata.planner_data if isinstance(src.metadata.planner_data, dict) else {}
    step = src.sidecar.step
    total = sum(s.nbytes for s in src.tensor_specs.values())

    with src.checksum_check() as checksums, atomic_directory(output, overwrite=overwrite, sync=sync) as tmp, \
            Progress(total, len(chunks) + len(src.bytes_keys), f"reshard -> {layout.short()}", quiet) as bar:
        target = tmp / iter_dir_name(step)
        writer = ShardedDcpWriter(target, layout.world_size, sync=sync)
        try:
            for key, key_chunks in chunks.items():
                # Memory-mapped when stored whole; only written (the writer realigns what it computes on).
                tensor = src.load([key], raw=True)[key]
                if key in resize:
                    tensor = repad_rows(tensor, target_cfg.vocab_size, resize[key])
                writer.write_tensor(key, tensor, key_chunks, planner_data.get(key))
                bar.update(src.tensor_specs[key].nbytes)
                del tensor
            for key in src.bytes_keys:
                data, info = src.raw_bytes_item(key)
                writer.write_bytes(key, data, 0, info.transform_descriptors, planner_data.get(key))
                bar.update(0)
        except BaseException:
            writer.abort()
            raise
        written = writer.close()
        if src.tokenizer_dir is not None:
            copy_tokenizer_files(src.tokenizer_dir, target / TOKENIZER_DIR)
            if sync:
                fsync_tree(target / TOKENIZER_DIR)
        sidecar = src.sidecar.model_copy(deep=True)
        sidecar.layout = layout
        sidecar.model = target_cfg
        sidecar.resharded_from = src.sidecar.layout.short()  # type: ignore[attr-defined]  # extra field
        finalize_checkpoint(target, sidecar, written, sync=sync)  # rank files hashed as written; .metadata here
        write_pointer(tmp, step, sync=sync)
        checksums.wait()  # the input's checksums must match before the output is committed
    return output
