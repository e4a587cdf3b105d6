"""Layout-free checkpoint tensors: local shards presented as global DTensors.

A parameter split over tensor ranks along dim d becomes DTensor(Shard(d)) on the tensor mesh, a
replicated one DTensor(Replicate()), an expert-parallel slice of an MoE layer's stacked experts
DTensor(Shard(0)) on the expert mesh. torch.distributed.checkpoint then stores each tensor by
its global coordinates, once (replicas across data or tensor ranks are de-duplicated), and a
load at any other layout reads exactly the slice each rank needs. Names are the plain model's
(`model.layers.<global layer>.attn.q_proj.weight`...), so what is on disk does not depend on the
layout it was written from.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tessera.common.parallel.expert_parallel import is_expert_shard
from tessera.common.parallel.layers import shard_dim_of
from tessera.common.parallel.state import ParallelGroups

MODEL_PREFIX = "model."


def to_global(local: torch.Tensor, like: torch.Tensor, groups: ParallelGroups) -> DTensor:
    """Wrap `local` (shaped as parameter `like`'s shard) as a global DTensor with like's placement.

    `like` may be a fully-sharded (FSDP) parameter, a DTensor sharded over the data ranks whose
    local piece is itself a piece of the tensor-parallel shard: the result then lives on the
    (dp_replicate, dp_shard, tp) mesh (dp_shard flattened with the expert and context ranks for dense
    parameters, `ParallelGroups.fsdp_shard_dim`; an expert slice on (dp_replicate, dp_shard, ep[, cp])),
    replicated over replicas, sharded over data shards along
    FSDP's dim and over tensor ranks along the tensor-parallel dim. When both split the same
    dim (a tensor-sharded bias) the tensor chunk comes first and the data chunk within it,
    which is `_StridedShard(dim, split_factor=tp)` on the data dim."""
    if is_expert_shard(like):
        # An expert-parallel slice of stacked experts (experts' own tensor size is 1): dim 0 over
        # the expert group; replicas over tensor and data ranks are de-duplicated by DCP.
        local = local.to_local() if isinstance(local, DTensor) else local
        if not isinstance(like, DTensor):
            return DTensor.from_local(local, groups.mesh["ep"], [Shard(0)], run_check=False)
        # Fully sharded too (EP x FSDP): the slice is split over the data shards (x context ranks)
        # of its expert group along a non-expert dim, so the pieces are rectangles of the global tensor.
        fsdp_dim = like.placements[-1].dim  # type: ignore[attr-defined]
        shape = [like.shape[0] * groups.ep, *like.shape[1:]]
        stride = torch.empty(shape, device="meta").stride()
        placements = [Replicate(), Shard(fsdp_dim), Shard(0)] + [Shard(fsdp_dim)] * (groups.cp > 1)
        return DTensor.from_local(local, groups.fsdp_expert_state_mesh, placements,
                                  run_check=False, shape=torch.Size(shape), stride=stride)
    dim = shard_dim_of(like)
    tp_placement = Shard(dim) if dim is not None else Replicate()
    if isinstance(local, DTensor):
        local = local.to_local()
    if not isinstance(like, DTensor):
        return DTensor.from_local(local, groups.tp_mesh, [tp_placement], run_check=False)
    fsdp_dim = like.placements[-1].dim  # type: ignore[attr-defined]
    if groups.tp == 1:  # one tensor rank: nothing split along the tag (FSDP's dim is then 0)
        dim, tp_placement = None, Replicate()
    dp_placement = _StridedShard(fsdp_dim, split_factor=groups.tp) if fsdp_dim == dim else Shard(fsdp_dim)
    shape = list(like.shape)
    if dim is not None:
        shape[dim] *= groups.tp
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, groups.fsdp_state_mesh, [Replicate(), dp_placement, tp_placement],
                              run_check=False, shape=torch.Size(shape), stride=stride)


def model_state_dict(named_params: dict[str, torch.Tensor], groups: ParallelGroups) -> dict[str, DTensor]:
    """{'model.<global name>': DTensor} over this rank's parameters (copies, safe to hand to DCP)."""
    return {MODEL_PREFIX + n: to_global(p.detach().clone(), p, groups) for n, p in named_params.items()}


def load_model_state_dict(named_params: dict[str, torch.Tensor], state: dict[str, DTensor]) -> None:
    """Copy loaded global tensors (as built by `model_state_dict`, then filled by DCP) into the
    local parameters, in place (parameters may be views into flat data-parallel buffers)."""
    with torch.no_grad():
        for n, p in named_params.items():
            (p.to_local() if isinstance(p, DTensor) else p).copy_(state[MODEL_PREFIX + n].to_local())
