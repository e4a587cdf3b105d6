"""Tensor-parallel decode steps three ways, on the same weights, prompts and workers' threads:
- `full batch`: every decode step sent to the workers as its sequences (tokens, positions, whole
  block tables) and packed by each worker from scratch (the path before the persistent batch, still
  taken by prefill chunks);
- `decode updates`: the driver plans the step's update to the persistent decode batch each worker
  keeps (batch.DecodeUpdate: a token and a position per sequence, a table entry where one entered a
  new block) and sends only that;
- `async`: the same with --async-scheduling: each step sent with the tokens of the one before while
  the driver applies that one (tensor_parallel/runner.py).
The engines alternate which runs first each round and must give the same tokens (engine_race.py).
The model is small (`--hidden`, `--layers`) and the contexts long (`--prompt-len`), so a step is
mostly what a GPU's forward would leave to the host. Prints the median engine step's wall time,
the driver's CPU per step (medians), and the bytes sent per decode step.

    .venv/bin/python benchmarks/tp_decode.py                  # 64 sequences at 512+ tokens, TP2
    .venv/bin/python benchmarks/tp_decode.py --smoke          # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_race import checked_race  # noqa: E402
from tp_logits import tp_arguments, tp_workload  # noqa: E402

NAMES = ("full batch", "decode updates", "async")


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    tp_arguments(ap, vocab=4096, prompt_len=512, max_tokens=48)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    if args.smoke:
        args.vocab, args.num_prompts, args.prompt_len, args.max_tokens, args.rounds = 2048, 8, 40, 6, 1
    torch.set_num_threads(args.threads)

    from tessera.inference.config import EngineConfig
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.cpu_threads import Binding
    from tessera.inference.worker.loader import load_for_serving

    ckpt, prompts = tp_workload(args, "tessera-tp-decode-", args.prompt_len + args.max_tokens + 16)
    cpu = torch.device("cpu")
    workers = (Binding(args.threads),) * args.tensor_parallel
    engines, steps, cpu_s, walls, sent, decode_steps, worker_cpu = {}, {}, {}, {}, {}, {}, {}
    try:
        for name in NAMES:
            cfg = EngineConfig(max_num_seqs=args.num_prompts, max_num_batched_tokens=max(2048, args.num_prompts),
                               tensor_parallel=args.tensor_parallel, block_size=args.block_size,
                               kv_cache_tokens=args.num_prompts * (args.prompt_len + args.max_tokens + args.block_size),
                               dtype="float32", device="cpu", enforce_eager=True, async_scheduling=name == "async")
            loaded = load_for_serving(str(ckpt), cpu, torch.float32, tensor_parallel=args.tensor_parallel)
            engines[name] = engine = LLMEngine(loaded, cfg, cpu, torch.float32, worker_threads=workers)
            executor = engine.runner.executor
            assert executor.decode_batch, "the workers' runner keeps the persistent decode batch"
            if name == "full batch":
                executor.decode_batch = False  # every decode step as its sequences, as before
            steps[name] = decode_steps[name] = sent[name] = 0
            cpu_s[name], walls[name] = [], []

            def counted(step=engine.step, name=name):
                start, cpu0 = time.perf_counter(), time.process_time()
                try:
                    return step()
                finally:
                    cpu_s[name].append(time.process_time() - cpu0)
                    walls[name].append(time.perf_counter() - start)
                    steps[name] += 1

            def timed_run(on_output=None, run=engine.run_to_completion, name=name, procs=executor.procs):
                before = sum(process_cpu(p.pid) for p in procs)
                try:
                    return run(on_output)
                finally:
                    worker_cpu[name] += sum(process_cpu(p.pid) for p in procs) - before

            def watched(frame: bytes, reply: bool = False, send=executor._send, name=name):
                if reply and (frame.startswith(b'{"t": "decode"')
                              or all(seq[3] == 1 for seq in json.loads(frame)["seqs"])):  # num_q 1: decode rows
                    decode_steps[name] += 1
                    sent[name] += len(frame)
                return send(frame, reply)

            engine.step = counted
            engine.run_to_completion = timed_run
            worker_cpu[name] = 0.0
            executor._send = watched
        raced = checked_race("tp_decode", engines, prompts, args.max_tokens, args.rounds, same=NAMES[:2])
        if raced is not None and raced[1][NAMES[2]] != raced[1][NAMES[1]]:
            print("tp_decode: async and decode updates gave different tokens", file=sys.stderr)
            raced = None
    finally:
        for engine in engines.values():
            engine.close()
    if raced is None:
        return 1
    secs, _ = raced
    print(f"TP{args.tensor_parallel}, {args.num_prompts} sequences, prompts {args.prompt_len} + {args.max_tokens} "
          f"tokens, blocks of {args.block_size}, vocab {args.vocab}, d={args.hidden}, {args.layers} layer(s), fp32, "
          f"{args.threads} torch thread(s) per process, {args.rounds} rounds")
    per_step = {}
    for name in NAMES:
        # The median engine step is a decode step (prefill chunks are about a quarter of the steps);
        # with async scheduling a step's wall time is the host's work plus its wait for the workers.
        per_step[name] = statistics.median(walls[name]) * 1e3
        rounds = " ".join(f"{x:.2f}" for x in secs[name])
        print(f"  {name:>14}: median step {per_step[name]:.2f} ms, driver CPU {statistics.median(cpu_s[name]) * 1e3:.2f} "
              f"ms, workers' CPU {worker_cpu[name] / steps[name] * 1e3:.2f} ms (mean) per step (rounds {rounds} s, "
              f"{steps[name] // args.rounds} steps each); "
              f"{sent[name] / max(1, decode_steps[name]) / 1e3:.1f} kB sent per decode step")
    base = per_step[NAMES[0]]
    print(f"  median step, full batch / decode updates: {base / per_step[NAMES[1]]:.2f}x; full batch / async: "
          f"{base / per_step[NAMES[2]]:.2f}x; outputs token for token the same")
    return 0


if __name__ == "__main__":
    sys.exit(main())
