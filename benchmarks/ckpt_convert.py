"""Throughput and peak memory of tessera-ckpt reshard / export / import on a >= 1 GB checkpoint.

Builds a random Llama checkpoint (default: d=2048, ffn=8192, 6 layers, vocab 16000, untied, fp32:
~1.9 GB, largest tensor 128 MiB), then runs each conversion in a fresh process and reports wall
time, throughput (payload bytes / s), peak RSS, and, as the peer, `cp -r` of the same checkpoint
directory. Peak memory is compared with the model size and the largest tensor: the target is
"largest tensor x small constant + fixed overhead", not the model size; throughput target >= 0.5x cp.

    .venv/bin/python benchmarks/ckpt_convert.py [--workdir DIR] [--layers 6] [--keep]

The page cache is warm for every run (the checkpoint was just written or read), the same for cp.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# One process per operation: first the same operation on a tiny checkpoint (warm-up: every lazy
# import and one-time allocation happens there; its peak RSS is the fixed overhead), then the
# measured run. Peak RSS is VmHWM of this process (ru_maxrss would include the parent's peak,
# which survives fork + exec on Linux).
WRAPPER = r"""
import json, os, sys, time
from tessera.ckpt_convert.cli import run
def hwm():
    return int([ln for ln in open("/proc/self/status") if ln.startswith("VmHWM")][0].split()[1]) * 1024
