"""Sharded initialisation: allocate only this rank's shards, fill them with the one-process weights.

The stages are cut from a model built on the meta device (no memory), then `to_empty` allocates
the local shards. To make the weights those a single process would draw from the same seed
(`build_model(cfg, seed=seed)`), the one-process initialisation is *replayed*: one generator,
seeded as `build_model` seeds it, visits the global model's modules in the same (name) order
through the model's `init_module` (Transformer's, HybridModel's, the encoder's, T5's, LLaVA's; T5
and LLaVA in their own `init_order`), each module materialised alone, at its global shape, on the
device; every rank copies out the slice it holds (its tensor-parallel shard of the stages it
holds, its expert-parallel slice of stacked experts; the tied head takes the embedding's slice) and drops the rest. So:

* any layout (TP, PP, interleaved, data replicas) starts from exactly the one-process weights,
  bit for bit, and replicas agree without a broadcast;
* peak extra memory is the largest single global tensor (the embedding), never the model.
  For Llama 3 70B that is 128256 x 8192 fp32 = 4.2 GB, transiently. An MoE layer is replayed
  as one unit (MoE.init_weights draws its stacked experts), so there it is one layer's experts.
* under fully sharded data parallel the runtime applies `fully_shard` to the meta stages first
  (`build_stages(prepare=...)`): `to_empty` then allocates only each parameter's data shard (a
  DTensor's local piece, FSDP's padding added at its lazy init), and the replayed value is cut
  to the tensor-parallel piece, then to this rank's FSDP chunk of it. A rank never holds more
  than its FSDP shard (1/fsdp_shards: data shards x expert x context ranks) of its tensor x
  pipeline share plus one replayed global tensor (measured
  in tests/trainer/test_plan_validation.py, FSDP 4: build peak 2.33 MB against 5.05 MB of fp32
  weights; the earlier order -- allocate the share, then shard -- peaked at 6.1 MB).

Cost: every rank draws every random number of the model (a rank must advance the generator
past tensors it does not hold, and a CPU Mersenne-Twister stream cannot skip ahead). On a GPU
this is a few seconds even at 70B. Rejected alternative: a generator seeded per parameter name
(each rank draws only what it holds, but the one-process weights of every existing run would
change, and with them every recorded loss curve); a counter-based (Philox) skip-ahead would give
both, on CUDA only.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.common.layers.moe import Experts, MoE
from tessera.common.layers.rope import reset_rotary_tables
from tessera.common.models.registry import kind_of
from tessera.common.parallel.expert_parallel import is_expert_shard
from tessera.common.parallel.layers import allocate as _allocate
from tessera.common.parallel.layers import shard_dim_of
from tessera.common.parallel.state import ParallelGroups


def _local_tensor(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _local_piece(value: torch.Tensor, local: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """The part of global tensor `value` that parameter `local` holds on this rank: its tensor-
    parallel chunk, its expert-parallel slice of stacked experts, and, for a fully-sharded
    parameter (a DTensor over the FSDP mesh, placement Shard(d) on its last dimension), this data
    shard's chunk of that (torch.chunk's split, as fully_shard cuts; possibly empty)."""
    dim = shard_dim_of(local)
    part = value if dim is None else value.chunk(groups.tp, dim=dim)[groups.tp_rank]
    if is_expert_shard(local):  # this expert-parallel rank's experts
        part = part.chunk(groups.ep, dim=0)[groups.ep_rank]
    if isinstance(local, DTensor):
        fsdp_dim = local.placements[-1].dim  # type: ignore[attr-defined]
        chunks = part.chunk(local.device_mesh.size(-1), dim=fsdp_dim)
        rank = local.device_mesh.get_coordinate()[-1]  # type: ignore[index]
        part = chunks[rank] if rank < len(chunks) else part.narrow(fsdp_dim, 0, 0)
    return part


def _init_sequence(whole: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules in the order the one-process init draws them: name order, or the model's own
    `init_order()` where its init follows another (T5's, as transformers draws it; LLaVA's tower
    by parameter name)."""
    if hasattr(whole, "init_order"):
        modules = dict(whole.named_modules())
        return [(name, modules[name]) for name in whole.init_order()]
    return sorted(whole.named_modules(), key=lambda kv: kv[0])


@torch.no_grad()
def materialize_stages(stages: list[nn.Module], groups: ParallelGroups, seed: int) -> None:
    """Allocate meta-built stages (StageModule, possibly fully sharded already) on the device and
    initialise every local shard to the one-process weights of `build_model(cfg, seed=seed)`.
    Not collective: every rank computes the same numbers."""
    device = groups.device
    held: dict[str, list[torch.Tensor]] = {}
    for st in stages:
        _allocate(st, device)
        st.reset_buffers()
        reset_rotary_tables(st)  # the tables (buffers), wherever the LM sits (LLaVA's language_model)
        for m in st.modules():
            if isinstance(m, MoE):
                m.expert_bias.zero_()  # model state, not a parameter: starts at zero as in init_weights
        for name, p in st.global_params().items():
            held.setdefault(name, []).append(p)
    cfg = stages[0].model.cfg
    whole = kind_of(cfg).build(cfg, device="meta", seed=None)  # the kind's whole model, for its init_module
    generator = torch.Generator(device=device).manual_seed(seed)
    written: set[str] = set()
    for mod_name, module in _init_sequence(whole):
        if isinstance(module, Experts):
            continue  # drawn by its MoE layer (MoE.init_weights), which comes first in name order
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if isinstance(module, MoE):
            own = [f"experts.{n}" for n, _ in module.experts.named_parameters()]
        if not own:
            continue
        tmp = copy.deepcopy(module)  # still meta: a fresh module to allocate at global shape
        # Only the tensors drawn here: a module with its own parameter over a subtree (CLIP's
        # `vision`: the class token over the whole tower) must not allocate the subtree.
        tmp.to_empty(device=device, recurse=any("." in n for n in own))
        whole.init_module(mod_name, tmp, generator)
        for pname in own:
            value = tmp.get_parameter(pname)
            full_name = f"{mod_name}.{pname}" if mod_name else pname
            for local in held.get(full_name, []):
                _local_tensor(local).copy_(_local_piece(value, local, groups).to(local.dtype))
                written.add(full_name)
        del tmp
    missing = sorted(set(held) - written)
    if missing:
        raise RuntimeError(f"sharded init: no initialisation rule reached {missing[:3]}; "
                           "extend the model's init_module")
