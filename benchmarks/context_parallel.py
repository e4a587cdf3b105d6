"""Context parallel at a long sequence on CPU: CP2 (two gloo ranks) against one process.

    .venv/bin/python benchmarks/context_parallel.py [--seq 4096] [--steps 3] [--out FILE.json]

Both sides run Tessera's parallel runtime (the one process is the same runtime at layout 1, so
the ratio isolates the context split): the same model, the same global batch (one sequence of
`--seq` tokens per micro-batch), fp32, one thread per rank. Reported per side:

    tokens/s      global tokens of a step / step time (the first step is not timed)
    act MiB       per-rank bytes saved for backward in one micro-batch (saved-tensor hooks,
                  distinct storages, parameters excluded): the activation memory CP divides
    peak RSS MiB  the process's peak RSS growth over the run (weights, optimizer, gathered K/V)

and the ratios CP2 / one process. Expected: activations ~1/2 per rank (each rank holds T/2 of
the sequence; attention all-gathers keys/values, so K/V and the local score rows are the part
that does not halve), tokens/s at most ~2x (two cores, plus the K/V all-gather).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from parallel_scaling import SavedBytes, peak_rss_mb, rss_mb  # noqa: E402

MODEL = dict(arch="llama", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
             ffn_hidden_size=688)
GLOBAL_BATCH = 2  # sequences per step: two micro-batches of one


def batch(step: int, vocab: int, seq: int):
    import torch

    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, vocab, (GLOBAL_BATCH, seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def worker(spec_path: str) -> None:
    """One side (world 1 or 2 under torchrun): time steps, then count one step's saved bytes."""
    import torch
    import torch.distributed as dist

    from tessera.common.layout import ParallelLayout
    from tessera.common.models.causal_lm.config import ModelConfig
    from tessera.common.models.causal_lm.model import Transformer
    from tessera.common.parallel.state import build_groups, init_distributed
    from tessera.trainer.config import OptimConfig, ParallelConfig, TrainingConfig
    from tessera.trainer.parallel.runtime import ParallelRuntime

    torch.set_num_threads(1)
    spec = json.load(open(spec_path))
    seq, steps = spec["seq"], spec["steps"]
    init_distributed()
    base = rss_mb()
    cfg = ModelConfig(**MODEL, max_seq_len=seq)
    layout = ParallelLayout(context=dist.get_world_size())
    groups = build_groups(layout)

    def builder():
        with torch.device("meta"):
            return Transformer(cfg)

    training = TrainingConfig(seq_length=seq, global_batch_size=GLOBAL_BATCH, micro_batch_size=1, seed=0)
    rt = ParallelRuntime.build(cfg, groups, training, ParallelConfig(context=layout.context), OptimConfig(lr=1e-4),
                               builder)
    t0 = 0.0
    for step in range(steps):
        tokens, targets = batch(step, cfg.vocab_size, seq)
        dist.barrier()
        if step == 1:
            t0 = time.perf_counter()
        rt.train_step(tokens, targets)
    dist.barrier()
    step_s = (time.perf_counter() - t0) / max(1, steps - 1)
    rss = peak_rss_mb() - base
    tokens, targets = batch(steps, cfg.vocab_size, seq)
    with SavedBytes([p for st in rt.stages for p in st.parameters()]) as sb:
        rt.train_step(tokens, targets)
    mine = dict(act=sb.bytes // rt.num_microbatches, rss=rss, step_s=step_s,
                tokens_per_s=GLOBAL_BATCH * seq / step_s)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        json.dump(gathered, open(spec["out"], "w"))
    dist.destroy_process_group()


def launch(world: int, seq: int, steps: int, tmp: str) -> list[dict]:
    spec, out = os.path.join(tmp, f"spec{world}.json"), os.path.join(tmp, f"out{world}.json")
    json.dump(dict(seq=seq, steps=steps, out=out), open(spec, "w"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                    __file__, "--worker", spec], check=True, env=env, stdout=subprocess.DEVNULL)
    return json.load(open(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096, help="Tokens per sequence (a multiple of 4: 2 x CP chunks).")
    ap.add_argument("--steps", type=int, default=3, help="Steps per side (the first is not timed).")
    ap.add_argument("--out", default=None, help="Also write the raw figures as JSON here.")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    if args.seq % 4:
        ap.error(f"--seq {args.seq}: CP2 splits the sequence into 4 chunks; use a multiple of 4")
    with tempfile.TemporaryDirectory() as tmp:
        one, cp2 = launch(1, args.seq, args.steps, tmp), launch(2, args.seq, args.steps, tmp)
    print(f"model: {MODEL}\nseq {args.seq}, global batch {GLOBAL_BATCH} (micro batch 1), fp32, gloo/CPU, "
          "1 thread per rank\n")
    print("| layout | ranks | tokens/s | activations MiB/micro-batch (worst rank) | peak RSS growth MiB | step s |")
    print("|---|---|---|---|---|---|")
    rows = []
    for name, ranks in (("one process", one), ("cp2", cp2)):
        worst = {k: max(r[k] for r in ranks) for k in ("act", "rss", "step_s")}
        tps = ranks[0]["tokens_per_s"]
        rows.append(dict(name=name, ranks=ranks, tokens_per_s=tps, **{f"worst_{k}": v for k, v in worst.items()}))
        print(f"| {name} | {len(ranks)} | {tps:.0f} | {worst['act'] / 2**20:.2f} | {worst['rss']:.0f} | "
              f"{worst['step_s']:.3f} |")
    print(f"\ncp2 / one process: tokens/s x{rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}, "
          f"per-rank activations x{rows[1]['worst_act'] / rows[0]['worst_act']:.2f}")
    if args.out:
        json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
