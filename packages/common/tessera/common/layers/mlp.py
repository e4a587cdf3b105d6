"""The dense MLP: SwiGLU (gate/up/down), GELU (up/down, tanh approximation as GPT-2), exact GELU
(up/down, erf: BERT's, which the encoder kind's layer config allows) or squared ReLU (up/down,
relu(x)^2: Nemotron-H's, which the hybrid kind's layer config allows) or quick GELU (CLIP's
vision tower); T5's ReLU (up/down) and gated GELU (v1.1: gelu_tanh(gate) * up, then down), which
the encoder-decoder's layer config allows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.common.models.causal_lm.config import ModelConfig
from tessera.kernels import swiglu

__all__ = ["MLP"]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.activation = cfg.activation
        self.gated = cfg.activation in ("swiglu", "geglu")
        if self.gated:
            self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=cfg.bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=cfg.bias)
        self.down_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "geglu":
            gate, up = self.gate_up(x)
            h = F.gelu(gate, approximate="tanh") * up
        elif self.gated:
            h = swiglu(*self.gate_up(x))
        elif self.activation == "relu":
            h = F.relu(self.up_proj(x))
        elif self.activation == "squared_relu":
            h = F.relu(self.up_proj(x)).square()
        elif self.activation == "gelu_erf":
            h = F.gelu(self.up_proj(x))
        elif self.activation == "quick_gelu":  # CLIP's: x * sigmoid(1.702 x)
            h = self.up_proj(x)
            h = h * torch.sigmoid(1.702 * h)
        else:
            h = F.gelu(self.up_proj(x), approximate="tanh")
        return self.down_proj(h)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The SwiGLU gate and up projections (overridden like Attention.project when served)."""
        return self.gate_proj(x), self.up_proj(x)
