"""FP8 vs bf16 convergence: the same model, initialisation and batches trained N steps in each
precision with the trainer's own step; both loss curves, their final averages, and the speed ratio.

Issue #19's acceptance for FP8 training: over 200 steps the fp8 loss stays within 1% of bf16's
("equal loss curve") while fp8 runs at >= 1.3x bf16's tokens/s. Each run is what `tessera-train`
does in one process: `prepare_model` (fp32 master weights from the seed), for fp8
`tessera.trainer.components.precision.torchao_float8.apply_float8` (torchao Float8Linear, `--fp8-recipe`), `build_optimizer`
(AdamW), `Precision` (bf16 autocast, also under fp8) and `TrainStep` (compiled as the trainer does:
each block, then head + loss as one graph; clip, optimizer step), with the trainer's warmup + cosine `LRSchedule`. The bf16 run
goes first; the fp8 run rebuilds the model from the same seed and sees the same batches in the
same order.

Data: generated and learnable, so the curves are compared where they move rather than as noise
around ln(V). A fixed bank of `--phrases` random phrases of `--phrase-len` tokens (from `--seed`);
each sample is a random sequence of whole phrases. Once a model has memorised the bank, the only
unpredictable token is each phrase's first, so the loss falls from ln(V) towards
ln(phrases) / phrase-len. Batch `i` is drawn from a generator seeded with (seed, i): identical
for both runs, whatever ran before.

Figures: the final average is the mean loss of the last `--window` steps; the loss difference is
|fp8 - bf16| / bf16 of those averages; tokens/s is from the median step time after `--warmup`
steps (compilation excluded); peak memory is torch.cuda.max_memory_allocated over the run.

On a device without FP8 tensor cores the script stops before any work with the trainer's one
line (exit 2). `--dry-run` is the CPU check of this script itself: a tiny Llama, a few steps,
eager; the bf16 half as above, and the fp8 half through the same conversion without the device
check when torchao is installed (torchao's casts are emulated on CPU: the loss comparison is real,
the speed ratio means nothing).

    python benchmarks/fp8_convergence.py --device cuda                     # llama-1b, seq 4096, 200 steps
    python benchmarks/fp8_convergence.py --device cuda --layers 4 --steps 100   # llama-1b-shaped, smaller
    python benchmarks/fp8_convergence.py --dry-run                         # CPU: the script itself
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import statistics
import time

import torch

from tessera.common.errors import UserError, run_cli
from tessera.common.models.causal_lm.config import ModelConfig, preset
from tessera.trainer.components.model_setup import prepare_model
from tessera.trainer.components.optimizer.optim import build_optimizer, set_lr
from tessera.trainer.components.optimizer.schedule import LRSchedule
from tessera.trainer.components.precision.mixed import Precision
from tessera.trainer.components.precision.torchao_float8 import (
    RECIPES,
    apply_float8,
    convert_to_float8,
    fp8_device_problem,
)
from tessera.trainer.config import OptimConfig, ScheduleConfig
from tessera.trainer.objectives.step import TrainStep

LOSS_TOLERANCE = 0.01  # issue #19: fp8's loss within 1% of bf16's
SPEEDUP_TARGET = 1.3  # issue #19: fp8 >= 1.3x bf16's tokens/s
DRY_RUN = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, vocab_size=512)


def phrase_batches(cfg: ModelConfig, args: argparse.Namespace):
    """batch(i) -> (inputs, labels) on args.device: samples made of whole phrases from a fixed bank."""
    bank = torch.randint(0, cfg.vocab_size, (args.phrases, args.phrase_len),
                         generator=torch.Generator().manual_seed(args.seed))
    per_sample = math.ceil((args.seq + 1) / args.phrase_len)
    device = torch.device(args.device)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + i)
        picks = torch.randint(0, args.phrases, (args.batch, per_sample), generator=gen)
        tokens = bank[picks].flatten(1)[:, :args.seq + 1]
        return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)

    return batch


def train(cfg: ModelConfig, args: argparse.Namespace, fp8: bool) -> dict:
    """One run of args.steps steps; its losses, step times and peak memory."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = prepare_model(cfg, device, seed=args.seed)
    converted = 0
    if fp8:  # --dry-run converts without the device check (emulated casts on CPU)
        convert = convert_to_float8 if args.dry_run else lambda m, r: apply_float8(m, r, device)
        converted = len(convert(model, args.fp8_recipe))
    optim_cfg = OptimConfig(lr=args.lr, min_lr=args.lr / 10, weight_decay=0.1, grad_clip=1.0)
    optimizer = build_optimizer(model, optim_cfg)
    schedule = LRSchedule(ScheduleConfig(kind="cosine", warmup_steps=args.lr_warmup), optim_cfg, args.steps)
    step = TrainStep(model, optimizer, Precision("fp8" if fp8 else "bf16", device), optim_cfg.grad_clip,
                     compile=not args.no_compile)
    batch = phrase_batches(cfg, args)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for i in range(args.steps):
        set_lr(optimizer, schedule(i))
        inputs, labels = batch(i)
        sync()
        start = time.perf_counter()
        loss, _, _ = step([(inputs, labels)], 1, device)
        sync()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    peak = torch.cuda.max_memory_allocated() if cuda else None
    del step, optimizer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    timed = times[args.warmup:] or times
    return {"losses": losses, "step_times_s": times, "fp8_layers": converted,
            "final_loss": statistics.fmean(losses[-args.window:]),
            "tokens_per_s": args.batch * args.seq / statistics.median(timed), "peak_memory_bytes": peak}


