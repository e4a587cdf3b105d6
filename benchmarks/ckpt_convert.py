"""Throughput and peak memory of tessera-ckpt reshard / export / import on a >= 1 GB checkpoint.

Builds a random Llama checkpoint (default: d=2048, ffn=8192, 6 layers, vocab 16000, untied, fp32:
~1.9 GB, largest tensor 128 MiB), then runs each conversion in a fresh process and reports wall
time, throughput (payload bytes / s), CPU time, peak RSS and, as the peers, `cp -r` of the same
checkpoint directory and `cp -r` followed by `sync` of the copies. Each converter runs in two
modes per rep: durable (the default: every output file fsynced before the rename that publishes
it), whose like-for-like peer is `cp -r + sync`, and `--no-sync` (no fsync, as cp), whose peer is
`cp -r`. Peak memory is compared with
the model size and the largest tensor: the target is "largest tensor x small constant + fixed
overhead", not the model size; throughput target >= 0.5x cp.

    .venv/bin/python benchmarks/ckpt_convert.py [--workdir DIR] [--layers 6] [--reps 3] [--keep] [--ab-writeback]
        [--modes durable,no-sync] [--only reshard,...]

Every timed run, peer or converter, starts from the same clean state: the previous run's output
is deleted, `sync` flushes every dirty page (so no run pays for its predecessor's writeback) and
the machine settles for --settle seconds. The runs alternate (cp, cp+sync, each converter; then
again, --reps times) and the median of each is reported. The input's page cache is warm for all.
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
# import and one-time allocation happens there; its peak RSS is the fixed overhead), then sync +
# settle, then the measured run. Peak RSS is VmHWM of this process (ru_maxrss would include the
# parent's peak, which survives fork + exec on Linux).
WRAPPER = r"""
import json, os, sys, time
from tessera.ckpt_convert.cli import run
def hwm():
    return int([ln for ln in open("/proc/self/status") if ln.startswith("VmHWM")][0].split()[1]) * 1024
warm, real, settle, no_writeback = json.loads(sys.argv[1])
if no_writeback:  # A/B: the converters as they were before early writeback (mapped.early_writeback)
    import tessera.ckpt_convert.mapped as mapped
    mapped.WRITEBACK_STEP = 1 << 62
run(warm)
fixed = hwm()
os.sync()  # start from a clean state: nothing dirty left by the warm-up or an earlier run
time.sleep(settle)
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
    from tessera.common.models.causal_lm.config import ModelConfig
    from tessera.common.models.causal_lm.model import build_model

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


def clean_state(settle: float) -> None:
    """No dirty pages left by an earlier run, then a pause, before every timed run."""
    os.sync()
    time.sleep(settle)


def timed(py: str, warm: list[str], real: list[str], settle: float,
          no_writeback: bool = False) -> tuple[float, int, float, int]:
    """(wall s, peak RSS bytes, CPU s incl. helper threads, fixed RSS bytes) of the measured run."""
    cmd = [py, "-c", WRAPPER, json.dumps([warm, real, settle, no_writeback])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("BENCH")][-1].split()
    return float(line[1]), int(line[2]), float(line[3]), int(line[4])


