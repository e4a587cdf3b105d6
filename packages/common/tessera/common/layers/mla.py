"""Multi-head latent attention (DeepSeek-V2/V3), computed as transformers' DeepseekV3Attention does.

Queries: q_proj, or with `q_lora_rank` the bottleneck q_a_proj -> RMSNorm -> q_b_proj; each head
is [qk_nope_head_dim | qk_rope_head_dim]. Keys and values: kv_a_proj gives one compressed latent
(kv_lora_rank wide, normed) and one RoPE key part (qk_rope_head_dim) per token, shared by every
head; kv_b_proj expands the latent to each head's [k_nope | v]. Only the RoPE parts are rotated
(rotate-half layout; the HF adapter permutes DeepSeek's interleaved rows on import and back on
export). Softmax scale: 1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN
scaling, as DeepSeek-V3 sets it.

Parameter names follow transformers' (kv_a_proj is its kv_a_proj_with_mqa), so the adapter is a
renaming. Heads come from the projection widths, so a shard holding fewer heads (q_b / kv_b
split by head, o_proj by input) runs this same code.

An `attention_fn` (context parallel's, which all-gathers the keys and values of the whole sequence)
takes the heads' expanded q, k and v as any attention's, with MLA's softmax scale folded into q
(it scales by 1/sqrt(D)); serving swaps these layers for its latent ones (inference/worker/latent).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.common.layers.attention import MaskedAttention
from tessera.common.layers.norms import RMSNorm
from tessera.common.layers.rope import _yarn_mscale
from tessera.common.models.causal_lm.config import ModelConfig

__all__ = ["MLA", "mla_softmax_scale"]


def mla_softmax_scale(cfg: ModelConfig) -> float:
    assert cfg.mla is not None
    scale = cfg.mla.qk_head_dim ** -0.5
    s = cfg.rope_scaling
    if s is not None and s.rope_type == "yarn" and s.mscale_all_dim:
        scale *= _yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        m = cfg.mla
        assert m is not None
        self.layer_idx = layer_idx
        self.window = None  # MLA layers have no sliding window
        self.m = m
        self.dropout = cfg.attention_dropout
        self.scale = mla_softmax_scale(cfg)
        d, h = cfg.hidden_size, cfg.num_heads
        if m.q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(d, h * m.qk_head_dim, bias=False)
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(d, m.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(m.q_lora_rank, m.latent_norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, h * m.qk_head_dim, bias=False)
        self.kv_a_proj = nn.Linear(d, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, m.latent_norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * m.v_head_dim, d, bias=False)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> (normed KV latent [B, T, kv_lora_rank], un-rotated RoPE key [B, T, rope])."""
        c, k_rot = self.kv_a_proj(x).split([self.m.kv_lora_rank, self.m.qk_rope_head_dim], dim=-1)
        return self.kv_a_norm(c), k_rot

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        attention_fn: object = None,
        attn_mask: MaskedAttention | None = None,
    ) -> torch.Tensor:
        assert rope is not None, "MLA needs rotary embeddings"
        m = self.m
        bsz, seq = x.shape[0], x.shape[1]
        q = self.query(x).view(bsz, seq, -1, m.qk_head_dim)
        q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_rot = self.latent(x)
        cos, sin = rope  # [B or 1, T, 1, rope]
        q_rot = q_rot * cos + _rotate_half(q_rot) * sin
        k_rot = (k_rot.unsqueeze(2) * cos + _rotate_half(k_rot.unsqueeze(2)) * sin)
        kv = self.kv_b_proj(c).view(bsz, seq, -1, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        heads = k_nope.shape[2]
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, -1, heads, -1)), dim=-1)
        if attention_fn is not None:
            out = attention_fn(self.layer_idx, q * (self.scale * math.sqrt(q.shape[-1])), k, v)
        else:
            out = self.core(q, k, v, attn_mask)
        return self.o_proj(out.reshape(bsz, seq, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             attn_mask: MaskedAttention | None = None) -> torch.Tensor:
        """Causal attention with MLA's scale; [B, T, H, D] in, [B, T, H, v_head_dim] out."""
        dropout_p = self.dropout if self.training else 0.0
        if attn_mask is not None:
            # The masked path scales by 1/sqrt(D): fold MLA's own scale into q instead.
            return attn_mask(q * (self.scale * math.sqrt(q.shape[-1])), k, v, dropout_p)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             dropout_p=dropout_p, is_causal=True, scale=self.scale)
        return out.transpose(1, 2)
