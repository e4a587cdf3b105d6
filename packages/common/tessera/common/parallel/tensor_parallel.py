"""Tensor parallelism beside the layers (tessera.common.parallel.layers): the vocabulary-parallel
logits and async-TP. Which of a model's modules are split is its kind's parallel plan
(`ModelKind.parallel`, e.g. tessera.common.models.causal_lm.parallelize).

Async-TP (`enable_async_tp`): on CUDA with NCCL, compiled blocks and sequence parallel, inductor's
micro-pipeline TP pass rewrites each all-gather -> matmul (q/k/v, gate/up) and matmul ->
reduce-scatter (o, down) of a compiled block into fused ops over symmetric memory that
overlap the transfer of one rank's chunk with the matmul of another's (torchtitan's
`enable_async_tensor_parallel`). The sequence gathers and reduce-scatters in `mappings` are
written in the split/cat form the pass matches. On gloo (CPU) there is no such pass and nothing
runs concurrently with a blocking collective, so there is nothing to overlap: refused there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.common.errors import UserError
from tessera.common.parallel.mappings import copy_to_tp, gather_seq
from tessera.common.parallel.state import ParallelGroups


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """Local vocab-slice logits [B, T, V/tp] from final hidden states (sequence-sharded under SP).

    `weight` is this rank's vocab slice of the head (or of the tied embedding).
    """
    group = model.tp_group  # type: ignore[attr-defined]
    if getattr(model, "sequence_parallel", False):
        hidden = gather_seq(hidden, group)
    else:
        hidden = copy_to_tp(hidden, group)
    # The model's head masks this slice's padded vocabulary rows (ids >= vocab_size) to -inf.
    return model.logits(hidden, weight, vocab_start=dist.get_rank(group) * weight.shape[0])


def enable_async_tp(groups: ParallelGroups, *, compiled: bool, sequence_parallel: bool) -> None:
    """Switch on inductor's micro-pipelined tensor parallel for the blocks compiled after this call.

    Refused with one line (UserError) unless the run is on CUDA with NCCL, tensor > 1, sequence
    parallel and compile: the pass acts only on compiled graphs, on the sequence-parallel
    all-gather/reduce-scatter pairs, with symmetric memory that only CUDA has."""
    if groups.device.type != "cuda" or dist.get_backend(groups.tp_group) != "nccl":
        raise UserError(f"parallel.async_tp needs CUDA GPUs with NCCL (this run: {groups.device.type}, "
                        f"{dist.get_backend(groups.tp_group)}); set parallel.async_tp=false")
    if groups.tp == 1 or not sequence_parallel or not compiled:
        raise UserError("parallel.async_tp needs parallel.tensor > 1, parallel.sequence_parallel=true and "
                        f"training.compile=true (got tensor={groups.tp}, sequence_parallel={sequence_parallel}, "
                        f"compile={compiled}); enable them or set parallel.async_tp=false")
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(groups.tp_group.group_name)
