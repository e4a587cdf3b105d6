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

An fp8 cache (DEQUANT) is loaded as fp8 (a quarter of fp32's bytes, half of bf16's: decode reads
the cache, so that is the traffic saved) and scaled back to q's dtype in registers before the
dot products; the probabilities are rounded to q's dtype, as they are to the cache's otherwise.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tessera.kernels._dispatch import interpret_mode

_LOG2E = 1.4426950408889634
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


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
    part_acc_ptr, part_m_ptr, part_l_ptr,
    num_seqs, num_splits, qk_scale_log2, k_scale, v_scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    stride_ps, stride_pt, stride_ph,
    stride_ms, stride_mt,
    block_size, head_dim, window,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    DEQUANT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

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
    kv_lo = 0
    if SPLIT_KV:
        # This program's share of [0, kv_end): whole BLOCK_N tiles, the last share possibly empty.
        chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = split * chunk
        kv_end = tl.minimum(kv_end, kv_lo + chunk)
    cols = tl.arange(0, BLOCK_N)
    table_row = block_tables_ptr + seq * stride_bt
    for kv_start in range(kv_lo, kv_end, BLOCK_N):
        k_pos = kv_start + cols
        k_valid = k_pos < kv_end
        block = tl.load(table_row + k_pos // block_size, mask=k_valid, other=0).to(tl.int64)
        slot = k_pos % block_size
        k_offs = block[None, :] * stride_kb + slot[None, :] * stride_ks + kv_head * stride_kh + dims[:, None]
        k = tl.load(k_cache_ptr + k_offs, mask=k_valid[None, :] & dim_valid[:, None], other=0.0)
        if DEQUANT:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale_log2
        visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        # Sliding window (window > 0): only the last `window` positions, the query's own included.
        # Tiles wholly before every row's window are still visited (masked): correctness first.
        visible = visible & ((window <= 0) | (k_pos[None, :] > q_pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))

        # A row that has seen nothing yet (a later KV split under a causal mask) keeps m = -inf;
        # subtract 0 instead so that alpha and p are 0 rather than exp2(-inf + inf) = NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_sub)
        p = tl.math.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_offs = block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + dims[None, :]
        v = tl.load(v_cache_ptr + v_offs, mask=k_valid[:, None] & dim_valid[None, :], other=0.0)
        if DEQUANT:
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        if DOT_FP32:
            # Round p to the cache dtype first, as the tensor-core path does, then multiply in fp32.
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_mask = row_valid[:, None] & dim_valid[None, :]
    if SPLIT_KV:
        # Unnormalised partial results (a row may have seen nothing in this split: l = 0).
        acc_offs = split * stride_ps + q_row * stride_pt + head * stride_ph
        tl.store(part_acc_ptr + acc_offs[:, None] + dims[None, :], acc, mask=out_mask)
        ml_offs = split * stride_ms + q_row * stride_mt + head
        tl.store(part_m_ptr + ml_offs, m_i, mask=row_valid)
        tl.store(part_l_ptr + ml_offs, l_i, mask=row_valid)
    else:
        out = acc / l_i[:, None]
        o_offs = q_row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr,
    num_splits, head_dim,
    stride_ps, stride_pt, stride_ph,
    stride_ms, stride_mt,
    stride_ot, stride_oh,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, with M = max_s m_s."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_valid = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    ml_offs = splits * stride_ms + token * stride_mt + head
    m = tl.load(part_m_ptr + ml_offs, mask=split_valid, other=float("-inf"))
    l_s = tl.load(part_l_ptr + ml_offs, mask=split_valid, other=0.0)
    m_max = tl.max(m, axis=0)  # finite: the first split holds position 0, visible to every row
    w = tl.math.exp2(m - m_max)
    acc_offs = splits[:, None] * stride_ps + token * stride_pt + head * stride_ph + dims[None, :]
    acc = tl.load(part_acc_ptr + acc_offs, mask=split_valid[:, None] & dim_valid[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_valid)


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
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, *FP8_DTYPES):
        raise ValueError(f"paged_attention: cache dtypes {k_cache.dtype}/{v_cache.dtype} must both be q's dtype "
                         f"({q.dtype}) or both one fp8 dtype")
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


def _tile_shape(total_tokens: int, num_seqs: int, group: int, head_dim: int,
                dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N): small query tiles for decode batches, large ones for prefill.
    fp32 caches get half-size tiles: their shared-memory footprint would otherwise exceed what
    GPUs with ~100 KB per SM (sm_86/89) can give one program."""
    decode_only = total_tokens <= num_seqs
    rows = 16 if decode_only else 64
    block_n = 32 if head_dim > 128 else 64
    if dtype == torch.float32:
        rows, block_n = max(16, rows // 2), 32
    block_m = max(rows, triton.next_power_of_2(group))
    return block_m, block_m // group, block_n


def _launch_config(dtype: torch.dtype, block_m: int, head_dim: int) -> tuple[int, int]:
    """(num_warps, num_stages). fp32 tiles take twice the shared memory per stage: one stage."""
    num_warps = 4 if block_m <= 16 else 8 if head_dim > 128 else 4
    return num_warps, 1 if dtype == torch.float32 else 2


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _choose_kv_splits(programs: int, max_kv_len: int, device: torch.device) -> int:
    """KV splits per query tile: enough programs for about two waves over the GPU's SMs, but
    no split shorter than 512 positions (below that the combine pass costs more than it saves).
    `max_kv_len` is the block table's capacity, known without reading seq_lens back."""
    if device.type != "cuda" or programs == 0:
        return 1
    want = triton.cdiv(2 * _sm_count(device.index or 0), programs)
    return max(1, min(want, max_kv_len // 512, 16))


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    num_kv_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Same contract as `paged_attention_reference` (`window` included); returns
    [total_q_tokens, num_heads, head_dim].

    `num_kv_splits` (default: chosen from the batch shape and the GPU) divides each sequence's
    KV range among that many programs whose partial results a second kernel combines
    (flash-decoding), for batches with too few (sequence, KV head) pairs to fill the GPU.
    """
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

    block_m, block_q, block_n = _tile_shape(total_tokens, num_seqs, group, head_dim, q.dtype)
    # Upper bound on sum over sequences of cdiv(q_len, BLOCK_Q); see the module docstring.
    num_tiles = total_tokens // block_q + num_seqs
    if num_kv_splits is None:
        num_kv_splits = _choose_kv_splits(num_tiles * num_kv_heads, block_tables.shape[1] * block_size, q.device)
    if num_kv_splits < 1:
        raise ValueError(f"paged_attention: num_kv_splits must be >= 1, got {num_kv_splits}")
    split_kv = num_kv_splits > 1
    if split_kv:
        part_acc = torch.empty((num_kv_splits, total_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_kv_splits, total_tokens, num_heads), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:  # unused by the kernel; any tensor will do for the pointer arguments
        part_acc = part_m = part_l = out
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    num_warps, num_stages = _launch_config(q.dtype, block_m, head_dim)
    grid = (num_tiles, num_kv_heads, num_kv_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        block_tables, seq_lens, query_start_loc,
        part_acc, part_m, part_l,
        num_seqs, num_kv_splits, scale * _LOG2E, float(k_scale), float(v_scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_m.stride(0), part_m.stride(1),
        block_size, head_dim, window or 0,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_FP32=_dot_in_fp32(q.dtype),
        SPLIT_KV=split_kv,
        DEQUANT=k_cache.dtype != q.dtype,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split_kv:
        _combine_splits_kernel[(total_tokens, num_heads)](
            part_acc, part_m, part_l, out,
            num_kv_splits, head_dim,
            part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
            part_m.stride(0), part_m.stride(1),
            out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(num_kv_splits),
            BLOCK_D=block_d,
            num_warps=1 if block_d <= 64 else 2,
        )
    return out
