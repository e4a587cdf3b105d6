"""The Mamba-2 mixer (Megatron's MambaMixer, transformers' Mamba2Mixer / NemotronHMamba2Mixer).

Read top to bottom:
1. input projections of the normed hidden state to z (the gate), x, B, C and dt;
2. a causal depthwise convolution over time on x, B and C, then SiLU;
3. the selective scan (tessera.kernels.ssd): heads of head_dim channels, each group of heads
   sharing B and C, decay A = -exp(A_log), step dt = softplus(dt + dt_bias) within the limits,
   skip connection D;
4. gated RMSNorm of the scan's output by z, normalised per group;
5. output projection.

Parameter names are the checkpoint contract. The projections and convolutions are stored split
(`in_proj.{z,x,b,c,dt}`, `conv.{x,b,c}`) rather than fused as transformers' in_proj and conv1d
are: tensor parallel gives each rank whole heads and groups of every part (Megatron's split), and
split tensors keep each rank's share a contiguous slice, whatever the layout. The Hugging Face
adapter concatenates them into transformers' fused tensors.

Decoding carries a `MambaState` per sequence: the convolution's last conv_kernel - 1 inputs of
each part and the scan's state, a fixed size whatever the length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tessera.common.models.hybrid.config import MambaConfig
from tessera.common.parallel.context_parallel import SequenceChunks, context_to_heads, heads_to_context
from tessera.kernels import (
    causal_conv1d,
    causal_conv1d_update,
    discretize_dt,
    gated_rms_norm_reference,
    ssd_chunk_scan,
    ssd_state_update,
)

__all__ = ["CausalConv1d", "GatedRMSNorm", "MambaMixer", "MambaState"]

PARTS = ("x", "b", "c")  # the convolved parts of the projection


@dataclass
class MambaState:
    """One Mamba layer's state for a batch of sequences: conv[part] [b, channels, conv_kernel - 1]
    (the last inputs, in the activations' dtype) and ssm [b, heads, head_dim, state_size] (fp32)."""

    conv: dict[str, torch.Tensor]
    ssm: torch.Tensor


class CausalConv1d(nn.Module):
    """Depthwise causal convolution over time with SiLU; weight [channels, 1, K] as nn.Conv1d's."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None

    def forward(self, x: torch.Tensor, seq_idx: torch.Tensor | None = None,
                state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, T, channels] -> (y, the state after the last token)."""
        return causal_conv1d(x, self.weight[:, 0], self.bias, seq_idx, state)

    def step(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_conv1d_update(x, state, self.weight[:, 0], self.bias), state  # in place

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        # nn.Conv1d's default (Megatron keeps it): uniform within 1/sqrt(fan_in), fan_in = K.
        bound = 1.0 / math.sqrt(self.weight.shape[-1])
        self.weight.uniform_(-bound, bound, generator=generator)
        if self.bias is not None:
            self.bias.uniform_(-bound, bound, generator=generator)


class GatedRMSNorm(nn.Module):
    """RMSNorm of x * silu(gate), per group of `group_size` channels."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm_reference(x, gate, self.weight, self.eps, self.group_size)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class MambaMixer(nn.Module):
    def __init__(self, m: MambaConfig, hidden_size: int, eps: float):
        super().__init__()
        self.m = m
        widths = {"z": m.inner_size, "x": m.inner_size, "b": m.group_width, "c": m.group_width, "dt": m.num_heads}
        self.in_proj = nn.ModuleDict({k: nn.Linear(hidden_size, w, bias=m.bias) for k, w in widths.items()})
        self.conv = nn.ModuleDict({k: CausalConv1d(widths[k], m.conv_kernel, m.conv_bias) for k in PARTS})
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads))
        self.A_log = nn.Parameter(torch.empty(m.num_heads))
        self.D = nn.Parameter(torch.empty(m.num_heads))
        self.norm = GatedRMSNorm(m.inner_size, m.inner_size // m.num_groups, eps)
        self.out_proj = nn.Linear(m.inner_size, hidden_size, bias=m.bias)

    @torch.no_grad()
    def reset_ssm_parameters(self, generator: torch.Generator | None = None) -> None:
        """Megatron's initialisation of the mixer's own parameters: A uniform in [1, 16] (as
        A_log), D = 1, dt_bias the inverse softplus of a step drawn log-uniformly in
        [dt_min, dt_max] (at least dt_init_floor)."""
        m = self.m
        a = torch.empty(m.num_heads, device=self.A_log.device).uniform_(1.0, 16.0, generator=generator)
        self.A_log.copy_(a.log())
        self.D.fill_(1.0)
        u = torch.rand(m.num_heads, device=self.dt_bias.device, generator=generator)
        dt = torch.exp(u * (math.log(m.dt_max) - math.log(m.dt_min)) + math.log(m.dt_min)).clamp(min=m.dt_init_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt

    def new_state(self, batch: int, dtype: torch.dtype, device: torch.device | str | None = None) -> MambaState:
        """A zero state (the start of a sequence) for `batch` sequences."""
        m, device = self.m, device or self.A_log.device
        conv = {k: torch.zeros(batch, self.conv[k].weight.shape[0], m.conv_kernel - 1, dtype=dtype, device=device)
                for k in PARTS}
        return MambaState(conv, torch.zeros(batch, m.num_heads, m.head_dim, m.state_size, device=device))

    def _dt_and_decay(self, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return discretize_dt(dt, self.dt_bias, self.m.dt_limit_min, self.m.dt_limit_max), -torch.exp(self.A_log.float())

    def forward(self, h: torch.Tensor, seq_idx: torch.Tensor | None = None,
                state: MambaState | None = None) -> torch.Tensor:
        """h [b, T, d] -> [b, T, d]. `seq_idx` [b, T]: document ids (non-decreasing); the scan and
        the convolution restart at each new document. `state`: start from it (a sequence's
        earlier tokens: chunked prefill) and leave the state after the last token in it."""
        m = self.m
        b, T, _ = h.shape
        z = self.in_proj["z"](h)
        conv_out = {}
        for k in PARTS:
            conv_out[k], last = self.conv[k](self.in_proj[k](h), seq_idx, None if state is None else state.conv[k])
            if state is not None:
                state.conv[k] = last
        dt, A = self._dt_and_decay(self.in_proj["dt"](h))
        y, final = ssd_chunk_scan(
            conv_out["x"].view(b, T, m.num_heads, m.head_dim), dt, A,
            conv_out["b"].view(b, T, m.num_groups, m.state_size), conv_out["c"].view(b, T, m.num_groups, m.state_size),
            m.chunk_size, self.D, None if state is None else state.ssm, seq_idx)
        if state is not None:
            state.ssm = final
        return self.out_proj(self.norm(y.reshape(b, T, -1), z).to(h.dtype))

    def forward_chunks(self, h: torch.Tensor, chunks: SequenceChunks) -> torch.Tensor:
        """Context parallel: h [b, T/C, d] (this rank's chunks) -> [b, T/C, d]. The projected parts
        trade the sequence split for a head split (context_parallel.context_to_heads): this rank
        convolves and scans the whole sequence of its 1/C of the heads and groups, with its slices
        of the filters, dt_bias, A and D, then trades back for the gated norm and out_proj."""
        m, cp = self.m, chunks.cp
        heads, groups = m.num_heads // cp.size, m.num_groups // cp.size
        width = {"x": heads * m.head_dim, "b": groups * m.state_size, "c": groups * m.state_size}
        z = self.in_proj["z"](h)
        conv_out = {}
        for k in PARTS:
            mine = slice(cp.rank * width[k], (cp.rank + 1) * width[k])
            conv = self.conv[k]
            conv_out[k], _ = causal_conv1d(context_to_heads(self.in_proj[k](h), chunks), conv.weight[mine, 0],
                                           None if conv.bias is None else conv.bias[mine], chunks.documents)
        b, t = conv_out["x"].shape[:2]
        mine = slice(cp.rank * heads, (cp.rank + 1) * heads)
        dt = discretize_dt(context_to_heads(self.in_proj["dt"](h), chunks), self.dt_bias[mine], m.dt_limit_min,
                           m.dt_limit_max)
        y, _ = ssd_chunk_scan(
            conv_out["x"].view(b, t, heads, m.head_dim), dt, -torch.exp(self.A_log[mine].float()),
            conv_out["b"].view(b, t, groups, m.state_size), conv_out["c"].view(b, t, groups, m.state_size),
            m.chunk_size, self.D[mine], None, chunks.documents)
        y = heads_to_context(y.reshape(b, t, -1), chunks)
        return self.out_proj(self.norm(y, z).to(h.dtype))

    def step(self, h: torch.Tensor, state: MambaState) -> torch.Tensor:
        """One token per sequence: h [b, d] -> [b, d], advancing `state` (decoding)."""
        m = self.m
        b = h.shape[0]
        z = self.in_proj["z"](h)
        conv_out = {}
        for k in PARTS:
            conv_out[k], state.conv[k] = self.conv[k].step(self.in_proj[k](h), state.conv[k])
        dt, A = self._dt_and_decay(self.in_proj["dt"](h))
        y = ssd_state_update(  # advances state.ssm in place
            state.ssm, conv_out["x"].view(b, m.num_heads, m.head_dim), dt, A,
            conv_out["b"].view(b, m.num_groups, m.state_size), conv_out["c"].view(b, m.num_groups, m.state_size), self.D)
        return self.out_proj(self.norm(y.reshape(b, -1), z).to(h.dtype))