warm, real = json.loads(sys.argv[1])
run(warm)
fixed = hwm()
t0, c0 = time.perf_counter(), os.times()
run(real)
dt, c1 = time.perf_counter() - t0, os.times()
print("BENCH", dt, hwm(), (c1.user + c1.system) - (c0.user + c0.system), fixed, file=sys.stderr)
"""


def make_checkpoint(root: Path, layers: int, hidden: int, ffn: int, vocab: int) -> Path:
    import torch

    from tessera.common.checkpoint import (
        CheckpointSidecar,
        finalize_checkpoint,
        save_model_tensors,
        write_pointer,
    )
    from tessera.common.model import build_model
    from tessera.common.model_config import ModelConfig

    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=16,
                      num_kv_heads=8, ffn_hidden_size=ffn, max_seq_len=2048)
    model = build_model(cfg, seed=None)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)
    directory = root / "iter_0000001"
    save_model_tensors(directory, {k: v for k, v in model.state_dict().items()})
    finalize_checkpoint(directory, CheckpointSidecar(model=cfg, step=1))
    write_pointer(root, 1)
    return directory


def timed(py: str, warm: list[str], real: list[str]) -> tuple[float, int, float, int]:
    """(wall s, peak RSS bytes, CPU s incl. helper threads, fixed RSS bytes) of the measured run."""
    cmd = [py, "-c", WRAPPER, json.dumps([warm, real])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("BENCH")][-1].split()
    return float(line[1]), int(line[2]), float(line[3]), int(line[4])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=None, help="where to build the checkpoint (default: a temp dir)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tessera-ckpt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    try:
        t0 = time.perf_counter()
        ck = make_checkpoint(work / "ckpt", args.layers, args.hidden, args.ffn, args.vocab)
        payload = sum(p.stat().st_size for p in ck.iterdir() if p.is_file())
        from tessera.ckpt_convert.source import CheckpointSource

        src = CheckpointSource(ck)
        largest = max(s.nbytes for s in src.tensor_specs.values())
        model_bytes = sum(s.nbytes for s in src.tensor_specs.values())
        print(f"checkpoint: {payload / 2**30:.2f} GiB payload, {len(src.tensor_specs)} tensors, largest tensor "
              f"{largest / 2**20:.0f} MiB (built in {time.perf_counter() - t0:.0f}s)")

        tiny = make_checkpoint(work / "tiny", 2, 64, 128, 256).parent
        # The peer: cp -r of the same directory, three times (the median is reported; the box is shared).
        cp_runs = []
        for _ in range(3):
            before, t = os.times(), time.perf_counter()
            subprocess.run(["cp", "-r", str(ck), str(work / "cp_copy")], check=True)
            secs, after = time.perf_counter() - t, os.times()
            cp_runs.append((secs, (after.children_user + after.children_system)
                            - (before.children_user + before.children_system)))
            shutil.rmtree(work / "cp_copy")
        cp_s, cp_cpu = sorted(cp_runs)[1]
        print("cp -r runs (s): " + ", ".join(f"{r[0]:.2f}" for r in cp_runs))
        # The converters fsync what they write (the rename that publishes the output must not
        # precede the data); cp does not. Second peer: cp -r followed by sync of the copied files.
        sync_runs = []
        for _ in range(3):
            t = time.perf_counter()
            subprocess.run(["cp", "-r", str(ck), str(work / "cp_copy")], check=True)
            subprocess.run(["sync", *map(str, (work / "cp_copy").iterdir())], check=True)
            sync_runs.append(time.perf_counter() - t)
            shutil.rmtree(work / "cp_copy")
        cp_sync_s = sorted(sync_runs)[1]
        print("cp -r + sync runs (s): " + ", ".join(f"{r:.2f}" for r in sync_runs))

        def ops(src: Path, tag: str) -> dict[str, list[str]]:
            return {
                "reshard tp1pp1 -> tp2pp2": ["reshard", "--checkpoint", str(src), "--output", str(work / f"resharded{tag}"),
                                             "--tensor-parallel", "2", "--pipeline-parallel", "2"],
                "export hf (fp32, 1 file)": ["export", "--format", "hf", "--checkpoint", str(src),
                                             "--output", str(work / f"hf{tag}")],
                "import hf (fp32)": ["import", "--format", "hf", "--input", str(work / f"hf{tag}"), "--output",
                                     str(work / f"imported{tag}")],
                "export trtllm tp2 (fp32)": ["export", "--format", "trtllm", "--checkpoint", str(src),
                                             "--output", str(work / f"trt{tag}"), "--tensor-parallel", "2"],
            }

        warm, real = ops(tiny, "-tiny"), ops(work / "ckpt", "")
        results = {name: timed(py, warm[name] + ["--quiet"], real[name] + ["--quiet"]) for name in real}
        print(f"model {model_bytes / 2**20:.0f} MiB; largest tensor {largest / 2**20:.0f} MiB")
        rows = ["| operation | wall s | GiB/s | vs cp | vs cp+sync | CPU s | peak RSS MiB | fixed (tiny model) MiB "
                "| RSS - fixed | (RSS - fixed) / largest tensor |",
                "|---|---|---|---|---|---|---|---|---|---|",
                f"| cp -r (peer) | {cp_s:.2f} | {payload / cp_s / 2**30:.2f} | 1.00x | - | {cp_cpu:.2f} | - | - | - | - |",
                f"| cp -r + sync (peer) | {cp_sync_s:.2f} | {payload / cp_sync_s / 2**30:.2f} | - | 1.00x | - | - | - | - | - |"]
        for name, (secs, rss, cpu, base) in results.items():
            rows.append(f"| {name} | {secs:.2f} | {payload / secs / 2**30:.2f} | {cp_s / secs:.2f}x | "
                        f"{cp_sync_s / secs:.2f}x | {cpu:.2f} | "
                        f"{rss / 2**20:.0f} | {base / 2**20:.0f} | {(rss - base) / 2**20:.0f} MiB | "
                        f"{(rss - base) / largest:.1f}x |")
        print("\n".join(rows))
        print(json.dumps({"payload_bytes": payload, "model_bytes": model_bytes, "largest_tensor_bytes": largest,
                          "cp_seconds": cp_s, "cp_cpu_seconds": cp_cpu, "cp_sync_seconds": cp_sync_s,
                          "results": {k: {"seconds": v[0], "peak_rss": v[1], "cpu_seconds": v[2], "fixed_rss": v[3]}
                                      for k, v in results.items()}}))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
