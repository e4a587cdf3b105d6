"""Mixture of experts: a router and stacked SwiGLU experts in place of the dense MLP.

Routing, per token (as Mixtral, Qwen3-MoE and DeepSeek-V3 compute it, in fp32):
1. scores = softmax(router logits) or sigmoid(logits) (DeepSeek-V3);
2. selection: top-k of the scores, plus the balancing bias when `bias_balancing` (the bias picks
   experts but never weighs them); with `num_groups` > 1, first keep the `topk_groups` groups
   whose two best scores sum highest (DeepSeek-V3's grouped routing), then top-k within them;
3. weights = the selected scores, renormalised to sum to 1 when `norm_topk_prob`, times
   `routed_scaling_factor`.
Tokens are then sorted by expert and each expert runs on its contiguous slice: one
`torch._grouped_mm` per projection on CUDA devices that support it (sm90+, bf16), a loop over
the experts elsewhere (`torch._grouped_mm` runs forward on CPU in torch 2.13 but its backward
fails on empty groups: seen). Dropless by default; with `capacity_factor` each expert takes at
most ceil(factor x tokens x top_k / experts) assignments, first come first served in token
order, and the rest are dropped (their weight lost, the residual stream carries the token).

Load balancing:
- the auxiliary loss (Switch / Mixtral form): num_experts x sum_e (tokens routed to e / tokens)
  x (mean router probability of e), per layer, times `aux_loss_coef`. It enters training through
  the gradient (`AuxLoss` below adds its gradient to the block's output in backward, as
  Megatron-Core's MoEAuxLossAutoScaler does), so every engine (one process, pipeline) trains
  with it without changing the loss plumbing; its value is reported in the router statistics.
- auxiliary-loss-free balancing (DeepSeek-V3): `expert_bias` [E], a persistent buffer (model
  state, saved in checkpoints), nudged after each optimizer step by `update_bias`:
  bias += rate x sign(mean load - load of e).

Router statistics of the last forward (`stats`: per-expert load, dropped assignments, aux loss)
are read by the trainer and logged with the loss.

Experts are SwiGLU MLPs, or squared-ReLU MLPs without a gate when the config's activation is
`squared_relu` (Nemotron-H's; only the hybrid kind's layer config allows it), the shared experts
alike.

Parameter names are the checkpoint contract: `router.weight` [E, d], `experts.gate_proj` /
`experts.up_proj` [E, f, d], `experts.down_proj` [E, d, f] (gate and up stored apart, experts
stacked along dim 0 so an expert-parallel shard is a contiguous slice; no gate_proj for squared
ReLU), `shared.*` the shared experts as one dense MLP.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.common.models.causal_lm.config import ModelConfig


class AuxLoss(torch.autograd.Function):
    """Identity on `out`; in backward, gives `aux` the gradient `scale` (so d(total)/d(aux) = scale)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class Experts(nn.Module):
    """E SwiGLU (or, `gated=False`, squared-ReLU) MLPs as stacked weights (this rank's experts
    under expert parallel)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, gated: bool = True):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, ffn, hidden)) if gated else None
        self.up_proj = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [M, d]: tokens sorted by expert, counts[e] of them for expert e -> [M, d]."""
        if _grouped_mm_ok(x):
            offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            up = torch._grouped_mm(x, self.up_proj.transpose(1, 2), offs=offs)
            if self.gate_proj is None:
                h = F.relu(up).square()
            else:
                h = F.silu(torch._grouped_mm(x, self.gate_proj.transpose(1, 2), offs=offs)) * up
            return torch._grouped_mm(h, self.down_proj.transpose(1, 2), offs=offs)
        outs = []
        for e, chunk in enumerate(x.split(counts)):
            if chunk.shape[0]:
                up = F.linear(chunk, self.up_proj[e])
                h = F.relu(up).square() if self.gate_proj is None else F.silu(F.linear(chunk, self.gate_proj[e])) * up
                outs.append(F.linear(h, self.down_proj[e]))
        return torch.cat(outs) if outs else x.new_zeros(0, self.down_proj.shape[1])


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    # torch._grouped_mm is private (in every torch >= 2.11 this project supports, Hopper+ bf16 only):
    # the hasattr keeps a later torch that renames it on the per-expert loop instead of failing.
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


