"""Benchmark the Mamba-2 Triton kernels against their PyTorch references, on one GPU.

    python benchmarks/ssm_kernels.py [--dtype bf16|fp16|fp32] [--hbm-gbps N] [--no-reference]

The SSD chunked scan (`ssd_chunk_scan` on CUDA, tessera.kernels.ssm) against
`ssd_chunk_scan_reference` (what runs on CPU), forward and forward+backward, at the Mamba-2 2.7B
mixer's shape (80 heads of 64, one group, state 128, chunk 256) and Nemotron-H 8B's (128 heads
of 64, 8 groups, state 128, chunk 128), batch x 4096 tokens. Also the causal conv1d forward and
forward+backward and the decoding state update (a 256-sequence batch from a 512-slot pool).

Each row: wall ms (triton.testing.do_bench), device-busy ms (profiler), the reference's time over
the kernel's, and the bytes the op must move at least (inputs read and outputs written once;
the scan's per-chunk states excluded) over device time, as GB/s and as a percentage of the GPU's
HBM data-sheet peak. The scan's matmuls make it partly compute-bound, so its percentage is a
lower bound on how well it uses the memory system, not a target of 100.

Without CUDA it says so and exits 0 (the CPU path is Triton's interpreter, for tests only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import bench_ms, device_ms, hbm_peak_gbps  # noqa: E402  (benchmarks/kernels.py)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (name, batch, tokens, heads, head_dim, groups, state, chunk)
SCAN_SHAPES = [("mamba2-2.7b", 2, 4096, 80, 64, 1, 128, 256), ("nemotron-h-8b", 1, 4096, 128, 64, 8, 128, 128)]


def _report(name: str, fn, nbytes: float, peak: float | None, baseline=None) -> float:
    ms, busy = bench_ms(fn), device_ms(fn)
    gbps = nbytes / (busy * 1e-3) / 1e9
    ratio = f"{baseline / ms:7.2f}x" if baseline else "        "
    of_peak = f"  {100 * gbps / peak:5.1f}% of HBM peak" if peak else ""
    print(f"  {name:<40} {ms:9.3f} ms  busy {busy:9.3f} ms  {ratio}  {gbps:8.1f} GB/s{of_peak}", flush=True)
    return ms


def bench_scan(dtype: torch.dtype, peak: float | None, reference: bool) -> None:
    print("SSD chunked scan (ratio column: reference time / Triton time)")
    for shape in SCAN_SHAPES:
        _bench_scan_shape(*shape, dtype=dtype, peak=peak, reference=reference)
        torch.cuda.empty_cache()


def _bench_scan_shape(name, b, T, H, P, G, N, L, dtype, peak, reference) -> None:
    from tessera.kernels.ssd import discretize_dt, ssd_chunk_scan, ssd_chunk_scan_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, T, H, P, device="cuda", dtype=dtype, generator=g).requires_grad_()
    dt = torch.randn(b, T, H, device="cuda", dtype=dtype, generator=g).requires_grad_()
    B = torch.randn(b, T, G, N, device="cuda", dtype=dtype, generator=g).requires_grad_()
    C = torch.randn(b, T, G, N, device="cuda", dtype=dtype, generator=g).requires_grad_()
    A = -torch.rand(H, device="cuda").add(0.5).requires_grad_()
    D, bias = torch.ones(H, device="cuda", requires_grad=True), torch.zeros(H, device="cuda", requires_grad=True)
    dy = torch.randn(b, T, H, P, device="cuda")
    elem = x.element_size()
    # At least: x, dt, B, C read; y (fp32) and the final state written. Backward: dy read, grads written.
    fwd_bytes = (x.numel() + dt.numel() + B.numel() + C.numel()) * elem + y_bytes(b, T, H, P) + b * H * P * N * 4
    bwd_bytes = 2 * fwd_bytes + y_bytes(b, T, H, P)
    print(f" {name}: batch {b} x {T} tokens, {H} heads x {P}, {G} groups, state {N}, chunk {L}, {dtype}")

    def triton_fwd():
        with torch.no_grad():
            ssd_chunk_scan(x, dt, A, B, C, L, D, dt_bias=bias, dt_softplus=True)

    def triton_fwd_bwd():
        y, _ = ssd_chunk_scan(x, dt, A, B, C, L, D, dt_bias=bias, dt_softplus=True)
        y.backward(dy)

    def ref_fwd():
        with torch.no_grad():
            ssd_chunk_scan_reference(x, discretize_dt(dt, bias), A, B, C, L, D)

    def ref_fwd_bwd():
        y, _ = ssd_chunk_scan_reference(x, discretize_dt(dt, bias), A, B, C, L, D)
        y.backward(dy)

    base_f = base_b = None
    if reference:
        base_f = _report("reference forward", ref_fwd, fwd_bytes, peak)
        base_b = _report("reference forward+backward", ref_fwd_bwd, bwd_bytes, peak)
    _report("triton forward", triton_fwd, fwd_bytes, peak, base_f)
    _report("triton forward+backward", triton_fwd_bwd, bwd_bytes, peak, base_b)


def y_bytes(b: int, T: int, H: int, P: int) -> int:
    return b * T * H * P * 4


def bench_conv_and_update(dtype: torch.dtype, peak: float | None, reference: bool) -> None:
    from tessera.kernels.causal_conv1d import causal_conv1d, causal_conv1d_reference
    from tessera.kernels.ssd import ssd_state_update, ssd_state_update_reference

    b, T, ch, K = 2, 4096, 5120 + 2 * 128, 4
    x = torch.randn(b, T, ch, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(ch, K, device="cuda", dtype=dtype, requires_grad=True)
    bias = torch.randn(ch, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    nbytes = 2 * x.numel() * x.element_size()
    print(f"causal conv1d: batch {b} x {T} tokens x {ch} channels, K {K}, SiLU, {dtype}")
    base_f = base_b = None
    if reference:
        base_f = _report("reference forward", lambda: causal_conv1d_reference(x.detach(), w, bias), nbytes, peak)
        base_b = _report("reference forward+backward",
                         lambda: causal_conv1d_reference(x, w, bias)[0].backward(dy), 2.5 * nbytes, peak)
    _report("triton forward", lambda: causal_conv1d(x.detach(), w.detach(), bias.detach()), nbytes, peak, base_f)
    _report("triton forward+backward", lambda: causal_conv1d(x, w, bias)[0].backward(dy), 2.5 * nbytes, peak, base_b)

    seqs, slots, H, P, G, N = 256, 512, 80, 64, 1, 128
    pool = torch.zeros(slots, H, P, N, device="cuda")
    idx = torch.randperm(slots, device="cuda")[:seqs].to(torch.int32)
    xs = torch.randn(seqs, H, P, device="cuda", dtype=dtype)
    dts = torch.randn(seqs, H, device="cuda", dtype=dtype)
    Bs, Cs = (torch.randn(seqs, G, N, device="cuda", dtype=dtype) for _ in range(2))
    A, D, dtb = -torch.rand(H, device="cuda"), torch.ones(H, device="cuda"), torch.zeros(H, device="cuda")
    state_bytes = 2 * seqs * H * P * N * 4  # each sequence's fp32 state read and written
    print(f"state update (decoding): {seqs} sequences in a pool of {slots}, {H} heads x {P}, state {N}")
    base = None
    if reference:
        base = _report("reference", lambda: ssd_state_update_reference(pool, xs, dts, A, Bs, Cs, D, dt_bias=dtb,
                                                                       dt_softplus=True, state_indices=idx),
                       state_bytes, peak)
    _report("triton", lambda: ssd_state_update(pool, xs, dts, A, Bs, Cs, D, dt_bias=dtb, dt_softplus=True,
                                               state_indices=idx), state_bytes, peak, base)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation dtype")
    parser.add_argument("--hbm-gbps", type=float, help="HBM peak for the %%-of-peak column (default: by device name)")
    parser.add_argument("--no-reference", action="store_true", help="time only the Triton kernels")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/ssm_kernels.py: needs a CUDA GPU (the Triton kernels' CPU path is Triton's interpreter, "
              "for tests only); nothing measured.")
        return 0
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    peak = hbm_peak_gbps(args.hbm_gbps)
    dtype = DTYPES[args.dtype]
    bench_scan(dtype, peak, not args.no_reference)
    bench_conv_and_update(dtype, peak, not args.no_reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
