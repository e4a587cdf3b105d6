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
The backward of an all-to-all is the all-to-all with the split sizes swapped (`_AllToAll`).
gloo implements all_to_all_single with uneven splits on CPU (ProcessGroupGloo::alltoall_base),
so the CPU tests run the same path as NCCL.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.common.layers.moe import Experts, MoE


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with uneven splits; backward sends the gradients back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


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
        arrived = _AllToAll.apply(x, send_split, recv_split, self.group)
        # Arrived rows are ordered (source rank, local expert); regroup them by local expert.
        chunk_expert = torch.arange(local).repeat(ep)  # expert of each (source, expert) chunk
        sizes = recv.flatten()
        row_expert = chunk_expert.repeat_interleave(sizes.cpu())
        order = torch.argsort(row_expert, stable=True).to(x.device)
        y = experts(arrived[order], recv.sum(0).tolist())
        back = torch.empty_like(y).index_copy_(0, order, y)  # undo the regrouping
        return _AllToAll.apply(back, recv_split, send_split, self.group)


def is_expert_shard(p: torch.Tensor) -> bool:
    """True for an MoE layer's expert weights under expert parallel (split over the expert group)."""
    return bool(getattr(p, "ep_shard", False))


def shard_experts(model: nn.Module, group: dist.ProcessGroup, ep: int, ep_rank: int) -> None:
    """Keep this rank's slice of every MoE layer's experts (in place; meta stays meta) and route its
    tokens through ExpertDispatch. Each expert parameter is tagged `ep_shard` (dim 0 over the
    expert-parallel group) for checkpoint and gradient code. ep = 1 changes nothing."""
    if ep == 1:
        return
    for m in model.modules():
        if not isinstance(m, MoE):
            continue
        e = m.moe.num_experts
        local = e // ep
        for name in ("gate_proj", "up_proj", "down_proj"):
            full = getattr(m.experts, name)
            if full is None:  # squared-ReLU experts (Nemotron-H's) have no gate
                continue
            part = nn.Parameter(full.detach()[ep_rank * local:(ep_rank + 1) * local].clone(),
                                requires_grad=full.requires_grad)
            for k, v in vars(full).items():  # keep tags set before (tensor-parallel tagging)
                setattr(part, k, v)
            part.ep_shard = True  # type: ignore[attr-defined]
            setattr(m.experts, name, part)
        m.dispatch = ExpertDispatch(group, ep)
