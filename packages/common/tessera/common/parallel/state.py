"""Process groups: the one place that holds distributed state.

`init_distributed()` joins the job torchrun started (or makes a one-process group when run
plainly), and `build_groups(layout)` lays the ranks out on a DeviceMesh in the project's rank
order (tensor fastest, then context, expert, data, pipeline) and returns a `ParallelGroups`
object (data parallel is two mesh dimensions, `dp_replicate` x `dp_shard`, flattened to `dp`). Every other parallel function takes that object as an argument; nothing else keeps
process groups. Expert parallel: the `ep` ranks of an expert group hold different experts of each MoE layer and
read different rows of the batch; for every other (dense) parameter they are replicas, as data
ranks are. So dense gradients are averaged over `dp_ep` (data x expert, flattened, expert index
fastest: `dp_ep_rank = dp_rank * ep + ep_rank`, which is also the rank's share of the batch), and
expert gradients over `dp` only. Fully sharded data parallel shards a dense parameter over the data shards
and the expert and context ranks, flattened (`ParallelLayout.fsdp_dims`: "dp_shard_ep_cp", say), and
an MoE layer's experts over data shards x context ranks (`fsdp_expert_dims`); `build_groups` flattens
exactly those, and `fsdp_mesh` / `fsdp_expert_mesh` hand them to fully_shard. `set_groups` / `get_groups` exist for code far from the entry point (a
metrics hook, say) that cannot have the object passed in.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessera.common.errors import UserError
from tessera.common.layout import ParallelLayout

# Mesh dimensions, slowest-varying first, so the flat rank = ((pp*dp + d)*ep + e)*cp + c)*tp + t,
# with the data index d = dp_replicate_rank * dp_shard + dp_shard_rank ("dp" is their flattening).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")


def join_torchrun_job(backend: str, timeout: datetime.timedelta | None = None) -> None:
    """`init_process_group` for a process torchrun started, with its store keys scoped to this attempt.

    torchrun's agent (c10d rendezvous, torch >= 2.5) hosts one TCPStore for the whole job and hands
    it to every attempt (TORCHELASTIC_USE_AGENT_STORE=True); `--max-restarts` restarts reuse it
    with the keys the dead attempt left behind. Group set-up keys carry no attempt number (gloo's
    full-mesh connect reads rank 1's address from the default group's namespace, `default_pg/…`;
    NCCL's unique id and every later group are named the same way in each new process), so a restarted rank could read its dead
    predecessor's address and fail to connect or hang (pytorch/pytorch#135712): seen as the
    intermittent failure of the torchrun-restart test. All keys go under
    `tessera/attempt_<TORCHELASTIC_RESTART_COUNT>/`, so each attempt starts from an empty
    namespace. The count is the agent's own, identical on every rank of one node; across nodes it
    can differ after a membership change, so multi-node jobs with restarts should set
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per round; then no prefix is applied).
    """
    kwargs = {} if timeout is None else {"timeout": timeout}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, **kwargs)  # env://: a store of this attempt's own
        return
    store, rank, world_size = next(dist.rendezvous("env://", **kwargs))
    if timeout is not None:
        store.set_timeout(timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"tessera/attempt_{attempt}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)


def init_distributed(timeout_s: float = 600.0) -> torch.device:
    """Join the process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...).

    Without that environment a one-process group is made, so single-process runs take the same
    code path. NCCL on GPUs, gloo on CPUs. Returns this rank's device.
    """
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return device
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ:
        join_torchrun_job(backend, timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device


@dataclass
class ParallelGroups:
    """This rank's place in the layout and the groups of each dimension.

    `embedding_group` joins the first and last pipeline stage of the same (tensor, data)
    coordinates; it carries the gradient all-reduce of tied embeddings (None when the pipeline
    has one stage).
    """

    layout: ParallelLayout
    mesh: DeviceMesh
    device: torch.device
    rank: int
    world_size: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    embedding_group: dist.ProcessGroup | None = None
    cp_rank: int = 0
    ep_rank: int = 0
    _groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, repr=False)
    # FSDP's meshes, made once by build_groups from the DeviceMeshes `_flatten` returned (slicing a
    # flattened dim from the root mesh at each access is deprecated by torch); empty without FSDP.
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self._groups["tp"]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self._groups["dp"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self._groups["pp"]

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self._groups["cp"]

    @property
    def cp(self) -> int:
        return self.layout.context

    @property
    def ep_group(self) -> dist.ProcessGroup:
        """The expert-parallel group: same tensor, context, data and pipeline coordinates."""
        return self._groups["ep"]

    @property
    def ep(self) -> int:
        return self.layout.expert

    @property
    def dp_ep_group(self) -> dist.ProcessGroup:
        """Data x expert ranks: the replicas of a dense parameter, each reading its own batch rows."""
        return self._groups["dp_ep"]

    @property
    def dp_ep(self) -> int:
        """How many ways the global batch is split: data x expert."""
        return self.layout.batch_readers

    @property
    def dp_ep_rank(self) -> int:
        """This rank's share of the global batch (rows dp_ep_rank * B / dp_ep onwards)."""
        return self.dp_rank * self.layout.expert + self.ep_rank

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_shard(self) -> int:
        """Data ranks sharing one copy of the parameters (FSDP); 1 without parameter sharding."""
        return self.layout.data_shard

    @property
    def dp_shard_rank(self) -> int:
        return self.dp_rank % self.layout.data_shard

    @property
    def dp_replicate_rank(self) -> int:
        return self.dp_rank // self.layout.data_shard

    @property
    def dp_replicate_group(self) -> dist.ProcessGroup:
        return self._groups["dp_replicate"]

    @property
    def fsdp_shard_dim(self) -> str:
        """The mesh dimension dense parameters are fully sharded over: the data shards, flattened with
        the expert ranks (replicas of every dense parameter, torchtitan's dense mesh) and the context
        ranks (each runs the same parameters on its part of the sequence: torchtitan's dp_shard_cp),
        slowest first ("dp_shard", "dp_shard_ep", "dp_shard_cp" or "dp_shard_ep_cp")."""
        return "_".join(self.layout.fsdp_dims)

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """fully_shard's mesh for dense parameters: (shard,), or ("dp_replicate", shard) for HSDP,
        shard being `fsdp_shard_dim`."""
        return self._fsdp("fsdp")

    @property
    def fsdp_expert_mesh(self) -> DeviceMesh:
        """fully_shard's mesh for an MoE layer's (expert-parallel) experts: the data shards (x context
        ranks) of their expert group, alone or after "dp_replicate" (torchtitan's dp_shard_mod_ep)."""
        return self._fsdp("fsdp_expert")

    @property
    def fsdp_state_mesh(self) -> DeviceMesh:
        """The mesh a fully-sharded dense parameter's checkpoint tensor lives on: data replicas, FSDP
        shards (`fsdp_shard_dim`), tensor."""
        return self._fsdp("fsdp_state")

    @property
    def fsdp_expert_state_mesh(self) -> DeviceMesh:
        """The mesh a fully-sharded expert weight's checkpoint tensor lives on: data replicas, data
        shards, experts, then context ranks when they share the FSDP shards (a flattened
        "dp_shard_cp" cannot precede "ep", which lies between its dims; the data shard and context
        placements then split the same dim, data shards outer, as the flattened rank does)."""
        return self.mesh[("dp_replicate", "dp_shard", "ep") + ("cp",) * (self.layout.context > 1)]

    def _fsdp(self, name: str) -> DeviceMesh:
        if name not in self._meshes:
            raise RuntimeError(f"{name} mesh: the layout {self.layout.short()} is not fully sharded (data_shard 1)")
        return self._meshes[name]

    @property
    def tp(self) -> int:
        return self.layout.tensor

    @property
    def dp(self) -> int:
        return self.layout.data

    @property
    def pp(self) -> int:
        return self.layout.pipeline

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0


