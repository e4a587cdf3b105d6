"""The serving form of a multi-head latent attention layer (tessera.common.layers.mla.MLA).

What a latent cache needs from the layer, computed from the model's own modules: the queries (no
RoPE part | RoPE part, rotated), the token's latent (normed compressed KV | rotated RoPE key: what
the cache stores), and two ways back from latents to heads:
  - `expand`: kv_b_proj up-projects cached latents to per-head K (no RoPE) and V, for prefill
    (compute-bound: attention over full heads is cheaper than over latents there);
  - `absorb` / `unabsorb`: kv_b_proj's rows split per head into W_UK [H, nope, L] and W_UV
    [H, v, L]; decode attends over the latents themselves with q_nope @ W_UK as each head's query
    and maps the attended latent through W_UV (vLLM's MLA backend, DeepSeek-V2 section 2.1.3),
    so no per-token K or V is ever made. The two read the same weights, so they agree to rounding.

The attention itself is the runner's (latent/runner.py), called through the model's attention_fn
hook with this layer; `install` swaps every MLA of a model for this form before its Linear
weights are packed (W_UK / W_UV are taken from kv_b_proj's plain weight).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.common.layers.mla import MLA, mla_softmax_scale


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LatentAttention(nn.Module):
    window = None  # MLA layers have no sliding window

    def __init__(self, mla: MLA, scale: float):
        super().__init__()
        self.mla = mla
        self.layer_idx = mla.layer_idx
        self.m = m = mla.m
        self.scale = scale
        # Local heads from the projection's width: a tensor-parallel shard holds whole heads.
        w = mla.kv_b_proj.weight.detach()
        if type(w) is not torch.Tensor:  # a torchao-quantized weight (--quantization): its values in the model's dtype
            w = w.dequantize().to(mla.kv_a_norm.weight.dtype)
        w = w.view(-1, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        self.num_heads = w.shape[0]
        self.register_buffer("w_uk", w[:, :m.qk_nope_head_dim].contiguous(), persistent=False)  # [H, nope, L]
        self.register_buffer("w_uv", w[:, m.qk_nope_head_dim:].contiguous(), persistent=False)  # [H, v, L]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, attention_fn=None,
                attn_mask=None) -> torch.Tensor:
        """x [1, T, d] (the step's packed tokens) -> [1, T, d]; attention_fn(layer, self, q_nope,
        q_rope, latent) -> [T, H, v] is the runner's."""
        assert attention_fn is not None and rope is not None, "a served MLA layer attends through its runner"
        m = self.m
        seq = x.shape[1]
        q = self.mla.query(x).view(seq, self.num_heads, m.qk_head_dim)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_rope = self.mla.latent(x)
        cos, sin = rope[0][0], rope[1][0]  # [T, 1, rope]; fp32 tables in a bf16 model: back to x's dtype
        q_rope = (q_rope * cos + _rotate_half(q_rope) * sin).to(x.dtype)
        k_rope = (k_rope[0] * cos[:, 0] + _rotate_half(k_rope[0]) * sin[:, 0]).to(x.dtype)
        out = attention_fn(self.layer_idx, self, q_nope, q_rope, torch.cat((c[0], k_rope), dim=-1))
        return self.mla.o_proj(out.reshape(1, seq, -1))

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents [N, L + R] -> per-head keys [N, H, nope + rope] and values [N, H, v]."""
        m = self.m
        c, k_rope = latent.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        # contiguous: oneDNN's packed bf16 GEMM refuses a strided input (a column slice of the cache)
        kv = self.mla.kv_b_proj(c.contiguous()).view(-1, self.num_heads, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        return torch.cat((k_nope, k_rope[:, None].expand(-1, self.num_heads, -1)), dim=-1), v

    def absorb(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """Queries [N, H, nope], [N, H, rope] -> each head's query over latents [N, H, L + R]."""
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [N, H, L]
        return torch.cat((q_latent, q_rope), dim=-1)

    def unabsorb(self, attended: torch.Tensor) -> torch.Tensor:
        """Attended latents [N, H, L] -> each head's output [N, H, v]."""
        return torch.bmm(attended.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)


def install(model: nn.Module) -> int:
    """Swap each MLA layer of `model` for its serving form, in place; returns how many."""
    swapped = 0
    mtp = getattr(model, "mtp", None)  # the multi-token-prediction depths' blocks too (DeepSeek-V3)
    blocks = [*getattr(model, "layers", {}).values(), *(mtp.layers.values() if mtp is not None else ())]
    for block in blocks:
        if isinstance(block.attn, MLA):
            block.attn = LatentAttention(block.attn, mla_softmax_scale(model.cfg))
            swapped += 1
    return swapped
