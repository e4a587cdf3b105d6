"""FSDP meshes and placements checked in one process: torch's "fake" backend (FakeStore) plays rank
`r` of a larger job (collectives return at once), so building the groups and the runtime for each
rank shows what that rank holds without launching it: which layouts build, the flattened FSDP
meshes' rank order, the checkpoint placements against FSDP's own chunks."""

from __future__ import annotations

import contextlib

import parallel_harness as H
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from tessera.common.layout import ParallelLayout
from tessera.common.models.causal_lm.model import Transformer
from tessera.common.parallel.expert_parallel import is_expert_shard
from tessera.common.parallel.state import build_groups, set_groups
from tessera.common.parallel.state_dict import to_global
from tessera.trainer.parallel.runtime import ParallelRuntime


@contextlib.contextmanager
def as_rank(rank: int, layout: ParallelLayout):
    """This process as rank `rank` of `layout`'s job (fake backend), with its groups."""
    dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=FakeStore())
    try:
        yield build_groups(layout, torch.device("cpu"))
    finally:
        set_groups(None)
        dist.destroy_process_group()


def build(groups, cfg, seq: int) -> ParallelRuntime:
    sections = H.sections(groups.layout, dict(seq_length=seq, global_batch_size=groups.layout.batch_readers,
                                              seed=H.MODEL_SEED))

    def meta_model():
        with torch.device("meta"):
            return Transformer(cfg)
    return ParallelRuntime.build(cfg, groups, *sections, build_model=meta_model)


@pytest.mark.parametrize("layout, seq", [
    (ParallelLayout(context=3, data=2, data_shard=2), 12),  # tessera-plan --gpus 12 proposes CP 3 x FSDP 2
    (ParallelLayout(data=3, data_shard=3), 16),
])
def test_fsdp_over_one_tensor_rank_builds_when_the_hidden_size_does_not_divide_the_shards(layout, seq):
    """Hidden 32 over 6 (or 3) FSDP shards: over one tensor rank every parameter is sharded along
    dim 0, which FSDP2 cuts unevenly (a tagged weight's hidden dim, as at tensor > 1, it refuses:
    NotImplementedError), and the checkpoint tensors are the global ones."""
    cfg = H.model_config()
    assert cfg.hidden_size % layout.fsdp_shards
    with as_rank(layout.world_size - 1, layout) as groups:
        rt = build(groups, cfg, seq)
        full = Transformer(cfg)
        shapes = {n: p.shape for n, p in full.named_parameters()}
        for name, p in rt.named_global_params().items():
            assert isinstance(p, DTensor) and p.placements[-1] == Shard(0), (name, p.placements)
            assert to_global(p.to_local(), p, groups).shape == shapes[name], name


def _fsdp_coordinates(layout: ParallelLayout):
    """For every rank: (its FSDP mesh coordinates, its expert mesh coordinates, its dp_shard / ep / cp ranks)."""
    out = {}
    for rank in range(layout.world_size):
        with as_rank(rank, layout) as g:
            out[rank] = (list(g.fsdp_mesh.get_coordinate()), list(g.fsdp_expert_mesh.get_coordinate()),
                         (g.dp_shard_rank, g.ep_rank, g.cp_rank, g.dp_replicate_rank))
    return out


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_flattened_fsdp_meshes_order_ranks_data_shard_then_expert_then_context(replicas):
    """EP 2 x CP 2 x FSDP 2 (x 2 HSDP replicas): "dp_shard_ep_cp" flattens dims that are not
    adjacent to "dp_shard_cp" (ep lies between); a rank's shard index must be s*ep*C + e*C + c on
    the dense mesh and s*C + c on the experts' mesh, with the replica index first under HSDP."""
    layout = ParallelLayout(expert=2, context=2, data=2 * replicas, data_shard=2)
    ep, cp = 2, 2
    for rank, (dense, expert, (s, e, c, r)) in _fsdp_coordinates(layout).items():
        rep = [r] if replicas > 1 else []
        assert dense == [*rep, s * ep * cp + e * cp + c], (rank, dense)
        assert expert == [*rep, s * cp + c], (rank, expert)


@pytest.mark.parametrize("replicas", [1, 2])
def test_expert_checkpoint_placements_cover_exactly_the_chunk_fsdp_holds(replicas):
    """Each rank's fully-sharded expert weight, presented as a global tensor on the 4-D expert state
    mesh (dp_replicate, dp_shard, ep, cp), has the local shape and global offset of the piece
    FSDP gave it: this expert rank's experts (dim 0), its (s*C + c)-th chunk of dim 1."""
    layout = ParallelLayout(expert=2, context=2, data=2 * replicas, data_shard=2)
    cfg = H.model_config(**H.MOE)
    seen = 0
    for rank in range(0, layout.world_size, 3 if replicas > 1 else 1):
        with as_rank(rank, layout) as g:
            rt = build(g, cfg, 16)
            for name, p in rt.named_global_params().items():
                if not is_expert_shard(p):
                    continue
                glob = to_global(p.to_local(), p, g)
                shape, offset = compute_local_shape_and_global_offset(glob.shape, glob.device_mesh, glob.placements)
                k, n = g.dp_shard_rank * g.cp + g.cp_rank, g.layout.fsdp_expert_shards
                rows = list(torch.arange(p.shape[1]).chunk(n))
                want_offset = [g.ep_rank * p.shape[0], int(rows[k][0]) if k < len(rows) else 0, 0]
                assert tuple(shape) == tuple(p.to_local().shape), (rank, name, shape)
                assert list(offset) == want_offset, (rank, name, offset, want_offset)
                seen += 1
    assert seen
