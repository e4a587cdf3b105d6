"""Rotary position embeddings: the inverse frequencies (plain, or scaled by one of the methods
transformers implements) and the cos/sin tables the model reads.

Scalings (HF `rope_type`), each tested against transformers' own `ROPE_INIT_FUNCTIONS`:
- `linear` (position interpolation): every frequency divided by `factor`.
- `dynamic` (dynamic NTK): unchanged up to `original_max_position_embeddings`; a longer call
  recomputes the base from its longest position, theta * (factor * L / original - (factor - 1))
  ^ (d / (d - 2)), as transformers does per forward.
- `yarn`: interpolate low frequencies, keep high ones, a linear ramp between the correction
  dimensions of `beta_fast` / `beta_slow` rotations; cos and sin are scaled by an attention
  factor (0.1 ln(factor) + 1 unless given, or the DeepSeek mscale ratio).
- `llama3`: Llama-3.1's wavelength-dependent scaling with a smooth band between
  `high_freq_factor` and `low_freq_factor`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tessera.common.models.causal_lm.config import ModelConfig
from tessera.kernels import apply_rope

__all__ = ["RotaryEmbedding", "apply_rope", "reset_rotary_tables", "rope_inv_freq"]  # apply_rope lives beside its kernel


def _plain_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], attention factor applied to cos and sin).

    `seq_len` is the longest position + 1 of a call; only `dynamic` scaling depends on it."""
    dim, theta = cfg.head_dim, cfg.rope_theta
    s = cfg.rope_scaling
    if s is None:
        return _plain_inv_freq(dim, theta), 1.0
    if s.rope_type == "linear":
        return _plain_inv_freq(dim, theta) / s.factor, 1.0
    if s.rope_type == "dynamic":
        original = s.original_max_position_embeddings
        length = max(seq_len or original, original)
        theta = theta * ((s.factor * length / original) - (s.factor - 1)) ** (dim / (dim - 2))
        return _plain_inv_freq(dim, theta), 1.0
    if s.rope_type == "yarn":
        return _yarn_inv_freq(cfg)
    inv_freq = _plain_inv_freq(dim, theta)  # llama3
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    # Between the two wavelengths, interpolate smoothly between scaled and unscaled.
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    s, dim, theta = cfg.rope_scaling, cfg.head_dim, cfg.rope_theta
    assert s is not None and s.rope_type == "yarn"
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention_factor = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp  # 1: high frequency, kept as is
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _tables(inv_freq: torch.Tensor, factor: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [..., D/2], as torch.outer for 1-D positions
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * factor, emb.sin() * factor


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_seq_len); rotate-half layout (as HF Llama)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        if not self.cos.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        device = self.cos.device
        inv_freq, factor = rope_inv_freq(self.cfg)
        t = torch.arange(self.cfg.max_seq_len, device=device)
        cos, sin = _tables(inv_freq.to(device), factor, t)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # The tables stay fp32 whatever dtype the model is cast to: recompute rather than round.
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.cos = self.cos.to(torch.float32)
            self.sin = self.sin.to(torch.float32)
            if not self.cos.is_meta:
                self.reset_parameters()
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [B or 1, T, 1, D] for integer positions [B or 1, T]."""
        s = self.cfg.rope_scaling
        if s is not None and s.rope_type == "dynamic":
            longest = int(positions.max()) + 1
            if longest > s.original_max_position_embeddings:
                inv_freq, factor = rope_inv_freq(self.cfg, longest)
                cos, sin = _tables(inv_freq.to(positions.device), factor, positions)
                return cos.unsqueeze(2), sin.unsqueeze(2)
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)


def reset_rotary_tables(model: nn.Module) -> None:
    """Recompute every rotary table in `model` (wherever its language model sits): they are
    computed, not stored, so after `to_empty` (a meta build, a shard load) they hold garbage."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters()
