"""The CPU batched-decode attention path (single tokens, and speculative rows of several) equals the
kernels' paged-attention reference: per call, and for a whole runner step whose rows attend in
group order and go back to batch order."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import tiny_config

from tessera.common.models.causal_lm.model import build_model
from tessera.inference.worker.batch import BatchSeq
from tessera.inference.worker.decode_attention import (
    DECODE_GROUP,
    decode_attention,
    decode_groups,
    decode_split,
    split_attention,
)
from tessera.inference.worker.merged_linear import merge_projections
from tessera.inference.worker.model_runner import ModelRunner
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
    split = decode_split([1] * len(lens), starts.tolist(), tables, seq_lens, block_size)  # as the runner splits a step
    assert len(split.decode_groups) == 3 and split.order is not None
    out = split_attention(q, k_cache, v_cache, split, dim ** -0.5)
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


MIXED = [1, 1, 0, 1, 3, 1, 1, 1, 0, 1, 1, 3, 1, 1, 1, 1]  # num_q per sequence (0: prefill): 3 groups, reordered
IN_ORDER = [1, 1, 1, 0, 0]  # one group already in batch order, prefill chunks after it: nothing reordered


def _mixed_step_logits(cfg, merged: bool, kinds: list[int] = MIXED):
    """Logits of every row of one step that interleaves, in batch order, single-token decodes
    (more than one decode group), speculative rows of 3 and prefill chunks (one at position 0,
    one continuing a prompt), through the CPU split (grouped decode attention) and, as the
    reference, through the kernels' paged-attention reference for every sequence."""
    model = build_model(cfg, seed=0).eval()
    if merged:
        merge_projections(model)  # q, k and v as slices of one GEMM output, as the engine serves
    block_size, blocks_per_seq = 4, 12
    g = torch.Generator().manual_seed(3)
    prompt_lens = torch.randint(5, 30, (len(kinds),), generator=g).tolist()
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(kinds))]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
    prefill = [BatchSeq(p, 0, t, 0) for p, t in zip(prompts, tables)]
    step = []
    for i, (n_q, p, t) in enumerate(zip(kinds, prompts, tables)):
        if n_q == 0 and i == 2:  # a new prompt, from position 0
            step.append(BatchSeq(torch.randint(0, cfg.vocab_size, (7,), generator=g).tolist(), 0, t, 0))
        elif n_q == 0:  # the next chunk of a prompt
            step.append(BatchSeq(torch.randint(0, cfg.vocab_size, (5,), generator=g).tolist(), len(p), t, 0))
        else:
            step.append(BatchSeq(torch.randint(0, cfg.vocab_size, (n_q,), generator=g).tolist(), len(p), t, n_q))
    logits = []
    for batch_decodes in (True, False):
        runner = ModelRunner(model, len(kinds) * blocks_per_seq, block_size, torch.device("cpu"), torch.float32)
        runner.batch_decodes = batch_decodes
        with torch.inference_mode():
            runner.forward_batch([s for i, s in enumerate(prefill) if i != 2], [0])
            rows = list(range(sum(s.num_new for s in step)))
            if batch_decodes:
                split = runner.prepare(step, rows).split
                assert split is not None
                assert (split.order is None, len(split.decode_groups)) == ((False, 3) if kinds == MIXED else (True, 1))
            logits.append(runner.forward_batch(step, rows))
    return logits


@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("window", [None, 9])
def test_a_mixed_step_through_the_decode_groups_equals_paged_attention_for_every_row(window, merged):
    cfg = tiny_config(num_heads=4, num_kv_heads=2, sliding_window=window)
    grouped, reference = _mixed_step_logits(cfg, merged)
    assert (grouped - reference).norm() / reference.norm() < 1e-5


def test_a_decode_group_in_batch_order_before_prefill_chunks_equals_paged_attention_unreordered():
    cfg = tiny_config(num_heads=4, num_kv_heads=1, sliding_window=5)
    grouped, reference = _mixed_step_logits(cfg, merged=True, kinds=IN_ORDER)
    assert (grouped - reference).norm() / reference.norm() < 1e-5


def test_up_to_a_decode_group_in_batch_order_is_split_without_reordering_rows():
    runner = ModelRunner(build_model(tiny_config(), seed=0), 80, 4, torch.device("cpu"), torch.float32)
    lens = [9, 3, 17, 6, 11, 2, 8, 13]
    batch = [BatchSeq([1], n - 1, list(range(8 * i, 8 * i + 8)), 1) for i, n in enumerate(lens)]
    split = runner.prepare(batch + [BatchSeq([1, 2, 3], 0, list(range(64, 72)), 0)], [0]).split
    assert split is not None and len(split.decode_groups) == 1 and split.order is None
    assert split.decode_groups[0].rows.tolist() == list(range(len(lens)))