def cp_run(src: Path, dst: Path, sync: bool, settle: float) -> tuple[float, float]:
    """(wall s, CPU s) of `cp -r src dst` [+ `sync` of the copied files], from a clean state."""
    clean_state(settle)
    before, t = os.times(), time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    if sync:
        subprocess.run(["sync", *map(str, dst.iterdir())], check=True)
    secs, after = time.perf_counter() - t, os.times()
    shutil.rmtree(dst)
    return secs, (after.children_user + after.children_system) - (before.children_user + before.children_system)


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=None, help="where to build the checkpoint (default: a temp dir)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--reps", type=int, default=3, help="timed runs of each peer and operation (median reported)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds to wait after sync before each timed run")
    ap.add_argument("--only", default=None, help="comma-separated operation names to run (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--modes", default="durable,no-sync",
                    help="converter modes: durable (the default output; peer cp -r + sync) and no-sync "
                         "(--no-sync; peer cp -r), comma-separated (default both)")
    ap.add_argument("--ab-writeback", action="store_true",
                    help="also run each operation with early writeback off (alternating), for a before/after")
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

        def ops(src: Path, tag: str) -> dict[str, list[str]]:
            return {
                "reshard tp1pp1 -> tp2pp2": ["reshard", "--checkpoint", str(src), "--output", str(work / f"resharded{tag}"),
                                             "--tensor-parallel", "2", "--pipeline-parallel", "2"],
                "export hf (fp32, 1 file)": ["export", "--format", "hf", "--checkpoint", str(src),
                                             "--output", str(work / f"hf{tag}")],
                "import hf (fp32)": ["import", "--format", "hf", "--input", str(work / "hf-input"), "--output",
                                     str(work / f"imported{tag}")],
                "export trtllm tp2 (fp32)": ["export", "--format", "trtllm", "--checkpoint", str(src),
                                             "--output", str(work / f"trt{tag}"), "--tensor-parallel", "2"],
            }

        # import's input: an HF export of the same checkpoint (made once, untimed).
        from tessera.ckpt_convert.cli import run as ckpt_cli

        ckpt_cli(["export", "--format", "hf", "--checkpoint", str(ck), "--output", str(work / "hf-input"), "--quiet"])
        ckpt_cli(["export", "--format", "hf", "--checkpoint", str(tiny), "--output", str(work / "hf-input-tiny"),
                  "--quiet"])
        warm, real = ops(tiny, "-tiny"), ops(work / "ckpt", "")
        warm["import hf (fp32)"][4] = str(work / "hf-input-tiny")
        names = [n for n in real if args.only is None or any(o.strip() in n for o in args.only.split(","))]
        off = " [no early writeback]"
        if args.ab_writeback:
            for n in list(names):
                warm[n + off], real[n + off] = warm[n], real[n]
            names = [m for n in names for m in (n + off, n)]
        modes = {m.strip() for m in args.modes.split(",")}
        if not modes or not modes <= {"durable", "no-sync"}:
            sys.exit(f"--modes {args.modes!r}: choose from durable, no-sync")
        nosync = " --no-sync"
        for n in list(names):
            if not n.endswith(off):  # --no-sync has no early writeback to A/B
                warm[n + nosync], real[n + nosync] = warm[n] + ["--no-sync"], real[n] + ["--no-sync"]
        names = [m for n in names for m in ([n] if "durable" in modes else [])
                 + ([n + nosync] if "no-sync" in modes and not n.endswith(off) else [])]
        cp_runs: list[tuple[float, float]] = []
        sync_runs: list[float] = []
        runs: dict[str, list[tuple[float, int, float, int]]] = {n: [] for n in names}
        for rep in range(args.reps):
            # Alternate peers and subjects, each from a clean state; delete every output afterwards.
            cp_runs.append(cp_run(ck, work / "cp_copy", False, args.settle))
            sync_runs.append(cp_run(ck, work / "cp_copy", True, args.settle)[0])
            for name in names:
                runs[name].append(timed(py, warm[name] + ["--quiet"], real[name] + ["--quiet"], args.settle,
                                        name.endswith(off)))
                shutil.rmtree(Path(real[name][real[name].index("--output") + 1]))
                shutil.rmtree(Path(warm[name][warm[name].index("--output") + 1]))
            print(f"rep {rep + 1}: cp {cp_runs[-1][0]:.2f}s, cp+sync {sync_runs[-1]:.2f}s, "
                  + ", ".join(f"{n.removesuffix(nosync).split(' (')[0]}{'[off]' if n.endswith(off) else ''}"
                              f"{'[no-sync]' if n.endswith(nosync) else ''} {runs[n][-1][0]:.2f}s" for n in names),
                  flush=True)
        cp_s = median([r[0] for r in cp_runs])
        cp_cpu = median([r[1] for r in cp_runs])
        cp_sync_s = median(sync_runs)
        print(f"model {model_bytes / 2**20:.0f} MiB; largest tensor {largest / 2**20:.0f} MiB")
        rows = ["| operation | wall s (runs) | GiB/s | vs its peer | vs cp | vs cp+sync | CPU s | peak RSS MiB "
                "| fixed (tiny model) MiB | RSS - fixed | (RSS - fixed) / largest tensor |",
                "|---|---|---|---|---|---|---|---|---|---|---|",
                f"| cp -r (peer of --no-sync) | {cp_s:.2f} ({', '.join(f'{r[0]:.2f}' for r in cp_runs)}) | "
                f"{payload / cp_s / 2**30:.2f} | - | 1.00x | - | {cp_cpu:.2f} | - | - | - | - |",
                f"| cp -r + sync (peer of durable) | {cp_sync_s:.2f} ({', '.join(f'{r:.2f}' for r in sync_runs)}) | "
                f"{payload / cp_sync_s / 2**30:.2f} | - | - | 1.00x | - | - | - | - | - |"]
        summary = {}
        for name, rs in runs.items():
            secs = median([r[0] for r in rs])
            cpu = median([r[2] for r in rs])
            rss, base = max(r[1] for r in rs), max(r[3] for r in rs)  # the worst run's memory
            peer = cp_s if name.endswith(nosync) else cp_sync_s  # like for like: durable or not
            summary[name] = {"seconds": secs, "runs": [r[0] for r in rs], "peak_rss": rss, "cpu_seconds": cpu,
                             "cpu_runs": [r[2] for r in rs], "fixed_rss": base, "vs_peer": peer / secs}
            rows.append(f"| {name} | {secs:.2f} ({', '.join(f'{r[0]:.2f}' for r in rs)}) | "
                        f"{payload / secs / 2**30:.2f} | **{peer / secs:.2f}x** | {cp_s / secs:.2f}x | "
                        f"{cp_sync_s / secs:.2f}x | {cpu:.2f} | "
                        f"{rss / 2**20:.0f} | {base / 2**20:.0f} | {(rss - base) / 2**20:.0f} MiB | "
                        f"{(rss - base) / largest:.1f}x |")
        print("\n".join(rows))
        print(json.dumps({"payload_bytes": payload, "model_bytes": model_bytes, "largest_tensor_bytes": largest,
                          "cp_seconds": cp_s, "cp_runs": [r[0] for r in cp_runs], "cp_cpu_seconds": cp_cpu,
                          "cp_sync_seconds": cp_sync_s, "cp_sync_runs": sync_runs, "results": summary}))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
