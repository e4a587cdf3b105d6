"""Paged attention in Triton: decode and chunked prefill over a block-table KV cache, in one launch.

The layout and semantics are those documented in `tessera.kernels.paged_attention` (the contract
with the inference engine); this module only computes the same thing faster on a GPU.

Work split. The query rows of one program are a tile of BLOCK_Q consecutive new tokens of one
sequence times the GROUP query heads that share one KV head (grouped-query attention), flattened
to BLOCK_M = BLOCK_Q * GROUP rows (padded up to a power of two). So a decode step, where every
sequence brings one token, still fills the rows of a matrix multiply with the GROUP heads, and a
KV tile read from memory serves all heads that use it. Grid: (query tiles, KV heads).

Query tiles are numbered without a host-side pass over the batch: sequence s owns tiles
[query_start_loc[s] // BLOCK_Q + s, query_start_loc[s + 1] // BLOCK_Q + s + 1), an interval at
least as long as the number of tiles it needs, so launching query_start_loc[-1] // BLOCK_Q +
num_seqs tiles covers every sequence and each program finds its sequence by binary search. No
`.item()` sync, which keeps the kernel usable under CUDA graphs.

Each program then streams the sequence's KV positions in tiles of BLOCK_N (independent of the
cache's block size: each position's pool block is read from the block table), stopping at the
last position its rows can see (causal), and keeps a running max and sum per row (online
softmax) with fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from tessera.kernels._dispatch import interpret_mode

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest s with query_start_loc[s] // BLOCK_Q + s <= tile (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, qk_scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    block_size, head_dim,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    local_tile = tile - (q_begin // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= q_len:
        return
    kv_len = tl.load(seq_lens_ptr + seq)
    context_len = kv_len - q_len  # cached tokens before this call's new ones

    # Row r of the tile: new token local_tile * BLOCK_Q + r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    token = local_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (token < q_len)
    q_pos = context_len + token
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim

    q_row = (q_begin + token).to(tl.int64)  # int64: tokens * heads * head_dim can pass 2**31
    q_offs = q_row[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # The last row of this tile sees positions up to context_len + last token; nothing beyond.
    kv_end = tl.minimum(kv_len, context_len + (local_tile + 1) * BLOCK_Q)
    cols = tl.arange(0, BLOCK_N)
    table_row = block_tables_ptr + seq * stride_bt
    for kv_start in range(0, kv_end, BLOCK_N):
        k_pos = kv_start + cols
        k_valid = k_pos < kv_end
        block = tl.load(table_row + k_pos // block_size, mask=k_valid, other=0).to(tl.int64)
        slot = k_pos % block_size
        k_offs = block[None, :] * stride_kb + slot[None, :] * stride_ks + kv_head * stride_kh + dims[:, None]
        k = tl.load(k_cache_ptr + k_offs, mask=k_valid[None, :] & dim_valid[:, None], other=0.0)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale_log2
        visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        # Every row sees position 0 in the first tile, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_offs = block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + dims[None, :]
        v = tl.load(v_cache_ptr + v_offs, mask=k_valid[:, None] & dim_valid[None, :], other=0.0)
        if DOT_FP32:
            # Round p to the cache dtype first, as the tensor-core path does, then multiply in fp32.
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / l_i[:, None]
    o_offs = q_row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "paged_attention: expected q [tokens, heads, head_dim] and k_cache == v_cache shape "
            f"[blocks, block_size, kv_heads, head_dim]; got q {tuple(q.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"paged_attention: q head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"paged_attention: {q.shape[1]} query heads not a multiple of {k_cache.shape[2]} KV heads")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"paged_attention: q dtype {q.dtype} differs from cache dtypes {k_cache.dtype}/{v_cache.dtype}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"paged_attention: seq_lens {tuple(seq_lens.shape)}, query_start_loc {tuple(query_start_loc.shape)} "
            f"and block_tables {tuple(block_tables.shape)} disagree on the number of sequences"
        )


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the kernel's matmuls run on fp32 operands (IEEE, not TF32) instead of `dtype`.

    fp32 caches: IEEE fp32 so results match the reference rather than TF32's 10-bit mantissa.
    bf16 under TRITON_INTERPRET=1: the interpreter stores bf16 as uint16 and its tl.dot multiplies
    the bit patterns (triton-lang/triton#11584, unsupported upstream), so the CPU tests upcast the
    operands; on a GPU bf16 goes to the tensor cores like fp16.
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpret_mode())


def _tile_shape(total_tokens: int, num_seqs: int, group: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N): small query tiles for decode batches, large ones for prefill."""
    decode_only = total_tokens <= num_seqs
    rows = 16 if decode_only else 64
    block_m = max(rows, triton.next_power_of_2(group))
    block_q = block_m // group
    block_n = 32 if head_dim > 128 else 64
    return block_m, block_q, block_n


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as `paged_attention_reference`; returns [total_q_tokens, num_heads, head_dim]."""
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    total_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if total_tokens == 0 or num_seqs == 0:
        return out

    # The kernel indexes head_dim with unit stride; everything else goes by the strides passed.
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1:
        k_cache = k_cache.contiguous()
    if v_cache.stride(-1) != 1:
        v_cache = v_cache.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    query_start_loc = query_start_loc.to(torch.int32).contiguous()

    block_m, block_q, block_n = _tile_shape(total_tokens, num_seqs, group, head_dim)
    # Upper bound on sum over sequences of cdiv(q_len, BLOCK_Q); see the module docstring.
    num_tiles = total_tokens // block_q + num_seqs
    grid = (num_tiles, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        block_tables, seq_lens, query_start_loc,
        num_seqs, scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        block_size, head_dim,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs K >= 16
        DOT_FP32=_dot_in_fp32(q.dtype),
        num_warps=4 if block_m <= 16 else 8 if head_dim > 128 else 4,
        num_stages=2,
    )
    return out
