"""Training metrics: throughput and MFU arithmetic, memory, and the three sinks.

Every logged step produces one record that goes, unchanged, to the console (one line), to
`<run_dir>/metrics.jsonl` and to TensorBoard scalars. Each record carries its UTC time and the
seconds since this process started (`time`, `elapsed_s`), and a training record the estimated
time to the last step (`eta_s`, from the logged step time), so a batch job's log reads on its own.
TensorBoard is an optional dependency: when it is configured but cannot be imported, one line
says so and the run goes on without it.

MFU on CPU is an estimate: its reference is a matmul measured at start, which a loaded machine
can under-measure; the reference is raised to the best throughput seen (so MFU never exceeds
100%) and the line marks it `MFU~`.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from tessera.trainer.components.observability.trackers import open_trackers
from tessera.trainer.config import LoggingConfig

# Dense bf16/fp16 tensor-core peaks (TFLOP/s, without sparsity) from the vendors' data sheets.
GPU_PEAK_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A10G": 125.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L4": 121.0,
    "V100": 125.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
}


def gpu_peak_tflops(device_name: str) -> float | None:
    """Peak for a CUDA device name such as 'NVIDIA H100 80GB HBM3'; longest matching key wins."""
    name = device_name.upper()
    matches = [k for k in GPU_PEAK_TFLOPS if k.upper() in name]
    if "H100" in name and ("PCIE" in name):
        return GPU_PEAK_TFLOPS["H100 PCIe"]
    return GPU_PEAK_TFLOPS[max(matches, key=len)] if matches else None


def measure_matmul_tflops(dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 8) -> float:
    """Achieved TFLOP/s of a square matmul on this CPU: the MFU reference when no peak is known."""
    gen = torch.Generator().manual_seed(0)  # a private generator: the run's RNG streams stay untouched
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    a @ b  # warm up the BLAS threads
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    elapsed = time.perf_counter() - start
    return 2.0 * size**3 * repeats / elapsed / 1e12


def resolve_peak_tflops(device: torch.device, configured: float | None) -> tuple[float | None, str]:
    """(peak, where it came from) for MFU."""
    if configured is not None:
        return configured, "configured"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name)
        return peak, (f"table ({name})" if peak is not None else f"unknown GPU {name}; set --peak-tflops")
    return measure_matmul_tflops(), "measured fp32 matmul on this CPU"


def step_time_spread(seconds: float, world_size: int, device: torch.device) -> dict[str, float | int]:
    """Under torchrun, every rank's step time over the log window: the slowest rank and the spread,
    so a straggler shows on the log line (a collective: one all-gather of a scalar per logged step)."""
    import torch.distributed as dist

    if world_size == 1 or not dist.is_initialized():
        return {}
    times = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world_size)]
    dist.all_gather(times, torch.tensor([seconds], dtype=torch.float64, device=device))
    values = [float(x) for x in times]
    slowest = max(range(len(values)), key=values.__getitem__)
    return {"step_time_min_s": min(values), "step_time_max_s": values[slowest], "slowest_rank": slowest}


def memory_gib(device: torch.device) -> float:
    """Max allocated GPU memory on CUDA; resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return psutil.Process().memory_info().rss / 2**30


def duration(seconds: float) -> str:
    """1h02m03s / 4m05s / 6s."""
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def format_record(rec: dict[str, Any]) -> str:
    stamp = f"{rec['time'][:19].replace('T', ' ')} " if rec.get("time") else ""
    clock = f" | elapsed {duration(rec['elapsed_s'])}" if rec.get("elapsed_s") is not None else ""
    if rec.get("kind") == "eval":
        return (f"{stamp}eval  step {rec['step']:>6} | valid loss {rec['valid_loss']:.4f} | "
                f"valid ppl {rec['valid_ppl']:.2f}{clock}")
    if rec.get("kind") == "test":
        return (f"{stamp}test  step {rec['step']:>6} | test loss {rec['test_loss']:.4f} | "
                f"test ppl {rec['test_ppl']:.2f}{clock}")
    parts = [f"{stamp}step {rec['step']:>6}/{rec['total_steps']}", f"loss {rec['loss']:.4f}",
             f"grad norm {rec['grad_norm']:.3f}", f"lr {rec['lr']:.3e}", f"tokens/s {rec['tokens_per_s']:,.0f}",
             f"TFLOP/s {rec['tflops']:.3f}"]
    if rec.get("mfu") is not None:
        parts.append(f"MFU{'~' if rec.get('mfu_estimate') else ''} {100 * rec['mfu']:.1f}%")
    if rec.get("params_norm") is not None:
        parts.append(f"params norm {rec['params_norm']:.3f}")
    if rec.get("moe_aux_loss") is not None:
        parts.append(f"moe aux {rec['moe_aux_loss']:.4f} max load {rec['moe_max_load']:.2f}x "
                     f"dropped {rec['moe_dropped']:.0f}")
    if rec.get("mtp_loss") is not None:
        parts.append(f"mtp loss {rec['mtp_loss']:.4f}")
    parts.append(f"mem {rec['memory_gib']:.2f} GiB")
    if rec.get("loss_scale") is not None:
        parts.append(f"loss scale {rec['loss_scale']:g}")
    if rec.get("step_time_max_s") is not None:
        parts.append(f"step time rank {rec['slowest_rank']} {rec['step_time_max_s']:.3f}s / "
                     f"min {rec['step_time_min_s']:.3f}s")
    line = " | ".join(parts) + clock
    return line + (f" | ETA {duration(rec['eta_s'])}" if rec.get("eta_s") is not None else "")


class MetricsSink:
    """Console + JSON lines + TensorBoard; only rank 0 writes."""

    def __init__(self, run_dir: Path, jsonl: bool, tensorboard: bool, write, enabled: bool = True,
                 trackers: list | None = None):
        self.write = write
        self.enabled = enabled
        self.trackers = trackers or []  # tessera.trainer.components.observability.trackers (W&B, MLflow)
        self.started = time.monotonic()
        self.jsonl = None
        self.tb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if jsonl:
            self.jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # optional dependency: say so once, go on without it
                SummaryWriter = None
                write("note: logging.tensorboard is on but tensorboard is not installed; no TensorBoard scalars "
                      "(pip install tensorboard, or set logging.tensorboard=false)")
            if SummaryWriter is not None:
                self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    @classmethod
    def for_run(cls, logging: LoggingConfig, run_dir: Path, config: dict[str, Any], write,
                enabled: bool) -> MetricsSink:
        """The sinks the logging section asks for; trackers (W&B, MLflow, given the run's `config`) are
        started where this rank writes (`enabled`)."""
        trackers = open_trackers(logging, run_dir, config, write) if enabled else []
        return cls(run_dir, logging.jsonl, logging.tensorboard, write, enabled, trackers)

    def log(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        rec = {"time": now, "elapsed_s": round(time.monotonic() - self.started, 3), **rec}
        if rec.get("kind", "train") == "train" and rec.get("step_time_s") is not None and "total_steps" in rec:
            rec["eta_s"] = round(max(rec["total_steps"] - rec["step"], 0) * rec["step_time_s"], 1)
        self.write(format_record(rec))
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(rec) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            prefix = {"eval": "eval/", "test": "test/"}.get(rec.get("kind"), "train/")
            for key, value in rec.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value is not None \
                        and key not in ("step", "total_steps"):
                    self.tb.add_scalar(prefix + key, value, rec["step"])
            self.tb.flush()
        for tracker in self.trackers:
            tracker.log(rec)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
