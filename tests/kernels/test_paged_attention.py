"""Paged attention (Triton) against paged_attention_reference.

Batches are built the way the inference engine builds them: a block pool shared by all
sequences, blocks handed out in shuffled (non-contiguous) order, ragged lengths, decode (one new
token) and chunked prefill (several new tokens after a cached context) in one batch. Cache slots
no sequence owns hold NaN, so a kernel that reads past a sequence's length or through a padded
block-table entry fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tessera.kernels import paged_attention, paged_attention_reference

TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)


def make_batch(q_lens, kv_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
               device="cpu", seed=0, spare_blocks=3, interleaved_cache=False) -> Batch:
    """Random paged batch; q_lens[s] new tokens of sequence s, kv_lens[s] tokens in the cache."""
    assert all(0 <= q <= kv for q, kv in zip(q_lens, kv_lens))
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-kv // block_size) for kv in kv_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool_order = torch.randperm(num_blocks, generator=g).tolist()
    block_tables = torch.full((len(kv_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if interleaved_cache:
        # K and V as views into one [blocks, 2, ...] allocation: strided block dimension.
        kv = torch.full((num_blocks, 2, *shape[1:]), float("nan"), dtype=dtype)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        k_cache = torch.full(shape, float("nan"), dtype=dtype)
        v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for s, (n, kv_len) in enumerate(zip(blocks_per_seq, kv_lens)):
        mine, pool_order = pool_order[:n], pool_order[n:]
        block_tables[s, :n] = torch.tensor(mine, dtype=torch.int32)
        for i, blk in enumerate(mine):
            used = min(block_size, kv_len - i * block_size)
            k_cache[blk, :used] = torch.randn(used, num_kv_heads, head_dim, generator=g).to(dtype)
            v_cache[blk, :used] = torch.randn(used, num_kv_heads, head_dim, generator=g).to(dtype)
    total = sum(q_lens)
    # q as a slice of a fused qkv projection output: token stride wider than heads * head_dim.
    qkv = torch.randn(total, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    q = qkv[:, :num_heads]
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    batch = Batch(q, k_cache, v_cache, block_tables, torch.tensor(kv_lens, dtype=torch.int32),
                  query_start_loc, head_dim**-0.5)
    if device != "cpu":
        batch = Batch(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in batch.args()))
    return batch


def _check(batch: Batch):
    out = paged_attention(*batch.args())
    ref = paged_attention_reference(*batch.args())
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    # Rows of sequences with no new tokens are not written by either; compare the written ones.
    written = int(batch.query_start_loc[-1])
    assert not out[:written].isnan().any(), "kernel read an unowned cache slot"
    atol, rtol = TOLERANCES[batch.q.dtype]
    torch.testing.assert_close(out[:written], ref[:written], atol=atol, rtol=rtol)


CASES = {
    # name: (q_lens, kv_lens, heads, kv_heads, head_dim, block_size, dtype)
    "decode-mha": ([1, 1, 1, 1], [1, 17, 33, 8], 4, 4, 32, 16, torch.float32),
    "decode-gqa4-bs5": ([1, 1, 1], [5, 23, 11], 8, 2, 16, 5, torch.float32),
    "prefill-gqa2": ([13, 6], [13, 6], 4, 2, 32, 4, torch.float32),
    "mixed-gqa2": ([1, 9, 1, 0, 4], [30, 21, 2, 7, 4], 4, 2, 32, 8, torch.float32),
    "mixed-gqa4-headdim24": ([3, 1, 7], [40, 9, 7], 8, 2, 24, 16, torch.float32),
    "gqa3-nonpow2": ([1, 5], [12, 19], 6, 2, 16, 8, torch.float32),
    "long-prefill-tiles": ([70, 1], [100, 65], 2, 2, 16, 16, torch.float32),
    "mixed-fp16": ([2, 1, 6], [9, 40, 6], 4, 2, 32, 16, torch.float16),
    "mixed-bf16": ([1, 4, 1], [30, 4, 70], 4, 1, 64, 16, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference_on_cpu(triton_cpu, spy_triton, name):
    q_lens, kv_lens, h, kvh, d, bs, dtype = CASES[name]
    _check(make_batch(q_lens, kv_lens, h, kvh, d, bs, dtype, seed=len(name)))
    assert spy_triton.get("paged_attention_triton") == 1, "dispatcher did not run the Triton kernel"


@pytest.mark.parametrize("dtype,splits", [(torch.float32, 3), (torch.float32, 7), (torch.bfloat16, 3)])
def test_split_kv_matches_reference(triton_cpu, dtype, splits):
    """Flash-decoding path: each sequence's KV range split over several programs and combined.
    The prefill's new tokens sit at positions 124..139 and a split starts at 128 for every case
    here, so its first rows see nothing in that split (their partial max stays -inf), which must
    not produce NaN; with 7 splits some splits are empty."""
    from tessera.kernels.paged_attention_triton import paged_attention_triton

    batch = make_batch([1, 16, 1], [150, 140, 40], 4, 1, 16, 16, dtype, seed=5)
    out = paged_attention_triton(*batch.args(), num_kv_splits=splits)
    assert not out.isnan().any()
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, paged_attention_reference(*batch.args()), atol=atol, rtol=rtol)


def test_interleaved_kv_allocation(triton_cpu):
    """K and V views of one allocation (block stride twice the block size) are read by stride."""
    _check(make_batch([2, 1], [18, 7], 4, 2, 16, 8, torch.float32, interleaved_cache=True))


def test_decode_step_equals_last_row_of_prefill(triton_cpu):
    """Causal offset: decoding the last token alone gives the prefill's last row."""
    prefill = make_batch([12], [12], 4, 2, 16, 4, torch.float32, seed=3)
    full = paged_attention(*prefill.args())
    decode = Batch(prefill.q[-1:], prefill.k_cache, prefill.v_cache, prefill.block_tables,
                   prefill.seq_lens, torch.tensor([0, 1], dtype=torch.int32), prefill.scale)
    step = paged_attention(*decode.args())
    torch.testing.assert_close(step[0], full[-1], atol=1e-6, rtol=1e-6)


