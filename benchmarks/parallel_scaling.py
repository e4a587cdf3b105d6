"""Per-rank memory of one fixed model under each parallel layout (CPU/gloo), against one process.

    .venv/bin/python benchmarks/parallel_scaling.py [--steps 2] [--out FILE.json]

For each layout, torchrun starts the ranks; each builds the model with Tessera's parallel
runtime, trains a few steps and reports exactly counted bytes of

    params     parameters held by the rank
    grads      gradient buffers
    optim      optimizer state: fp32 master shard (when separate) + Adam exp_avg + exp_avg_sq
    act/mb     tensors saved for backward per micro-batch (saved-tensor hooks, de-duplicated)

plus the process's peak RSS above its RSS before the model was built, and the step time. The
peer, in the same run, is the single-process plain model with torch.optim.AdamW (what the
parity tests compare against). Expected: weights/grads ~1/TP and ~1/PP, optimizer state ~1/DP
with the distributed optimizer, activations ~1/TP with sequence parallel, and params + grads +
optimizer ~1/N under FSDP data_shard=N (counted from the local shards; the gathered parameters
of the block being computed are transient and show only in the peak RSS). A last table checks
issue 17's acceptance on those bytes: for data_shard N = 2 and 4 (and HSDP's N = 2), the worst
rank's weights + grads + optimizer state within 15% of 1/N of the single-process figure.

    .venv/bin/python benchmarks/parallel_scaling.py --overlap [--bucket-numel 1000000,4000000,40000000]

runs instead the communication-overlap sweep (docs/parallelism.md, "Overlapping communication"):
data parallel 2 with the distributed optimizer, for each bucket size, with neither overlap, with
the gradient reductions launched from backward hooks, and with the parameter all-gathers
overlapped with the next forward too; the step time column is the figure to read. On CPU/gloo it
is a smoke run (two cores shared by both ranks' compute and gloo's threads); the speed is for a
multi-GPU NCCL session.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

MODEL = dict(arch="llama", vocab_size=4096, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
             ffn_hidden_size=688, max_seq_len=128)
SEQ, GLOBAL_BATCH, MICRO = 128, 8, 2

LAYOUTS = [  # (name, layout, parallel overrides)
    ("dp2 (all-reduce)", dict(data=2), dict(distributed_optimizer=False)),
    ("dp2 (distributed optimizer)", dict(data=2), {}),
    ("tp2", dict(tensor=2), dict(sequence_parallel=False)),
    ("tp2 + sp", dict(tensor=2), {}),
    ("pp2", dict(pipeline=2), {}),
    ("dp4 (distributed optimizer)", dict(data=4), {}),
    ("tp4 + sp", dict(tensor=4), {}),
    ("pp4", dict(pipeline=4), {}),
    ("tp2 pp2", dict(tensor=2, pipeline=2), {}),
    # Fully sharded (FSDP2): params, grads and Adam state ~1/data_shard of the unsharded figures
    # (acceptance: within 15% of 1/N), built on the meta device (sharded initialisation).
    ("fsdp2", dict(data=2, data_shard=2), {}),
    ("fsdp4", dict(data=4, data_shard=4), {}),
    ("hsdp 2x2", dict(data=4, data_shard=2), {}),
    ("fsdp2 tp2", dict(data=2, data_shard=2, tensor=2), {}),
]


OVERLAP_MODES = [  # (label, parallel section overrides)
    ("no overlap", dict(overlap_grad_reduce=False, overlap_param_gather=False)),
    ("grad overlap", dict(overlap_grad_reduce=True, overlap_param_gather=False)),
    ("grad + param overlap", dict(overlap_grad_reduce=True, overlap_param_gather=True)),
]


def overlap_layouts(bucket_sizes: list[int]) -> list:
    return [(f"dp2 zero, bucket {n:,}, {label}", dict(data=2), dict(bucket_numel=n, **mode))
            for n in bucket_sizes for label, mode in OVERLAP_MODES]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class SavedBytes:
    """Counts bytes of distinct storages saved for backward (exact activation memory)."""

    def __init__(self, params):
        import torch

        # Views of parameters (a transposed weight, a slice of a flat bucket) are not activations.
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.seen: set[int] = set()
        self.keep: list = []  # holding the storages stops address reuse from hiding new ones
        self.bytes = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)

    def _pack(self, t):
        import torch

        if isinstance(t, torch.nn.Parameter) or t.requires_grad and t.is_leaf:
            return t  # parameters are counted as parameters
        st = t.untyped_storage()
        if st.data_ptr() not in self.seen and st.data_ptr() not in self.param_storages:
            self.seen.add(st.data_ptr())
            self.keep.append(st)
            self.bytes += st.nbytes()
        return t

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def batch(step: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def peer(steps: int) -> dict:
    """Single process: plain model + torch AdamW."""
    import torch
    import torch.nn.functional as F

    from tessera.common.models.causal_lm.config import ModelConfig
    from tessera.common.models.causal_lm.model import build_model

    torch.set_num_threads(1)
    base = rss_mb()
    cfg = ModelConfig(**MODEL)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_micro = GLOBAL_BATCH // MICRO

    def train_step(step: int, sb: SavedBytes | None = None) -> None:
        tokens, targets = batch(step, cfg.vocab_size)
        opt.zero_grad()
        for i in range(n_micro):
            rows = slice(i * MICRO, (i + 1) * MICRO)
            if sb is not None:
                with sb:
                    loss = F.cross_entropy(model(tokens[rows]).flatten(0, 1), targets[rows].flatten()) / n_micro
            else:
                loss = F.cross_entropy(model(tokens[rows]).flatten(0, 1), targets[rows].flatten()) / n_micro
            loss.backward()
        opt.step()

    t0 = 0.0
    for step in range(steps):
        if step == 1:
            t0 = time.perf_counter()
        train_step(step)
    step_s = (time.perf_counter() - t0) / max(1, steps - 1)
    rss = peak_rss_mb() - base
    sb = SavedBytes(list(model.parameters()))
    train_step(steps, sb)
    act = sb.bytes // n_micro
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    optim = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if t.ndim > 0)
    return dict(name="single process (peer: plain model + torch AdamW)", ranks=[dict(
        params=params, grads=params, optim=optim, act=act, rss=rss, step_s=step_s)])


def worker(spec_path: str) -> None:
    import torch
    import torch.distributed as dist

    from tessera.common.layout import ParallelLayout
    from tessera.common.models.causal_lm.config import ModelConfig
    from tessera.common.models.causal_lm.model import Transformer, build_model
    from tessera.common.parallel.state import build_groups, init_distributed
    from tessera.trainer.config import OptimConfig, ParallelConfig, TrainingConfig
    from tessera.trainer.parallel.runtime import ParallelRuntime

    torch.set_num_threads(1)
    spec = json.load(open(spec_path))
    init_distributed()
    results = []
    cfg = ModelConfig(**MODEL)
    for name, layout_kw, pkw in spec["layouts"]:
        base = rss_mb()
        layout = ParallelLayout(**layout_kw)
        groups = build_groups(layout)
        fsdp = layout_kw.get("data_shard", 1) > 1
        # A meta build (FSDP) is initialised from training.seed: 0, build_model's seed below.
        training = TrainingConfig(seq_length=SEQ, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO,
                                  **({"seed": 0} if fsdp else {}))
        parallel = ParallelConfig(**layout.model_dump(exclude={"data"}), **pkw)

        def builder(fsdp: bool = fsdp):
            if fsdp:  # only this rank's shards are allocated (same weights as build_model, seed 0)
                with torch.device("meta"):
                    return Transformer(cfg)
            return build_model(cfg, seed=0)

        rt = ParallelRuntime.build(cfg, groups, training, parallel, OptimConfig(lr=1e-4), builder)
        rows = GLOBAL_BATCH // groups.dp
        sl = slice(groups.dp_rank * rows, (groups.dp_rank + 1) * rows)
        t0 = 0.0
        for step in range(spec["steps"]):
            tokens, targets = batch(step, cfg.vocab_size)
            dist.barrier()
            if step == 1:
                t0 = time.perf_counter()
            rt.train_step(tokens[sl], targets[sl])
        dist.barrier()
        step_s = (time.perf_counter() - t0) / max(1, spec["steps"] - 1)
        rss = peak_rss_mb() - base
        tokens, targets = batch(spec["steps"], cfg.vocab_size)
        with SavedBytes([p.to_local() if fsdp else p for st in rt.stages for p in st.parameters()]) as sb:
            rt.train_step(tokens[sl], targets[sl])
        # Per micro-batch and per chunk held by this rank.
        act = sb.bytes // rt.num_microbatches
        if fsdp:  # sharded DTensors: count the local pieces
            local = [p.to_local() for s in rt.stages for p in s.parameters()]
            params = sum(t.numel() * t.element_size() for t in local)
            grads = sum(p.grad.to_local().numel() * p.grad.element_size() for s in rt.stages for p in s.parameters()
                        if p.grad is not None)
            optim = sum(t.to_local().numel() * t.element_size() for st in rt.optimizer.inner.state.values()
                        for t in st.values() if t.ndim > 0)
            mine = dict(params=params, grads=grads, optim=optim, act=act, rss=rss, step_s=step_s)
            gathered = [None] * groups.world_size
            dist.all_gather_object(gathered, mine)
            if groups.rank == 0:
                results.append(dict(name=name, layout=layout_kw, ranks=gathered))
            del rt
            continue
        params = sum(p.numel() * p.element_size() for s in rt.stages for p in s.parameters())
        buckets = rt.optimizer.buckets.buckets
        grads = sum(b.grad_buf.numel() * b.grad_buf.element_size() for b in buckets)
        grads += sum(b.grad_shard.numel() * b.grad_shard.element_size() for b in buckets
                     if b.grad_shard.untyped_storage().data_ptr() != b.grad_buf.untyped_storage().data_ptr())
        optim = sum(t.numel() * t.element_size() for st in rt.optimizer.inner.state.values()
                    for t in st.values() if t.ndim > 0)
        # Master weights count only where they are a separate copy (not for fp32 parameters).
        optim += sum(m.numel() * m.element_size() for m, b in zip(rt.optimizer.masters, buckets)
                     if m.data_ptr() != b.param_shard(b.rank).data_ptr())
        mine = dict(params=params, grads=grads, optim=optim, act=act, rss=rss, step_s=step_s)
        gathered = [None] * groups.world_size
        dist.all_gather_object(gathered, mine)
        if groups.rank == 0:
            results.append(dict(name=name, layout=layout_kw, ranks=gathered))
        rt.optimizer.buckets.remove_hooks()
        del rt
    if dist.get_rank() == 0:
        json.dump(results, open(spec["out"], "w"))
    dist.destroy_process_group()


def launch(world: int, layouts: list, steps: int, tmp: str) -> list[dict]:
    spec = os.path.join(tmp, f"spec{world}.json")
    out = os.path.join(tmp, f"out{world}.json")
    json.dump(dict(layouts=layouts, steps=steps, out=out), open(spec, "w"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                    __file__, "--worker", spec], check=True, env=env, stdout=subprocess.DEVNULL)
    return json.load(open(out))


def mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="Steps per layout (the first is not timed).")
    ap.add_argument("--out", default=None, help="Also write the raw figures as JSON here.")
    ap.add_argument("--overlap", action="store_true",
                    help="Run the communication-overlap sweep (dp2, each --bucket-numel x overlap mode) instead of the layouts.")
    ap.add_argument("--bucket-numel", default="1000000,4000000,40000000",
                    help="--overlap: comma-separated gradient bucket sizes (elements) to sweep.")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    from tessera.common.layout import ParallelLayout

    rows = [peer(args.steps)]
    by_world: dict[int, list] = {}
    layouts = overlap_layouts([int(n) for n in args.bucket_numel.split(",")]) if args.overlap else LAYOUTS
    for name, lay, pkw in layouts:
        by_world.setdefault(ParallelLayout(**lay).world_size, []).append((name, lay, pkw))
    with tempfile.TemporaryDirectory() as tmp:
        for world, layouts in sorted(by_world.items()):
            rows += launch(world, layouts, args.steps, tmp)
    ref = rows[0]["ranks"][0]
    print(f"model: {MODEL}\nseq {SEQ}, global batch {GLOBAL_BATCH}, micro batch {MICRO}, fp32, gloo/CPU, 1 thread per rank\n")
    print("| layout | ranks | params MiB (max/rank) | grads MiB | optimizer MiB | activations MiB/micro-batch | "
          "peak RSS growth MiB | step s | params x | optim x | act x |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        worst = {k: max(x[k] for x in r["ranks"]) for k in ("params", "grads", "optim", "act", "rss", "step_s")}
        print(f"| {r['name']} | {len(r['ranks'])} | {mib(worst['params'])} | {mib(worst['grads'])} | "
              f"{mib(worst['optim'])} | {mib(worst['act'])} | {worst['rss']:.0f} | {worst['step_s']:.3f} | "
              f"{worst['params'] / ref['params']:.2f} | {worst['optim'] / ref['optim']:.2f} | "
              f"{worst['act'] / max(1, ref['act']):.2f} |")
    if not args.overlap:
        fsdp_acceptance(rows)
    if args.out:
        json.dump(rows, open(args.out, "w"), indent=1)


def fsdp_acceptance(rows: list[dict]) -> None:
    """Issue 17's memory acceptance: under FSDP data_shard=N, each rank's weights + grads +
    optimizer state (exact bytes of its local shards) within 15% of 1/N of the unsharded figure
    (the single-process peer). Bytes are deterministic: the same check is a test
    (tests/trainer/test_plan_validation.py)."""
    ref = rows[0]["ranks"][0]
    unsharded = ref["params"] + ref["grads"] + ref["optim"]
    print("\nFSDP: per-rank weights + grads + optimizer state against 1/N of the unsharded "
          f"{mib(unsharded)} MiB (acceptance: within 15%)\n")
    print("| layout | N | worst rank MiB | 1/N MiB | ratio | within 15% |")
    print("|---|---|---|---|---|---|")
    for r in rows[1:]:
        n = r.get("layout", {}).get("data_shard", 1)
        if n == 1 or r["layout"].get("tensor", 1) > 1:
            continue
        worst = max(x["params"] + x["grads"] + x["optim"] for x in r["ranks"])
        ratio = worst / (unsharded / n)
        print(f"| {r['name']} | {n} | {mib(worst)} | {mib(unsharded / n)} | {ratio:.3f} | "
              f"{'yes' if abs(ratio - 1) <= 0.15 else 'NO'} |")


if __name__ == "__main__":
    main()
