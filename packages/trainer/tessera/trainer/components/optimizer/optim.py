"""AdamW with weight-decay groups, built from OptimConfig.

Megatron's rule: biases and normalisation weights (every 1-D parameter) are not decayed;
matrices and embeddings are. The implementation is torch.optim.AdamW: the fused kernel where
this torch supports it for the parameters' device, else the multi-tensor (foreach) path.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.trainer.config import OptimConfig


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two parameter groups of (name, parameter) pairs; torch keeps the names in `param_names`."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append((name, p))
    groups = []
    for items, wd in ((decay, weight_decay), (no_decay, 0.0)):
        if items:
            groups.append({"params": items, "weight_decay": wd})
    return groups


def adamw_with_decay(decay: list, no_decay: list, weight_decay: float, lr: float, betas: tuple[float, float],
                     eps: float) -> torch.optim.AdamW:
    """AdamW over parameters already split by the decay rule (the parallel optimizers' flat master
    shards), empty groups left out. A rank with nothing to train (a pipeline stage of frozen
    layers) keeps one empty group, which the LR schedule sets like any other."""
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
              if g["params"]] or [{"params": [], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def _fused_supported(params: list[torch.Tensor]) -> bool:
    try:  # private helper; without it, fall back to the foreach path rather than guess
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
    except ImportError:
        return False
    supported = _get_fused_kernels_supported_devices()
    return all(p.device.type in supported and p.is_floating_point() for p in params)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    groups = decay_groups(model, cfg.weight_decay)
    params = [p for g in groups for _, p in g["params"]]
    impl = cfg.impl
    if impl == "auto":
        impl = "fused" if _fused_supported(params) else "foreach"
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)


def named_parameters_of(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) in the optimizer's own order, from the names stored in its groups."""
    return [(n, p) for g in optimizer.param_groups for n, p in zip(g["param_names"], g["params"])]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
