"""Causal depthwise convolution over time (Mamba-2's short convolution), as plain PyTorch
references: the whole sequence, and one token against a rolling window (decoding).

Each channel has its own kernel of K taps: y_t = act(bias + sum_k w[k] x_{t-K+1+k}), tokens
before the start being zero (or taken from `initial_state`, the previous K-1 inputs). This is
F.conv1d with groups = channels and K-1 zeros of left padding, which is how mamba_ssm's
`causal_conv1d_fn` and transformers compute it; written as K shifted multiply-adds so that
packed documents (`seq_idx` [b, T], non-decreasing, as mamba_ssm's) can mask the taps that would
reach into an earlier document. `initial_state` belongs to the first token's document.

Layouts: x [b, T, channels] (channels last, as the projections produce it); weight [channels, K];
states [b, channels, K-1] (transformers' and mamba_ssm's conv state layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.kernels._dispatch import use_triton

__all__ = ["causal_conv1d", "causal_conv1d_reference", "causal_conv1d_step_reference", "causal_conv1d_update",
           "causal_conv1d_update_reference"]


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            seq_idx: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                            silu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [b, T, channels], the final state [b, channels, K-1]: the last K-1 inputs of the last
    token's document, zeros where it is shorter), in x's dtype."""
    b, T, channels = x.shape
    K = weight.shape[-1]
    weight = weight.to(x.dtype)
    history = (initial_state.transpose(1, 2).to(x.dtype) if initial_state is not None
               else x.new_zeros(b, K - 1, channels))
    padded = torch.cat([history, x], dim=1)  # [b, K-1+T, channels]
    docs = None
    if seq_idx is not None:
        docs = torch.cat([seq_idx[:, :1].expand(b, K - 1), seq_idx], dim=1)
    y = x.new_zeros(b, T, channels) if bias is None else bias.to(x.dtype).expand(b, T, channels)
    for k in range(K):  # tap k reads the input K-1-k tokens back
        shifted = padded[:, k:k + T]
        if docs is not None:
            shifted = shifted * (docs[:, k:k + T] == seq_idx)[..., None].to(x.dtype)
        y = y + shifted * weight[:, k]
    last = padded[:, -(K - 1):] if K > 1 else padded[:, :0]
    if docs is not None and K > 1:
        last = last * (docs[:, -(K - 1):] == seq_idx[:, -1:])[..., None].to(x.dtype)
    return (F.silu(y) if silu else y), last.transpose(1, 2)


def causal_conv1d_step_reference(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                                 bias: torch.Tensor | None = None, silu: bool = True
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: (y [b, channels], the new state [b, channels, K-1]) from x [b, channels] and the
    previous K-1 inputs. The input state is not modified."""
    window = torch.cat([state.to(x.dtype), x[..., None]], dim=-1)  # [b, channels, K]
    y = (window * weight.to(x.dtype)).sum(-1)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return (F.silu(y) if silu else y), window[..., 1:]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  seq_idx: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                  silu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d_reference`, by Triton forward and backward kernels on CUDA
    (tessera.kernels.ssm), the reference elsewhere and under torch.compile. Differentiable in x,
    weight, bias, initial_state (through y and the final state)."""
    if use_triton(x) and not torch.compiler.is_compiling() and x.numel() > 0:
        from tessera.kernels.ssm.conv_triton import causal_conv1d_triton

        return causal_conv1d_triton(x, weight, bias, seq_idx, initial_state, silu)
    return causal_conv1d_reference(x, weight, bias, seq_idx, initial_state, silu)


def causal_conv1d_update_reference(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                                   bias: torch.Tensor | None = None, silu: bool = True,
                                   state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """`causal_conv1d_step_reference` in place in a pool: see `causal_conv1d_update`."""
    if state_indices is None:
        y, new = causal_conv1d_step_reference(x, conv_state, weight, bias, silu)
        conv_state.copy_(new)
        return y
    live = state_indices >= 0
    slots = state_indices[live].long()
    y_live, new = causal_conv1d_step_reference(x[live], conv_state[slots], weight, bias, silu)
    conv_state[slots] = new.to(conv_state.dtype)
    y = x.new_zeros(x.shape)
    y[live] = y_live
    return y


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, silu: bool = True,
                         state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One decoding token per sequence: y [b, channels] from x [b, channels], moving the window
    `conv_state` [slots, channels, K-1] on in place. Sequence i owns row `state_indices[i]` (rows
    0..b-1 when None); a negative index is a padding row (state untouched, y zero). Triton on
    CUDA, the reference elsewhere. Not differentiable (decoding)."""
    if use_triton(x) and not torch.compiler.is_compiling():
        from tessera.kernels.ssm.conv_triton import causal_conv1d_update_triton

        return causal_conv1d_update_triton(x, conv_state, weight, bias, silu, state_indices)
    return causal_conv1d_update_reference(x, conv_state, weight, bias, silu, state_indices)