def report(runs: dict[str, dict], args: argparse.Namespace) -> dict:
    print(f"{'step':>6}" + "".join(f"{name:>12}" for name in runs))
    every = max(1, args.steps // 10)
    for i in list(range(0, args.steps, every)) + ([args.steps - 1] if (args.steps - 1) % every else []):
        print(f"{i + 1:>6}" + "".join(f"{run['losses'][i]:>12.4f}" for run in runs.values()))
    print(f"{'':8}{'final avg loss':>16}{'tokens/s':>12}{'peak memory':>14}{'fp8 layers':>12}")
    for name, run in runs.items():
        memory = f"{run['peak_memory_bytes'] / 2**30:>10.2f} GiB" if run["peak_memory_bytes"] else f"{'n/a':>14}"
        print(f"{name:8}{run['final_loss']:>16.4f}{run['tokens_per_s']:>12,.0f}{memory}{run['fp8_layers']:>12}")
    summary = {}
    if "fp8" in runs:
        bf16, fp8 = runs["bf16"], runs["fp8"]
        summary["loss_rel_diff"] = abs(fp8["final_loss"] - bf16["final_loss"]) / bf16["final_loss"]
        summary["speedup"] = fp8["tokens_per_s"] / bf16["tokens_per_s"]
        print(f"final average loss (last {args.window} steps): fp8 vs bf16 differ by "
              f"{100 * summary['loss_rel_diff']:.2f}% (acceptance: within {100 * LOSS_TOLERANCE:g}%: "
              f"{'met' if summary['loss_rel_diff'] <= LOSS_TOLERANCE else 'NOT met'})")
        speed_note = ("emulated on CPU: not a speed figure" if args.dry_run else
                      f"acceptance: >= {SPEEDUP_TARGET:g}x: {'met' if summary['speedup'] >= SPEEDUP_TARGET else 'NOT met'}")
        print(f"tokens/s fp8 / bf16: {summary['speedup']:.2f}x ({speed_note})")
    else:
        print("fp8 half not run: torchao is not installed (pip install 'tessera-trainer[fp8]')")
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-1b", help="Model preset (default llama-1b).")
    ap.add_argument("--layers", type=int, default=None, help="Override num_layers (a smaller llama-1b-shaped model).")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2, help="Sequences per step.")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10, help="Steps left out of tokens/s (compilation).")
    ap.add_argument("--window", type=int, default=20, help="Final average over the last WINDOW steps' losses.")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--lr-warmup", type=int, default=20, help="Linear LR warmup steps, then cosine to lr/10.")
    ap.add_argument("--phrases", type=int, default=4096, help="Phrases in the generated data's bank.")
    ap.add_argument("--phrase-len", type=int, default=16, help="Tokens per phrase.")
    ap.add_argument("--fp8-recipe", choices=RECIPES, default="tensorwise")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-compile", action="store_true", help="Eager steps (no torch.compile of forward + loss).")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU check of this script: tiny Llama, 8 steps, eager; fp8 emulated when torchao is installed.")
    ap.add_argument("--json", default=None, help="Also write both curves and the figures to this JSON file.")
    args = ap.parse_args(argv)
    overrides = {} if args.layers is None else {"num_layers": args.layers}
    if args.dry_run:
        args.device, args.no_compile, args.seq, args.batch, args.phrases, args.phrase_len = "cpu", True, 32, 4, 32, 8
        args.steps, args.warmup, args.window, args.lr, args.lr_warmup = min(args.steps, 8), 2, 2, 3e-3, 2
        overrides = DRY_RUN
    elif problem := fp8_device_problem(torch.device(args.device)):
        raise UserError(problem)  # before any work: the bf16 half alone answers nothing
    if args.window > args.steps or args.warmup >= args.steps:
        raise UserError(f"--window ({args.window}) and --warmup ({args.warmup}) must be below --steps ({args.steps})")
    cfg = preset(args.preset, **overrides, max_seq_len=max(args.seq, 64))
    print(f"model: {cfg.num_params() / 1e6:.1f}M params (d={cfg.hidden_size}, L={cfg.num_layers}, "
          f"H={cfg.num_heads}/{cfg.kv_heads}, ffn={cfg.ffn_hidden_size}, V={cfg.vocab_size}); batch {args.batch} x "
          f"seq {args.seq}; {args.steps} steps; fp8 recipe {args.fp8_recipe}; device {args.device}; "
          f"compile={'off' if args.no_compile else 'on'}; data: {args.phrases} phrases of {args.phrase_len} tokens "
          f"(loss floor ~{math.log(args.phrases) / args.phrase_len:.3f})" + ("; DRY RUN (CPU)" if args.dry_run else ""))
    runs = {"bf16": train(cfg, args, fp8=False)}
    if not args.dry_run or importlib.util.find_spec("torchao") is not None:
        runs["fp8"] = train(cfg, args, fp8=True)
    summary = report(runs, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "torch": torch.__version__, "runs": runs, **summary}, f, indent=2)


if __name__ == "__main__":
    run_cli(main)
