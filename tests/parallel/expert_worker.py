"""One MoE layer, expert parallel over all ranks vs the same layer in one process (torchrun worker).

Every rank builds the whole layer from one seed and runs the one-process reference on the whole
batch; then it keeps its experts (shard_experts), runs its own rows through the all-to-all
dispatch, and writes its outputs and gradients to `<out>.rank<R>.pt` next to the reference's.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tessera.common.layers.moe import MoE
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.common.parallel.expert_parallel import shard_experts


def main() -> None:
    torch.set_num_threads(1)
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, ffn_hidden_size=32,
                      max_seq_len=16, moe=dict(num_experts=4, top_k=2, ffn_hidden_size=8, num_shared_experts=1,
                                               aux_loss_coef=0.0))
    torch.manual_seed(0)
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.5)
    x = torch.randn(world * 6, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    w = torch.randn(world * 6, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    xf = x.clone().requires_grad_(True)
    ref_y = layer(xf)
    (ref_y * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    shard_experts(layer, dist.group.WORLD, world, rank)
    rows = slice(rank * 6, (rank + 1) * 6)
    xr = x[rows].clone().requires_grad_(True)
    y = layer(xr)
    (y * w[rows]).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    torch.save({"y": y.detach(), "ref_y": ref_y[rows].detach(), "x_grad": xr.grad, "ref_x_grad": xf.grad[rows], "grads": grads,
                "ref_grads": ref_grads, "load": layer.stats["load"]}, f"{out}.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
