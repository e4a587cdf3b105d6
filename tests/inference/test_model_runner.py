"""The CPU batched-decode attention path (single tokens, and speculative rows of several) equals the
kernels' paged-attention reference."""

from __future__ import annotations

import pytest
import torch

from tessera.inference.model_runner import (
    DECODE_GROUP,
    batched_decode_attention,
    decode_attention,
    decode_groups,
)
from tessera.kernels.paged_attention import paged_attention_reference


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_batched_decode_matches_reference(heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, dim = 200, 4, 16
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    # More sequences than one decode group (8), unsorted, so groups of different widths form.
    lens = [1, 7, 16, 23, 40, 2, 33, 9, 17, 39, 4, 28, 12, 31, 5, 24, 36, 8, 20]
    assert len(lens) > 2 * DECODE_GROUP
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lens), 10, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[s, :nb] = torch.tensor(perm[used:used + nb])
        used += nb
    q = torch.randn(len(lens), heads, dim, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, starts, dim ** -0.5)
    out = batched_decode_attention(q, k_cache, v_cache, tables, seq_lens, dim ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_grouped_speculative_rows_match_reference(window):
    # Speculative decoding's rows: each sequence's newest token and 3 drafts, attended causally.
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, num_blocks, block_size, dim, num_q = 8, 2, 120, 4, 16, 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    lens = [4, 9, 30, 17, 5, 26, 12, 21, 8, 33, 15]
    tables = torch.randperm(num_blocks, generator=g)[:len(lens) * 9].view(len(lens), 9).to(torch.int32)
    q = torch.randn(len(lens) * num_q, heads, dim, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.arange(0, len(lens) * num_q + 1, num_q, dtype=torch.int32)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, starts, dim ** -0.5, window)
    rows = torch.arange(len(lens) * num_q).view(len(lens), num_q)
    out = torch.empty_like(q)
    for group in decode_groups(tables, seq_lens, block_size, rows, num_q):
        out[group.rows] = decode_attention(q[group.rows], k_cache, v_cache, group, dim ** -0.5, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