class SharedExperts(nn.Module):
    """The shared experts: one dense SwiGLU (or, `gated=False`, squared-ReLU) MLP every token goes
    through."""

    def __init__(self, hidden: int, ffn: int, gated: bool = True):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False) if gated else None
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(F.relu(self.up_proj(x)).square())
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    # Gradient given to each layer's aux loss per backward (the trainer sets it, e.g. to
    # coefficient / micro-batches); the coefficient alone by default.
    aux_loss_scale: float | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.moe = moe
        self.router = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        gated = cfg.activation != "squared_relu"
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.ffn_hidden_size, gated)
        self.shared = SharedExperts(cfg.hidden_size, moe.shared_size, gated) if moe.shared_size else None
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts), persistent=True)
        self.stats: dict[str, torch.Tensor] = {}
        # Expert-parallel hooks (set by tessera.common.parallel.expert_parallel): `dispatch` runs the
        # sorted token slices on the ranks holding their experts (None: every expert here);
        # `combine` sums the routed output over ranks that each computed only their own experts'
        # share of every token (serving under tensor parallel), before the shared experts.
        self.dispatch = None
        self.combine = None

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, generator: torch.Generator | None) -> None:
        for w, s in ((self.experts.gate_proj, std), (self.experts.up_proj, std), (self.experts.down_proj, out_std)):
            if w is not None:
                nn.init.normal_(w, 0.0, s, generator=generator)
        self.expert_bias.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, d] -> (expert ids [N, k], weights [N, k] fp32, router probabilities [N, E] fp32)."""
        m = self.moe
        logits = self.router(x).float()
        scores = logits.softmax(-1) if m.score == "softmax" else logits.sigmoid()
        # The bias selects, never weighs: trained by `update_bias` under bias_balancing, or loaded
        # (DeepSeek-V3's e_score_correction_bias); zero otherwise, which leaves the choice unchanged.
        choice = scores + self.expert_bias
        if m.num_groups > 1:
            grouped = choice.view(x.shape[0], m.num_groups, -1)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(m.topk_groups, dim=-1).indices, 1.0)
            choice = grouped.masked_fill(keep.unsqueeze(-1) == 0, float("-inf")).view_as(choice)
        idx = choice.topk(m.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if m.score == "sigmoid" else 0.0))
        return idx, weights * m.routed_scaling_factor, scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        m = self.moe
        idx, weights, probs = self.route(x)
        num_tokens = x.shape[0]
        flat = idx.reshape(-1)
        counts = torch.bincount(flat, minlength=m.num_experts)
        keep = torch.ones_like(flat, dtype=torch.bool)
        if m.capacity_factor is not None:
            capacity = math.ceil(m.capacity_factor * num_tokens * m.top_k / m.num_experts)
            # Rank of each assignment within its expert, in token order.
            onehot = F.one_hot(flat, m.num_experts)
            rank = (onehot.cumsum(0) * onehot).sum(-1) - 1
            keep = rank < capacity
        order = torch.argsort(torch.where(keep, flat, m.num_experts), stable=True)[: int(keep.sum())]
        kept_counts = torch.bincount(flat[order], minlength=m.num_experts)
        token_of = order // m.top_k
        if self.dispatch is not None:
            y = self.dispatch(self.experts, x[token_of], kept_counts)
        else:
            y = self.experts(x[token_of], kept_counts.tolist())
        y = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(x).index_add_(0, token_of, y.to(x.dtype))
        if self.combine is not None:
            out = self.combine(out)
        if self.shared is not None:
            out = out + self.shared(x)
        # Switch/Mixtral load-balancing loss: E * sum_e f_e * P_e, f_e counting every top-k slot.
        aux = m.num_experts * (counts.float() / num_tokens * probs.mean(0)).sum()
        self.stats = {"load": counts.detach(), "dropped": (~keep).sum().detach(), "aux_loss": aux.detach()}
        if self.training and m.aux_loss_coef > 0 and torch.is_grad_enabled():
            scale = self.aux_loss_scale if self.aux_loss_scale is not None else m.aux_loss_coef
            out = AuxLoss.apply(out, aux, scale)
        return out.view(shape)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing step (DeepSeek-V3) from the load [E] seen since the last one
        (summed over every data-parallel rank by the caller, so all ranks update alike)."""
        if self.moe.bias_balancing:
            load = load.float()
            self.expert_bias.add_(self.moe.bias_update_rate * torch.sign(load.mean() - load))


