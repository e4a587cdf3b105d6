"""Expert parallel: each rank of an expert-parallel group holds E / ep of an MoE layer's experts,
and tokens travel to the rank of their expert and back (all-to-all dispatch and combine).

Expert e lives on EP rank e // (E / ep), as local expert e mod (E / ep): a contiguous slice of
the stacked expert weights along dim 0, so the checkpoint's global tensors are the
concatenation of the ranks' slices in rank order.

One MoE forward on an EP rank (MoE.forward sorts its own tokens' assignments by global expert id
and calls `dispatch`):
1. exchange counts: each rank learns how many tokens every other rank sends to each of its
   local experts (one all_to_all_single of E integers);
2. dispatch: all_to_all_single of the sorted tokens (rank r's slice goes to the rank holding
   experts of slice r); what arrives is ordered by source rank, then local expert;
3. regroup by local expert, run the local experts on contiguous slices, ungroup;
4. combine: the reverse all_to_all_single, so each rank gets its own tokens' outputs back in the
   order it sent them.
The backward of an all-to-all is the all-to-all with the split sizes swapped (`mappings.all_to_all_rows`).

Serving under tensor parallel (`shard_experts_over_tensor_ranks`, tessera-serve's
--enable-expert-parallel) is the other case: there every tensor rank already holds every token (the
attention's all-reduce leaves the residual stream replicated), so nothing travels. Each rank runs
its own experts on their contiguous slice of the sorted tokens (`LocalExperts`) and one all-reduce
sums the routed outputs, as the row-parallel layers of a dense MLP do: the experts' weights and
FLOPs are split N ways instead of replicated on every rank.
gloo implements all_to_all_single with uneven splits on CPU (ProcessGroupGloo::alltoall_base),
so the CPU tests run the same path as NCCL.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from tessera.common.layers.moe import Experts, MoE
from tessera.common.parallel.mappings import all_to_all_rows, reduce_from_tp


class ExpertDispatch:
    """MoE.dispatch under expert parallel: (local experts, tokens sorted by global expert, counts [E]) -> outputs."""

    def __init__(self, group: dist.ProcessGroup, ep: int):
        self.group, self.ep = group, ep

    def __call__(self, experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        local = counts.numel() // ep
        # recv[s, j]: tokens rank s sends to my local expert j.
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts.contiguous(), group=self.group)
        recv = recv.view(ep, local)
        send_split = counts.view(ep, local).sum(1).tolist()
        recv_split = recv.sum(1).tolist()
        arrived = all_to_all_rows(x, send_split, recv_split, self.group)
        # Arrived rows are ordered (source rank, local expert); regroup them by local expert.
        chunk_expert = torch.arange(local).repeat(ep)  # expert of each (source, expert) chunk
        sizes = recv.flatten()
        row_expert = chunk_expert.repeat_interleave(sizes.cpu())
        order = torch.argsort(row_expert, stable=True).to(x.device)
        y = experts(arrived[order], recv.sum(0).tolist())
        back = torch.empty_like(y).index_copy_(0, order, y)  # undo the regrouping
        return all_to_all_rows(back, recv_split, send_split, self.group)


class LocalExperts:
    """MoE.dispatch where every rank holds every token: this rank's experts on their slice of the
    sorted tokens; zeros for the rows of other ranks' experts (their share comes with `combine`)."""

    def __init__(self, ep: int, ep_rank: int):
        self.ep, self.ep_rank = ep, ep_rank

    def __call__(self, experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        local = counts.numel() // self.ep
        per_expert = counts.tolist()
        lo = sum(per_expert[:self.ep_rank * local])
        mine = per_expert[self.ep_rank * local:(self.ep_rank + 1) * local]
        y = x.new_zeros(x.shape[0], experts.down_proj.shape[1])
        y[lo:lo + sum(mine)] = experts(x[lo:lo + sum(mine)], mine)
        return y


def is_expert_shard(p: torch.Tensor) -> bool:
    """True for an MoE layer's expert weights under expert parallel (split over the expert group)."""
    return bool(getattr(p, "ep_shard", False))


def shard_experts(model: nn.Module, group: dist.ProcessGroup, ep: int, ep_rank: int) -> None:
    """Keep this rank's slice of every MoE layer's experts (in place; meta stays meta) and route its
    tokens through ExpertDispatch. Each expert parameter is tagged `ep_shard` (dim 0 over the
    expert-parallel group) for checkpoint and gradient code. ep = 1 changes nothing."""
    if ep == 1:
        return
    for m in _moe_layers(model):
        for part in _keep_slice(m, ep, ep_rank):
            part.ep_shard = True  # type: ignore[attr-defined]
        m.dispatch = ExpertDispatch(group, ep)


def shard_experts_over_tensor_ranks(model: nn.Module, group: dist.ProcessGroup, tp: int, tp_rank: int) -> None:
    """Serving under tensor parallel: keep this rank's slice of every MoE layer's experts (in place,
    on meta before the shard is loaded) tagged as split along dim 0 over the tensor group, which is
    how the shard loaders read them; run them through LocalExperts and sum the routed outputs over
    the ranks as a row-parallel layer's (`reduce_from_tp`)."""
    for m in _moe_layers(model):
        for part in _keep_slice(m, tp, tp_rank):
            part.tp_shard_dim = 0  # type: ignore[attr-defined]
        m.dispatch, m.combine = LocalExperts(tp, tp_rank), partial(reduce_from_tp, group=group)


def _moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def _keep_slice(m: MoE, ep: int, ep_rank: int) -> list[nn.Parameter]:
    """Replace `m`'s stacked expert weights by experts [ep_rank * E / ep, (ep_rank + 1) * E / ep)."""
    local = m.moe.num_experts // ep
    parts = []
    for name in ("gate_proj", "up_proj", "down_proj"):
        full = getattr(m.experts, name)
        if full is None:  # squared-ReLU experts (Nemotron-H's) have no gate
            continue
        part = nn.Parameter(full.detach()[ep_rank * local:(ep_rank + 1) * local].clone(),
                            requires_grad=full.requires_grad)
        for k, v in vars(full).items():  # keep tags set before (tensor-parallel tagging)
            setattr(part, k, v)
        setattr(m.experts, name, part)
        parts.append(part)
    return parts
