"""Benchmark Tessera's Triton kernels against the PyTorch paths they replace, on one GPU.

    python benchmarks/kernels.py [--dtype bf16|fp16] [--only rmsnorm|paged|fused] [--hbm-gbps N]

RMSNorm (tokens x hidden): the fused Triton kernel vs the eager reference (`rms_norm_reference`)
and torch's own `F.rms_norm`, forward and forward+backward; ms and effective GB/s (bytes that
must move: x, y and weight forward; x, dy, dx, weight and dweight backward).

Paged attention: the Triton kernel vs (a) the reference (per-sequence gather + SDPA, what runs on
CPU) and (b) one batched SDPA call on KV gathered from the block pool into a padded dense tensor
(the usual way to run attention on a paged cache without a paged kernel), timed with the gather
and without it. GB/s counts the KV-cache bytes each sequence must read once.

Fused elementwise kernels (llama-1b shapes: 8192 tokens = batch 2 x seq 4096, hidden 2048, 32/8
heads of 64, ffn 8192, vocab 128256): RMSNorm with the residual add, RoPE on q/k, SwiGLU, and the
chunked loss's per-chunk cross-entropy + gradient. Each against the eager reference and against
inductor's own fusion of the same reference expression (torch.compile), which is what the
trainer's compiled step runs: a kernel earns its place only where it beats inductor or where no
compile happens (inference, eager training). Device time (profiler), achieved bandwidth from the
bytes the op must move, and that bandwidth as a fraction of the GPU's HBM peak.

Prints a table; exits 0 with a note on a machine without CUDA (there is nothing to measure).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def device_ms(fn, iters: int = 20) -> float:
    """GPU time per call: the kernels' own durations summed by the profiler (no launch gaps).

    do_bench's wall time includes the host's launch and dispatch cost, which dominates small
    shapes; this column says how long the device itself was busy.
    """
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / iters / 1e3


def row(name: str, ms: float, nbytes: float, baseline_ms: float | None = None, gpu_ms: float | None = None) -> str:
    gbps = nbytes / (ms * 1e-3) / 1e9
    ratio = f"{baseline_ms / ms:6.2f}x" if baseline_ms else "      "
    gpu = f"   GPU busy {gpu_ms:8.4f} ms ({nbytes / (gpu_ms * 1e-3) / 1e9:7.1f} GB/s)" if gpu_ms else ""
    return f"  {name:<34} {ms:9.4f} ms  {gbps:8.1f} GB/s  {ratio}{gpu}"


def bench_rmsnorm(dtype: torch.dtype) -> None:
    print("RMSNorm (speedup column: vs the eager reference)")
    for tokens, hidden in [(4096, 2048), (8192, 4096), (16384, 8192), (4096, 5120)]:
        _bench_rmsnorm_shape(tokens, hidden, dtype)


def _bench_rmsnorm_shape(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    from tessera.kernels.rmsnorm import rms_norm_reference
    from tessera.kernels.rmsnorm_triton import rms_norm_triton

    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    elem = x.element_size()
    fwd_bytes = 2 * x.numel() * elem + hidden * elem
    bwd_bytes = 3 * x.numel() * elem + 2 * hidden * elem
    impls = {
        "reference (eager)": lambda x, w: rms_norm_reference(x, w, 1e-6),
        "torch F.rms_norm": lambda x, w: F.rms_norm(x, (hidden,), w, 1e-6),
        "triton fused": lambda x, w: rms_norm_triton(x, w, 1e-6),
    }
    err = (rms_norm_triton(x, w, 1e-6) - rms_norm_reference(x, w, 1e-6)).abs().max().item()
    print(f" tokens={tokens} hidden={hidden} {str(dtype).removeprefix('torch.')}  "
          f"(max |triton - reference| = {err:.2e})")
    base_f = base_fb = None
    for name, fn in impls.items():
        with torch.no_grad():
            ms_f = bench_ms(lambda fn=fn: fn(x, w))
            gpu_f = device_ms(lambda fn=fn: fn(x, w))

        def fwd_bwd(fn=fn):
            x.grad = w.grad = None
            fn(x, w).backward(dy)

        ms_fb = bench_ms(fwd_bwd)
        gpu_fb = device_ms(fwd_bwd)
        base_f = base_f or ms_f
        base_fb = base_fb or ms_fb
        print(row(f"{name} fwd", ms_f, fwd_bytes, base_f, gpu_f))
        print(row(f"{name} fwd+bwd", ms_fb, fwd_bytes + bwd_bytes, base_fb, gpu_fb))


def _paged_batch(q_lens, kv_lens, heads, kv_heads, head_dim, block_size, dtype, device="cuda"):
    """Inputs in the documented paged layout, blocks handed out in shuffled order."""
    blocks_per_seq = [-(-kv // block_size) for kv in kv_lens]
    num_blocks = sum(blocks_per_seq)
    perm = torch.randperm(num_blocks).to(torch.int32)
    tables = torch.zeros(len(kv_lens), max(blocks_per_seq), dtype=torch.int32)
    start = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = perm[start:start + n]
        start += n
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(q_lens), heads, head_dim, dtype=dtype, device=device)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables.to(device), seq_lens, qsl, head_dim**-0.5


class DenseSDPA:
    """The peer: gather each sequence's KV from the pool into [B, max_kv, Hkv, D] and run one
    batched SDPA with a causal-offset mask. Mask and query padding index are built once, outside
    the timed call, so only the gather and the attention are measured."""

    def __init__(self, q_lens, kv_lens, device):
        num_seqs, max_q, self.max_kv = len(q_lens), max(q_lens), max(kv_lens)
        total = sum(q_lens)
        self.q_index = torch.full((num_seqs, max_q), total, dtype=torch.long)  # `total` = a zero row
        self.mask = torch.zeros(num_seqs, 1, max_q, self.max_kv, dtype=torch.bool)
        self.out_index = []
        start = 0
        for s, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
            self.q_index[s, :ql] = torch.arange(start, start + ql)
            q_pos = torch.arange(kl - ql, kl)
            self.mask[s, 0, :ql, :kl] = torch.arange(kl)[None, :] <= q_pos[:, None]
            self.mask[s, 0, ql:, 0] = True  # padded query rows: keep their softmax finite
            start += ql
        self.q_index, self.mask = self.q_index.to(device), self.mask.to(device)
        self.valid = (self.q_index < total).flatten()

    def gather(self, k_cache, v_cache, tables):
        n = tables.shape[0]
        k = k_cache[tables.long()].reshape(n, -1, *k_cache.shape[2:])[:, : self.max_kv]
        v = v_cache[tables.long()].reshape(n, -1, *v_cache.shape[2:])[:, : self.max_kv]
        return k, v

    def __call__(self, q, k_cache, v_cache, tables, scale, gathered=None):
        k, v = gathered if gathered is not None else self.gather(k_cache, v_cache, tables)
        qp = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[self.q_index]  # [B, max_q, H, D]
        o = F.scaled_dot_product_attention(
            qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=self.mask, scale=scale,
            enable_gqa=q.shape[1] != k_cache.shape[2],
        )
        return o.transpose(1, 2).flatten(0, 1)[self.valid]  # back to the packed [tokens, H, D]


def bench_paged(dtype: torch.dtype) -> None:
    print("Paged attention, 32 query heads / 8 KV heads, head_dim 128, block 16 "
          "(speedup column: vs batched SDPA including the gather)")
    gen = torch.Generator().manual_seed(0)
    scenarios = {
        "decode 64 seqs x ctx~2k": ([1] * 64, torch.randint(1024, 3072, (64,), generator=gen).tolist()),
        "decode 8 seqs x ctx 8k": ([1] * 8, [8192] * 8),
        "chunked prefill 4x512 + 28 decode": (
            [512] * 4 + [1] * 28, [1024, 512, 2048, 768] + torch.randint(256, 2048, (28,), generator=gen).tolist()),
    }
    for name, (q_lens, kv_lens) in scenarios.items():
        _bench_paged_scenario(name, q_lens, kv_lens, dtype)


def _bench_paged_scenario(name: str, q_lens: list[int], kv_lens: list[int], dtype: torch.dtype) -> None:
    from tessera.kernels.paged_attention import paged_attention_reference
    from tessera.kernels.paged_attention_triton import paged_attention_triton

    args = _paged_batch(q_lens, kv_lens, 32, 8, 128, 16, dtype)
    q, k_cache, v_cache, tables, seq_lens, qsl, scale = args
    kv_bytes = 2 * sum(kv_lens) * 8 * 128 * q.element_size()
    dense = DenseSDPA(q_lens, kv_lens, q.device)
    gathered = dense.gather(k_cache, v_cache, tables)
    err = (paged_attention_triton(*args).float() - dense(q, k_cache, v_cache, tables, scale).float()).abs().max()
    print(f" {name} ({str(dtype).removeprefix('torch.')})  (max |triton - SDPA| = {err.item():.2e})")
    ms_sdpa_gather = bench_ms(lambda: dense(q, k_cache, v_cache, tables, scale))
    ms_sdpa = bench_ms(lambda: dense(q, k_cache, v_cache, tables, scale, gathered))
    ms_ref = bench_ms(lambda: paged_attention_reference(*args))
    ms_tri = bench_ms(lambda: paged_attention_triton(*args))
    print(row("reference (per-seq gather+SDPA)", ms_ref, kv_bytes, ms_sdpa_gather))
    print(row("batched SDPA incl. gather", ms_sdpa_gather, kv_bytes, ms_sdpa_gather))
    print(row("batched SDPA, KV pre-gathered", ms_sdpa, kv_bytes, ms_sdpa_gather))
    print(row("triton paged", ms_tri, kv_bytes, ms_sdpa_gather))


# HBM bandwidth peaks (GB/s) from the vendors' data sheets, matched by substring of the device name.
HBM_PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350,
                 "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L4": 300,
                 "A10G": 600, "RTX 4090": 1008}


def hbm_peak_gbps(configured: float | None) -> float | None:
    if configured:
        return configured
    name = torch.cuda.get_device_name()
    return next((v for k, v in HBM_PEAK_GBPS.items() if k in name), None)


def fused_cases(dtype: torch.dtype):
    """(name, reference, triton entry, make inputs, bytes fwd, bytes fwd+bwd or None) per kernel."""
    from tessera.kernels.cross_entropy import cross_entropy_with_grad_reference
    from tessera.kernels.cross_entropy_triton import cross_entropy_with_grad_triton
    from tessera.kernels.rmsnorm import add_rms_norm_reference
    from tessera.kernels.rmsnorm_triton import add_rms_norm_triton
    from tessera.kernels.rope import rope_qk_reference
    from tessera.kernels.rope_triton import rope_qk_triton
    from tessera.kernels.swiglu import swiglu_reference
    from tessera.kernels.swiglu_triton import swiglu_triton

    tokens, hidden, heads, kv_heads, head_dim, ffn, vocab, chunk = 8192, 2048, 32, 8, 64, 8192, 128256, 4096
    e = torch.finfo(dtype).bits // 8
    dev = "cuda"

    def grad(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=True)

    def rope_inputs():
        pos = torch.arange(4096, device=dev, dtype=torch.float32)
        inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim))
        emb = torch.cat([torch.outer(pos, inv)] * 2, dim=-1)
        return (grad(2, 4096, heads, head_dim), grad(2, 4096, kv_heads, head_dim),
                emb.cos()[None, :, None], emb.sin()[None, :, None])

    labels = torch.randint(0, vocab, (chunk,), device=dev)
    scale = torch.tensor(1.0 / chunk, device=dev)
    qk = 2 * tokens * (heads + kv_heads) * head_dim * e
    return [
        ("add + RMSNorm", lambda x, r, w: add_rms_norm_reference(x, r, w, 1e-5),
         lambda x, r, w: add_rms_norm_triton(x, r, w, 1e-5),
         lambda: (grad(tokens, hidden), grad(tokens, hidden), grad(hidden)), 4 * tokens * hidden * e,
         8 * tokens * hidden * e),
        ("RoPE q+k", rope_qk_reference, rope_qk_triton, rope_inputs, qk, 2 * qk),
        ("SwiGLU", swiglu_reference, swiglu_triton, lambda: (grad(tokens, ffn), grad(tokens, ffn)),
         3 * tokens * ffn * e, 8 * tokens * ffn * e),
        (f"cross-entropy+grad chunk {chunk}x{vocab}",
         lambda x: cross_entropy_with_grad_reference(x, labels, scale, -100),
         lambda x: cross_entropy_with_grad_triton(x, labels, scale, -100),
         lambda: (torch.randn(chunk, vocab, device=dev, dtype=dtype),), 3 * chunk * vocab * e, None),
    ]


def _outputs(out):
    return [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]


def bench_fused(dtype: torch.dtype, hbm_gbps: float | None) -> None:
    peak = hbm_peak_gbps(hbm_gbps)
    print(f"Fused kernels, llama-1b shapes (GPU busy time; speedup vs eager reference; "
          f"HBM peak {peak or 'unknown, pass --hbm-gbps'} GB/s)")
    for name, ref, tri, make, fwd_bytes, fb_bytes in fused_cases(dtype):
        print(f" {name} ({str(dtype).removeprefix('torch.')})")
        impls = {"reference (eager)": ref, "inductor (compiled reference)": torch.compile(ref, dynamic=False),
                 "triton fused": tri}
        base = {}
        for label, fn in impls.items():
            inputs = make()
            for phase, nbytes in (("fwd", fwd_bytes), ("fwd+bwd", fb_bytes)):
                if nbytes is None:
                    continue
                # The cross-entropy step overwrites its logits with the gradient; timing does not
                # depend on the values, so the same buffer is reused.
                if phase == "fwd":
                    def call(fn=fn, inputs=inputs):
                        with torch.no_grad():
                            fn(*inputs)
                else:
                    upstream = [torch.randn_like(o) for o in _outputs(fn(*inputs))]

                    def call(fn=fn, inputs=inputs, upstream=upstream):
                        torch.autograd.backward(_outputs(fn(*inputs)), upstream)
                ms = device_ms(call)
                base.setdefault(phase, ms)
                gbps = nbytes / (ms * 1e-3) / 1e9
                of_peak = f"  {100 * gbps / peak:5.1f}% of HBM peak" if peak else ""
                print(f"  {label + ' ' + phase:<40} {ms:9.4f} ms  {gbps:8.1f} GB/s  "
                      f"{base[phase] / ms:6.2f}x{of_peak}")


def host_profile(dtype: torch.dtype, calls: int = 200) -> None:
    """Where the host's time goes in the Triton RMSNorm's forward + backward (cProfile, top 25)."""
    import cProfile
    import pstats

    from tessera.kernels.rmsnorm_triton import rms_norm_triton

    x = torch.randn(4096, 5120, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(5120, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        x.grad = w.grad = None
        rms_norm_triton(x, w, 1e-6).backward(dy)

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    prof.disable()
    print(f"host profile: {calls} x (triton RMSNorm fwd+bwd, 4096x5120)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation/cache dtype")
    parser.add_argument("--only", choices=["rmsnorm", "paged", "fused"], help="run one of the benchmarks")
    parser.add_argument("--hbm-gbps", type=float, help="HBM peak bandwidth for the %%-of-peak column "
                        "(default: from a table of data-sheet figures by device name)")
    parser.add_argument("--host-profile", action="store_true",
                        help="profile the host side of the Triton RMSNorm (cProfile) instead of timing")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py: a CUDA GPU is required (the kernels' CPU path is Triton's "
              "interpreter, for tests only); nothing measured.")
        return 0
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    dtype = DTYPES[args.dtype]
    if args.host_profile:
        host_profile(dtype)
        return 0
    if args.only in (None, "rmsnorm"):
        bench_rmsnorm(dtype)
    if args.only in (None, "paged"):
        bench_paged(dtype)
    if args.only in (None, "fused"):
        bench_fused(dtype, args.hbm_gbps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
