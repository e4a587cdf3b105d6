"""Where a training step's GPU time goes: its kernels by kind, and the gaps where the GPU idles.

The profiler's CUDA activity lists every kernel with its start and end on the device. Each kernel
is put in one kind by its name (first match wins: attention before GEMMs, since cuDNN's and
FlashAttention's kernels carry sm90/gemm-like words too); "idle" is the step's wall time less the
union of the kernels' intervals: launch gaps, host-side work, synchronisation. Inductor names its
fused kernels after the ops they fuse (`triton_red_fused__log_softmax_...`), so the compiled loss
and norms land in their kinds too.

Used by benchmarks/train_throughput.py --breakdown on CUDA (issue #34: the measured breakdown
before the MFU levers).
"""

from __future__ import annotations

import statistics
import time

KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "_mm_", "wgmma")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax", "logsumexp")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach", "clip")),
    ("norms", ("norm",)),
)
OTHER = "elementwise"  # activations, RoPE, residuals, casts, copies, fills


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, words in KINDS:
        if any(w in lowered for w in words):
            return kind
    return OTHER


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams may overlap)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def split_kernels(kernels: list[tuple[str, float, float]], wall_ms: float) -> dict:
    """(name, start us, end us) of one step's kernels -> ms by kind, the idle ms, the wall ms."""
    kinds = {kind: 0.0 for kind, _ in KINDS} | {OTHER: 0.0}
    for name, start, end in kernels:
        kinds[kernel_kind(name)] += (end - start) / 1e3
    idle = max(0.0, wall_ms - busy_us([(s, e) for _, s, e in kernels]) / 1e3)
    return {"wall_ms": wall_ms, "kinds_ms": kinds, "idle_ms": idle}


def profile_cuda_step(step_fn, batch, sync) -> dict:
    """One profiled step's kernels split by kind."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step_fn(*batch)
        sync()
        wall = time.perf_counter() - start
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == DeviceType.CUDA]
    return split_kernels(kernels, wall * 1e3)


def summarize(profiles: list[dict]) -> dict:
    """Per-kind medians over profiled steps (or over rounds' summaries)."""
    return {"wall_ms": statistics.median(p["wall_ms"] for p in profiles),
            "kinds_ms": {k: statistics.median(p["kinds_ms"][k] for p in profiles) for k in profiles[0]["kinds_ms"]},
            "idle_ms": statistics.median(p["idle_ms"] for p in profiles)}


def print_breakdown(breakdowns: dict[str, dict]) -> None:
    print("GPU breakdown (profiled steps, median ms per step and share of the step):")
    for name, b in breakdowns.items():
        parts = [*b["kinds_ms"].items(), ("idle", b["idle_ms"])]
        print(f"  {name:13}step {b['wall_ms']:7.1f} ms = " + ", ".join(
            f"{kind} {ms:.1f} ({100 * ms / b['wall_ms']:.0f}%)" for kind, ms in parts))