class RouterStats:
    """Router statistics accumulated over the forwards of one optimizer step (all micro-batches)
    of the MoE layers of `model` (a module, or a list of them: a parallel run's pipeline chunks),
    and the balancing-bias update made from them.

    `reduce(t)` sums a tensor in place over the ranks that routed other tokens through the same
    layers (data-parallel ranks; tensor ranks under sequence parallel; expert-parallel ranks),
    so that every rank updates the bias alike and the bias equals the one-process bias."""

    def __init__(self, model: nn.Module | list[nn.Module],
                 reduce: Callable[[torch.Tensor], None] | None = None):
        modules = model if isinstance(model, list) else [model]
        self.layers = [m for mod in modules for m in mod.modules() if isinstance(m, MoE)]
        self.reduce = reduce
        self._hooks = [m.register_forward_hook(self._record) for m in self.layers]
        self.reset()

    def prepare(self, num_microbatches: int) -> None:
        """Before a step of `num_microbatches` micro-batches (on this rank): each layer's aux loss
        gets the gradient coefficient / micro-batches, so the step trains on the mean aux loss of
        its micro-batches; averaged over data-parallel ranks that is the mean over all of them,
        whatever the layout."""
        for m in self.layers:
            m.aux_loss_scale = m.moe.aux_loss_coef / num_microbatches

    def reset(self) -> None:
        self.load = {id(m): torch.zeros(m.moe.num_experts, dtype=torch.long) for m in self.layers}
        self.dropped = 0
        self.aux = []  # per layer forward

    def _record(self, module: nn.Module, _inputs: Any, _out: Any) -> None:
        if module.training:
            self.load[id(module)] += module.stats["load"].cpu()
            self.dropped += int(module.stats["dropped"])
            self.aux.append(float(module.stats["aux_loss"]))

    def step(self) -> dict[str, float]:
        """Apply the balancing-bias update (DeepSeek-V3) and return the metrics of the step:
        aux loss (mean over layers and micro-batches), dropped assignments, and the busiest
        expert's load over the mean (1.0 = balanced), worst layer. Collective when `reduce` is
        set (every rank of the reduction must call it, layers or not)."""
        if not self.layers or not self.aux:
            self.reset()
            return {}
        loads = torch.stack([self.load[id(m)] for m in self.layers]).double()
        # One reduction for everything: loads [layers, E], then dropped, aux sum, aux count.
        flat = torch.cat([loads.flatten(), torch.tensor([self.dropped, sum(self.aux), len(self.aux)],
                                                        dtype=torch.float64)])
        if self.reduce is not None:
            flat = self.reduce(flat)
        loads = flat[: loads.numel()].view_as(loads)
        dropped, aux_sum, aux_count = flat[loads.numel():].tolist()
        imbalance = 0.0
        for m, load in zip(self.layers, loads):
            m.update_bias(load.to(m.expert_bias.device))
            imbalance = max(imbalance, float(load.max()) / max(float(load.mean()), 1e-9))
        out = {"moe_aux_loss": aux_sum / aux_count, "moe_dropped": dropped, "moe_max_load": imbalance}
        self.reset()
        return out