def test_dispatcher_uses_reference_on_cpu_unless_forced(monkeypatch, spy_triton):
    monkeypatch.delenv("TESSERA_FORCE_TRITON", raising=False)
    batch = make_batch([1, 3], [9, 3], 4, 2, 16, 4, torch.float32)
    assert torch.equal(paged_attention(*batch.args()), paged_attention_reference(*batch.args()))
    assert "paged_attention_triton" not in spy_triton


def test_rejects_mismatched_shapes(triton_cpu):
    batch = make_batch([1], [5], 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="multiple of"):
        paged_attention(batch.q[:, :3], *batch.args()[1:])
    with pytest.raises(ValueError, match="number of sequences"):
        paged_attention(*batch.args()[:4], batch.seq_lens, torch.tensor([0, 1, 1], dtype=torch.int32),
                        batch.scale)


GPU_CASES = {
    **CASES,
    "decode-batch-bf16": ([1] * 64, torch.randint(1, 2048, (64,), generator=torch.Generator().manual_seed(0)).tolist(),
                          32, 8, 128, 16, torch.bfloat16),
    "prefill-chunk-fp16": ([512, 256, 1, 1], [1024, 256, 700, 5], 32, 8, 128, 16, torch.float16),
    # Few sequences, long contexts: too few programs to fill the GPU, so KV splits are chosen.
    "decode-few-long-split-bf16": ([1] * 4, [4000, 3000, 8000, 100], 32, 8, 128, 16, torch.bfloat16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_triton_matches_reference_on_cuda(triton_cuda, spy_triton, name):
    q_lens, kv_lens, h, kvh, d, bs, dtype = GPU_CASES[name]
    _check(make_batch(q_lens, kv_lens, h, kvh, d, bs, dtype, device="cuda", seed=len(name)))
    assert spy_triton.get("paged_attention_triton") == 1


@pytest.mark.parametrize("splits", [1, 3])
def test_sliding_window_triton_matches_reference_and_the_reference_matches_dense_sdpa(triton_cpu, splits):
    """A window of 6 over decode and chunked-prefill rows: the Triton kernel (with and without KV
    splits) equals the reference, and the reference equals dense attention under transformers'
    sliding-window mask (k > q - window), so the window is really applied."""
    from tessera.kernels.paged_attention_triton import paged_attention_triton

    batch = make_batch([1, 9, 4], [30, 21, 4], 4, 2, 16, 8, torch.float32, seed=3)
    window = 6
    ref = paged_attention_reference(*batch.args(), window)
    out = paged_attention_triton(*batch.args(), window=window, num_kv_splits=splits)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert (ref - paged_attention_reference(*batch.args())).abs().max() > 1e-2
    starts = batch.query_start_loc.tolist()
    for s, kv_len in enumerate(batch.seq_lens.tolist()):
        blocks = batch.block_tables[s, : -(-kv_len // 8)].long()
        k = batch.k_cache[blocks].reshape(-1, 2, 16)[:kv_len].repeat_interleave(2, 1).transpose(0, 1)
        v = batch.v_cache[blocks].reshape(-1, 2, 16)[:kv_len].repeat_interleave(2, 1).transpose(0, 1)
        q = batch.q[starts[s]:starts[s + 1]].transpose(0, 1)
        q_pos = torch.arange(kv_len - q.shape[1], kv_len)[:, None]
        k_pos = torch.arange(kv_len)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=batch.scale)
        torch.testing.assert_close(ref[starts[s]:starts[s + 1]], dense.transpose(0, 1), atol=2e-5, rtol=2e-5)


def _fp8_batch(batch: Batch, dtype: torch.dtype, k_scale: float, v_scale: float) -> Batch:
    """The batch's caches stored as the engine stores them with --kv-cache-dtype fp8: x / scale in fp8
    (NaN in the unowned slots stays NaN)."""
    return Batch(batch.q, (batch.k_cache / k_scale).to(dtype), (batch.v_cache / v_scale).to(dtype),
                 batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_reads_an_fp8_cache_like_the_reference_and_close_to_the_unquantized_cache(triton_cpu, fp8, splits):
    """fp8 keys/values with per-tensor scales (not 1, so a scale applied twice or not at all shows):
    the kernel dequantizes exactly as the reference (same fp32 values, so fp32 tolerances), and
    both stay close to attention over the unquantized cache: e4m3's relative rounding is <= 2^-4
    per value, e5m2's <= 2^-3, and attention averages it (measured 0.030 / 0.059 normwise here)."""
    from tessera.kernels.paged_attention_triton import paged_attention_triton

    batch = make_batch([1, 9, 1, 4], [30, 21, 2, 4], 4, 2, 32, 8, torch.float32, seed=11)
    exact = paged_attention_reference(*batch.args())
    scales = {"k_scale": 0.5, "v_scale": 2.0}
    quant = _fp8_batch(batch, fp8, **scales)
    ref = paged_attention_reference(*quant.args(), **scales)
    out = paged_attention_triton(*quant.args(), num_kv_splits=splits, **scales)
    assert out.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    bound = 0.05 if fp8 == torch.float8_e4m3fn else 0.1
    assert (ref - exact).norm() / exact.norm() < bound
    # Without the scales the values are off by x2 / x0.5: the scales are really applied.
    assert (paged_attention_reference(*quant.args()) - exact).norm() / exact.norm() > 0.3


def test_the_dispatcher_refuses_caches_of_two_dtypes(triton_cpu):
    batch = make_batch([1], [5], 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="fp8"):
        paged_attention(batch.q, batch.k_cache.to(torch.float8_e4m3fn), batch.v_cache, *batch.args()[3:])
