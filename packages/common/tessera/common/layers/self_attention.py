"""Self-attention: q/k/v/o projections, optional per-head q/k norms, rotary embeddings, and the
attention core (causal SDPA, or bidirectional for an encoder (`causal=False`); a MaskedAttention
for packed documents and windows or a BidirectionalAttention for padding; or the caller's
`attention_fn`: the server's paged attention over its KV cache)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.common.layers.attention import BidirectionalAttention, MaskedAttention
from tessera.common.layers.norms import RMSNorm
from tessera.common.models.causal_lm.config import ModelConfig
from tessera.kernels import rope_qk

__all__ = ["Attention", "AttentionFn", "AttentionMask"]

# attention_fn(layer_idx, q, k, v) -> out; q: [B, T, Hq, D], k/v: [B, T, Hkv, D], out: [B, T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# What masks one forward's attention (built once per forward, shared by the layers).
AttentionMask = MaskedAttention | BidirectionalAttention


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, causal: bool = True):
        super().__init__()
        self.layer_idx = layer_idx
        self.causal = causal  # False: every query sees every key (an encoder's self-attention)
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.dropout = cfg.attention_dropout
        self.window = cfg.window(layer_idx)  # sliding window (None: full causal attention)
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attn_bias("q"))
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attn_bias("k"))
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attn_bias("v"))
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.attn_bias("o"))
        # Qwen3: RMSNorm over each head's query and key (one weight of head_dim, shared by the
        # heads, so a tensor-parallel shard keeps it whole).
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        attention_fn: AttentionFn | None = None,
        attn_mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        # Head counts come from the projection widths, so a tensor-parallel shard (fewer local
        # heads) runs this same code; the sequence length too, since under sequence parallel the
        # projections gather a sequence-sharded input to the full sequence.
        q, k, v = self.project(x)
        bsz, seq = q.shape[0], q.shape[1]
        q = q.view(bsz, seq, -1, self.head_dim)
        k = k.view(bsz, seq, -1, self.head_dim)
        v = v.view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rope_qk(q, k, *rope)
        if attention_fn is not None:
            out = attention_fn(self.layer_idx, q, k, v)
        else:
            out = self.core(q, k, v, attn_mask)
        return self.o_proj(out.reshape(bsz, seq, -1))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, T, width] (the serving engine overrides this with one GEMM over the stacked
        weights: tessera.inference.worker.merged_linear)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             attn_mask: AttentionMask | None = None) -> torch.Tensor:
        """Causal (or, built with causal=False, bidirectional) scaled-dot-product attention;
        [B, T, H, D] in and out. Selective recompute wraps this.

        `attn_mask`, when given, attends instead: packed documents and/or this layer's sliding
        window, without a T x T mask, or padding (`tessera.common.layers.attention`).
        """
        dropout_p = self.dropout if self.training else 0.0
        if attn_mask is not None:
            return attn_mask(q, k, v, dropout_p)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v,
            dropout_p=dropout_p,
            is_causal=self.causal,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.transpose(1, 2)
