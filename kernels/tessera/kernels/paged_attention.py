"""Attention over a paged KV cache, for decode and (chunked) prefill in one call.

Layout (shared with the inference engine):
- q:            [total_q_tokens, num_heads, head_dim]: the new tokens of every sequence, packed.
- k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim]: the block pool.
- block_tables: int32 [num_seqs, max_blocks_per_seq]: pool block of each logical block.
- seq_lens:     int32 [num_seqs]: tokens in the cache for each sequence, the new ones included.
- query_start_loc: int32 [num_seqs + 1]: offsets of each sequence's queries in `q`.
The new tokens' keys and values must already be written to the cache. Query i of sequence s
sits at position seq_lens[s] - q_len[s] + i and attends causally to positions <= its own; with a
sliding `window` (Mistral), only to the last `window` of them (positions > its own - window).
Grouped-query attention: query head h uses KV head h // (num_heads // num_kv_heads).
The caches are in q's dtype, or fp8 (float8_e4m3fn / float8_e5m2, the engine's
--kv-cache-dtype) holding key / k_scale and value / v_scale: they are read back as
cache * scale (per-tensor scales) and attended in q's precision.
Returns [total_q_tokens, num_heads, head_dim] in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.kernels._dispatch import use_triton


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain PyTorch: gather each sequence's blocks and run SDPA (fp32) with a causal offset mask."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, kv_len in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        n_blocks = (kv_len + block_size - 1) // block_size
        blocks = block_tables[s, :n_blocks].long()
        k = k_cache.index_select(0, blocks).reshape(-1, num_kv_heads, head_dim)[:kv_len]
        v = v_cache.index_select(0, blocks).reshape(-1, num_kv_heads, head_dim)[:kv_len]
        qs = q[q0:q1].transpose(0, 1)  # [H, q_len, D]
        k = k.transpose(0, 1).float() * k_scale
        v = v.transpose(0, 1).float() * v_scale
        if num_kv_heads != num_heads:
            rep = num_heads // num_kv_heads
            k = k.repeat_interleave(rep, dim=0)
            v = v.repeat_interleave(rep, dim=0)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        o = F.scaled_dot_product_attention(
            qs.float(), k, v, attn_mask=mask, scale=scale
        )
        out[q0:q1] = o.transpose(0, 1).to(q.dtype)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Dispatch to the Triton paged-attention kernel on CUDA, the reference elsewhere."""
    if use_triton(q):
        # Imported here so CPU-only installs without Triton never import it.
        from tessera.kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                      window=window, k_scale=k_scale, v_scale=v_scale)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window,
                                     k_scale, v_scale)