def build_groups(layout: ParallelLayout, device: torch.device | None = None) -> ParallelGroups:
    """Build the mesh and every group for `layout`. Collective: every rank must call it."""
    if not dist.is_initialized():
        raise RuntimeError("call init_distributed() before build_groups()")
    world = dist.get_world_size()
    if layout.world_size != world:
        raise UserError(
            f"parallel layout {layout.short()} needs {layout.world_size} processes but the job has {world}; "
            "set --nproc-per-node/--nnodes so that tensor x context x expert x data x pipeline = world size"
        )
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                        else torch.device("cpu"))
    if layout.data % layout.data_shard:
        raise UserError(f"--data-shard {layout.data_shard} must divide the data-parallel size ({layout.data})")
    shape = (layout.pipeline, layout.data_replicate, layout.data_shard, layout.expert, layout.context, layout.tensor)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    mesh["dp_replicate", "dp_shard", "ep"]._flatten("dp_ep")
    meshes: dict[str, DeviceMesh] = {}
    if layout.data_shard > 1:  # FSDP's shard dims (ParallelGroups.fsdp_mesh), in one order on every rank
        flat = {"_".join(dims): mesh[dims]._flatten("_".join(dims)) if len(dims) > 1 else mesh[dims[0]]
                for dims in dict.fromkeys((layout.fsdp_dims, layout.fsdp_expert_dims))}
        dense, expert = "_".join(layout.fsdp_dims), "_".join(layout.fsdp_expert_dims)
        hsdp = layout.data_replicate > 1  # (a 2-D mesh with a flattened dim: sliced from the root, once)
        meshes["fsdp"] = mesh["dp_replicate", dense] if hsdp else flat[dense]
        meshes["fsdp_expert"] = mesh["dp_replicate", expert] if hsdp else flat[expert]
        meshes["fsdp_state"] = mesh["dp_replicate", dense, "tp"]
    groups = {name: mesh[name].get_group() for name in (*MESH_DIMS, "dp", "dp_ep")}
    rank = dist.get_rank()
    coords = mesh.get_coordinate()
    assert coords is not None
    pp_rank, rep_rank, shard_rank, ep_rank, cp_rank, tp_rank = coords
    dp_rank = rep_rank * layout.data_shard + shard_rank
    embedding_group = None
    if layout.pipeline > 1:
        # Every rank creates every group (new_group is collective), then keeps its own.
        stride = world // layout.pipeline
        for base in range(stride):
            members = [base, base + (layout.pipeline - 1) * stride]
            g = dist.new_group(members)
            if rank in members:
                embedding_group = g
    return ParallelGroups(layout=layout, mesh=mesh, device=device, rank=rank, world_size=world,
                          tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank,
                          embedding_group=embedding_group, cp_rank=cp_rank, ep_rank=ep_rank,
                          _groups=groups, _meshes=meshes)


_CURRENT: ParallelGroups | None = None


def set_groups(groups: ParallelGroups | None) -> None:
    global _CURRENT
    _CURRENT = groups


def get_groups() -> ParallelGroups:
    if _CURRENT is None:
        raise RuntimeError("no parallel groups set; call set_groups(build_groups(layout)) first")
    return _CURRENT


def destroy_distributed() -> None:
    set_groups(None)
    if dist.is_initialized():
        dist.destroy_process_group()
