"""Normalisation layers: RMSNorm (on its kernel, tessera.kernels.rms_norm) or LayerNorm as the
config says, and the residual add fused with the norm that follows it."""

from __future__ import annotations

import torch
from torch import nn

from tessera.common.models.causal_lm.config import ModelConfig
from tessera.kernels import add_rms_norm, rms_norm

__all__ = ["RMSNorm", "add_norm", "make_norm"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def add_norm(norm: nn.Module, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, norm(x + h)): one fused kernel on CUDA for a plain RMSNorm. A norm with hooks
    (sequence parallel gathers its output) or a LayerNorm is called as a module after the add."""
    if type(norm) is RMSNorm and not (norm._forward_hooks or norm._forward_pre_hooks):
        return add_rms_norm(x, h, norm.weight, norm.eps)
    x = x + h
    return x, norm(x)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
