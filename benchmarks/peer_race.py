"""Tessera's train step against transformers' on the same model, the same batches and the same
optimizer, steps alternating (load from other jobs hits both alike): the next-token race
benchmarks/hybrid_training.py and deepseek_training.py run once each has built its pair of models,
and the report and transformers' recipe bert_training.py and t5_training.py race with.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from train_throughput import hf_standard_step, tessera_step, time_interleaved
from transformers import AutoConfig

from tessera.common.hf.directory import load_hf_weights, read_hf_config
from tessera.common.models.registry import hf_adapter, kind_of
from tessera.trainer.components.precision.mixed import Precision
from tessera.trainer.config import OptimConfig


def twins(cfg, hf_class, root: Path):
    """(config, Tessera's model, transformers' model) of `cfg`'s shape with the same weights: a random
    `hf_class` saved and imported through the kind's HF adapter, as `tessera-ckpt import` reads it."""
    (root / "config.json").write_text(json.dumps(hf_adapter(cfg).hf_config(cfg, torch.float32, None, None)))
    torch.manual_seed(0)
    hf = hf_class(AutoConfig.from_pretrained(root))
    hf.save_pretrained(root / "hf")
    loaded, _ = read_hf_config(root / "hf")
    assert loaded.num_params() == cfg.num_params() == sum(p.numel() for p in hf.parameters())
    # transformers trains its routing bias (e_score_correction_bias) by nothing: keep Tessera's
    # balancing off too, so both compute the same routing at every step.
    cfg = loaded.model_copy(update={"moe": loaded.moe.model_copy(update={"bias_balancing": False})})
    ours = kind_of(cfg).build(cfg, seed=None)
    ours.load_state_dict(load_hf_weights(root / "hf", cfg), strict=True)
    return cfg, ours.train(), hf.train()


def race(ours, hf, vocab_size: int, args: argparse.Namespace, hf_class: str) -> None:
    """Time both train steps (args: batch, seq, warmup, steps, compile, json) and print tokens/s of
    the median and the fastest step, and their ratios."""
    optim = OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0)
    precision = Precision("fp32", torch.device("cpu"))
    steps = {"tessera": tessera_step(ours, optim, precision, args.compile),
             "transformers": hf_standard_step(hf, optim, precision)}
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        x = torch.randint(0, vocab_size, (args.batch, args.seq + 1), generator=g)
        batches.append((x[:, :-1], x[:, 1:]))
    out = time_interleaved(steps, batches, args.warmup, args.steps, lambda: None)
    ratio, best_ratio, rates = report(out, args.batch * args.seq, hf_class)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "tokens_per_s": rates,
                                         "ratio": ratio, "fastest_ratio": best_ratio, "runs": out}, indent=1))


def report(out: dict[str, dict], tokens: int, peer: str) -> tuple[float, float, dict[str, float]]:
    """Print tokens/s of the median and the fastest step of each of `time_interleaved`'s runs
    ("tessera", "transformers"; `tokens` a step) and their ratios; return (median ratio, fastest
    ratio, tokens/s of the medians)."""
    # On a shared machine a step now and then stalls for seconds: the median and the fastest step
    # are both reported (the fastest is what each framework's code costs when nothing interferes).
    rates, best = {}, {}
    for name, r in out.items():
        med, fastest = statistics.median(r["step_times_s"]), min(r["step_times_s"])
        rates[name], best[name] = tokens / med, tokens / fastest
        print(f"{name:>13}: {rates[name]:>9,.0f} tokens/s median step ({med * 1e3:.0f} ms), {best[name]:>9,.0f} "
              f"fastest step ({fastest * 1e3:.0f} ms); first step {r['first_step_s']:.2f} s; loss after "
              f"{r['final_loss']:.4f}")
    ratio, best_ratio = rates["tessera"] / rates["transformers"], best["tessera"] / best["transformers"]
    print(f"Tessera / transformers {peer}: {ratio:.2f}x (median steps), {best_ratio:.2f}x (fastest steps)")
    return ratio, best_ratio, rates


def hf_recipe_step(hf, loss_of, lr: float, betas: tuple[float, float], weight_decay: float = 0.01):
    """transformers' standard training recipe as a step function of a batch: fused AdamW (no decay
    on vectors), `loss_of(hf, *batch)` backward, gradient norm clipped at 1.0 (foreach)."""
    decay = [p for p in hf.parameters() if p.ndim > 1]
    no_decay = [p for p in hf.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=betas, eps=1e-8, fused=True)

    def step(*batch) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(hf, *batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0, foreach=True)
        opt.step()
        return loss.detach()

    return step
