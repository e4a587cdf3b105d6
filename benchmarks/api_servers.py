"""CPU of each process of `tessera-serve --api-server-count N` under a streamed workload: the launcher,
each HTTP process and the engine process, from /proc, for N = 1 and N (alternating rounds).

The workload and model are serving_profile.py's `--server-only --preset host-bound` ones (one
64-wide layer, so the HTTP side's share is large; streamed completions with usage; the same seeded
prompts), and the server runs with its flags. What it shows on a machine of few cores: how the
HTTP work splits over the processes, and that the engine process's CPU per token is unchanged
(its steps are the same; only its outputs are routed per pipe). A speed-up needs cores to spare
(a GPU machine); on 2 cores the client, the engine and the HTTP processes share them.

    flock /tmp/bench.lock python benchmarks/api_servers.py --api-server-count 2 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from serving import build_checkpoint, free_port, run_client, wait_healthy
from serving_profile import cpu_seconds


def _processes(server: subprocess.Popen) -> dict[str, int]:
    """name -> pid: the launcher (or, with one process, the HTTP process), each HTTP child, the engine."""
    out: dict[str, int] = {}
    http = 0
    for child in sorted(psutil.Process(server.pid).children(), key=lambda p: p.pid):
        line = " ".join(child.cmdline())
        if "core_process" in line:
            out["engine process"] = child.pid
        elif "entrypoints.api_servers" in line:
            out[f"HTTP process {http}"] = child.pid
            http += 1
    out["HTTP process" if not http else "launcher"] = server.pid
    return out


def _steps(url: str) -> tuple[float, float]:
    """(engine steps, tokens they computed) so far, from /metrics (vllm:iteration_tokens_total)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    count = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("vllm:iteration_tokens_total_count"))
    total = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("vllm:iteration_tokens_total_sum"))
    return count, total


def one_round(ckpt: Path, n: int, args, workload) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "tessera.inference", "--checkpoint", str(ckpt), "--port", str(port), "--quiet",
           "--max-num-seqs", str(args.concurrency), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--kv-cache-tokens", "65536", "--torch-threads", str(args.threads), "--device", "cpu", "--dtype", "float32",
           "--api-server-count", str(n)]
    server = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, 300, "tessera-serve")
        time.sleep(1.0)  # every HTTP process listening (health answers as soon as one does)
        asyncio.run(run_client(url, workload[:8], 8))  # warm every process's first requests
        pids = _processes(server)
        steps0 = _steps(url)
        before = {k: cpu_seconds(p) for k, p in pids.items()}
        res = asyncio.run(run_client(url, workload, args.concurrency))
        after = {k: cpu_seconds(p) for k, p in pids.items()}
        steps1 = _steps(url)
    finally:
        server.terminate()
        server.wait(timeout=120)
    tokens = res["output_tok_per_s"] * res["duration"]
    per64 = {k: 1e3 * sum(after[k]) - 1e3 * sum(before[k]) for k in pids}
    steps, step_tokens = steps1[0] - steps0[0], steps1[1] - steps0[1]
    return {"tok_s": res["output_tok_per_s"], "tpot": 1e3 * statistics.median(res["tpot"]),
            "steps": steps, "per_step": step_tokens / steps, "engine_ms_per_step": 1e3 * (
                sum(after["engine process"]) - sum(before["engine process"])) / steps,
            "ms_per_64": {k: v / tokens * 64 for k, v in per64.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--api-server-count", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 64])
    ap.add_argument("--output-len", type=int, nargs=2, default=[64, 64])
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from tessera.common.models.causal_lm.config import ModelConfig

    root = Path(tempfile.mkdtemp(prefix="tessera-asc-")) / "run"
    ckpt, model = build_checkpoint(root, "host-bound", lambda vocab: ModelConfig(
        arch="llama", vocab_size=vocab, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
        ffn_hidden_size=128, max_seq_len=1024))
    rng = random.Random(args.seed)
    vocab = model.cfg.vocab_size
    workload = [([rng.randrange(1, vocab) for _ in range(rng.randint(*args.input_len))], rng.randint(*args.output_len))
                for _ in range(args.num_requests)]
    print(f"host-bound, {args.num_requests} requests, concurrency {args.concurrency}; "
          f"CPU ms per 64 output tokens by process (from /proc)")
    for r in range(args.rounds):
        for n in ((1, args.api_server_count) if r % 2 == 0 else (args.api_server_count, 1)):
            got = one_round(ckpt, n, args, workload)
            split = ", ".join(f"{k} {v:.2f}" for k, v in got["ms_per_64"].items())
            http = sum(v for k, v in got["ms_per_64"].items() if k.startswith("HTTP"))
            print(f"round {r} N={n}: {got['tok_s']:.0f} output tok/s, TPOT p50 {got['tpot']:.1f} ms; "
                  f"{got['steps']:.0f} engine steps of {got['per_step']:.1f} tokens, engine CPU "
                  f"{got['engine_ms_per_step']:.2f} ms per step; HTTP processes together {http:.2f}; {split}",
                  flush=True)


if __name__ == "__main__":
    main()
