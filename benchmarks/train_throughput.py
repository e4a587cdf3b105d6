"""Training throughput: Tessera's train step vs Hugging Face transformers' LlamaForCausalLM.

Both train the same Llama-shaped model (same config, weights initialised identically by copying
Tessera's into the HF model), on the same random token batches, with the same optimizer
hyper-parameters (AdamW, fused where available, no decay on 1-D parameters), mean next-token
cross-entropy in fp32, gradient clipping at 1.0, fp32, and the same number of threads.

- Tessera runs the trainer's own step: prepare_model, build_optimizer and
  tessera.trainer.objectives.step.TrainStep (compiled per block with head + loss as one graph, or with
  `--compile-scope model` forward + loss as one graph; on CPU the loss in logsumexp form; clip then
  fused AdamW), the object `Trainer.train_step` calls.
- transformers runs the standard recipe: `model(input_ids=...).logits`, F.cross_entropy on fp32
  logits, `torch.nn.utils.clip_grad_norm_(foreach=True)`, `torch.optim.AdamW(fused=True)`,
  `zero_grad(set_to_none=True)`.

By default both run in this one process with glibc's malloc defaults, alternating steps (load
from other jobs hits both alike). The trainer's host-memory setting (tessera.trainer.components.observability.host_memory,
on by default in tessera-train on CPU) is process-wide: `--retain-host-memory` applies it here,
to both. `--separate-processes` runs each framework in its own process as a user would get it:
Tessera with the trainer's setting, transformers with glibc's defaults (needs a quiet machine:
steps no longer alternate, so drift in machine speed lands on one framework).
Compile time is measured separately (first step) and excluded from the steady-state figures.

`--breakdown` then profiles a few more steps of each framework. On a GPU it splits each step's
device time by kernel kind (GEMMs, attention, loss, optimizer, norms, elementwise) and the idle
gaps between kernels (benchmarks/step_breakdown.py). On CPU (torch.profiler, CPU time) it splits each step into the kernels both frameworks share (GEMMs, the SDPA attention kernels,
clipping and the fused AdamW: the same ATen kernels, called the same number of times) and the
rest, which is each framework's own (norms, RoPE, SwiGLU, residuals, loss, allocator, Python).
In one process (same allocator for both, steps alternating) transformers' step over its
shared-kernel time is the ceiling: the ratio Tessera would reach if everything else it does took
no time at all.

`--packed-documents MEAN` packs documents of random length (mean MEAN tokens) into each sample,
separated by an end-of-document token (id 0), and trains both frameworks on them document-aware:
Tessera with the trainer's data.reset_position_ids, reset_attention_mask and eod_mask_loss;
transformers the way it trains packed sequences (position_ids restarting per document, from which
it builds a block-causal mask; labels -100 where the input is end-of-document). Same model, same
data, same loss, so "loss after" must agree here too.

`--precision fp8` is the trainer's fp8 mode for both frameworks: bf16 autocast with every eligible
Linear swapped for torchao's Float8Linear (`--fp8-recipe tensorwise|rowwise`; the output head and
Linear layers with dimensions not multiples of 16 stay bf16): Tessera through
`tessera.trainer.components.precision.torchao_float8.apply_float8`, transformers through the same torchao conversion of its
LlamaForCausalLM (what a transformers user adds for FP8 training; its step stays eager, the
standard recipe, so torchao's amax/scale/cast chains run unfused there). MFU is against the GPU's dense
bf16 peak for every precision (torchtitan's convention), so an fp8 run's MFU is comparable with a
bf16 run's and its gain shows directly. On a GPU the table adds each framework's peak allocated
memory over its timed steps (torch.cuda.max_memory_allocated, reset before each step); in one
process it includes the other framework's resident weights and optimizer state, so for memory
figures use --separate-processes (each framework alone on the GPU). `--fp8-emulate` converts
without the device check so the fp8 path of this script runs on CPU (torchao's casts emulated:
checks the wiring, its figures mean nothing).

    python benchmarks/train_throughput.py                       # CPU-sized defaults
    python benchmarks/train_throughput.py --preset llama-160m --seq 1024 --batch 8 --device cuda
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tessera.common.errors import UserError, run_cli
from tessera.common.layers.sdpa_backend import AttentionBackend, sdpa_backend, sdpa_backend_problem
from tessera.common.models.causal_lm.config import ModelConfig, preset
from tessera.trainer.components.model_setup import prepare_model
from tessera.trainer.components.observability.host_memory import retain_freed_memory
from tessera.trainer.components.optimizer.optim import build_optimizer
from tessera.trainer.components.precision.mixed import Precision
from tessera.trainer.components.precision.te_float8 import TE_RECIPES, apply_te, te_config_problem
from tessera.trainer.components.precision.torchao_float8 import RECIPES as TORCHAO_RECIPES
from tessera.trainer.components.precision.torchao_float8 import apply_float8, convert_to_float8
from tessera.trainer.config import OptimConfig
from tessera.trainer.objectives.documents import IGNORE_INDEX, DocumentMasking
from tessera.trainer.objectives.step import TrainStep


def hf_llama(cfg: ModelConfig, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.bias, mlp_bias=cfg.bias,
        attn_implementation="sdpa", torch_dtype=torch.float32,
    )
    return LlamaForCausalLM(hf_cfg).to(device)


def copy_weights_to_hf(ours: torch.nn.Module, hf: torch.nn.Module, cfg: ModelConfig) -> None:
    """Same starting point for both (names map 1:1 for the Llama family)."""
    src = dict(ours.named_parameters())
    mapping = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "final_norm.weight"}
    if not cfg.tie_embeddings:
        mapping["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.num_layers):
        for hf_name, our_name in (("self_attn.q_proj", "attn.q_proj"), ("self_attn.k_proj", "attn.k_proj"),
                                  ("self_attn.v_proj", "attn.v_proj"), ("self_attn.o_proj", "attn.o_proj"),
                                  ("mlp.gate_proj", "mlp.gate_proj"), ("mlp.up_proj", "mlp.up_proj"),
                                  ("mlp.down_proj", "mlp.down_proj"), ("input_layernorm", "attn_norm"),
                                  ("post_attention_layernorm", "mlp_norm")):
            mapping[f"model.layers.{i}.{hf_name}.weight"] = f"layers.{i}.{our_name}.weight"
    with torch.no_grad():
        for hf_name, p in hf.named_parameters():
            p.copy_(src[mapping[hf_name]])


def time_interleaved(steps_by_name: dict, batches, warmup: int, steps: int, sync) -> dict[str, dict]:
    """Warm each up (timing its first step, which includes any compilation), then alternate timed steps.

    Alternating A, B, A, B... means load from other jobs on a shared machine hits both alike.
    """
    out = {name: {"step_times_s": [], "minor_faults": [], "peak_memory_bytes": []} for name in steps_by_name}
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    for name, step_fn in steps_by_name.items():
        start = time.perf_counter()
        step_fn(*batches[0])
        sync()
        out[name]["first_step_s"] = time.perf_counter() - start
        for i in range(1, warmup):
            step_fn(*batches[i % len(batches)])
        sync()
    for i in range(steps):
        for name, step_fn in steps_by_name.items():
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = step_fn(*batches[(warmup + i) % len(batches)])
            sync()
            out[name]["step_times_s"].append(time.perf_counter() - t0)
            # Pages touched for the first time (the kernel zero-fills each): allocator churn.
            out[name]["minor_faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
            if cuda:
                out[name]["peak_memory_bytes"].append(torch.cuda.max_memory_allocated())
            out[name]["final_loss"] = float(loss)
    return out


# Kernels both frameworks run identically (same ATen ops, same shapes, same count per step):
# self time of the GEMMs and the attention kernels, total time of the clip and optimizer ops (their
# CPU fallbacks call per-tensor children, counted once through the parent).
SHARED_SELF = {"aten::mm": "gemm", "aten::bmm": "gemm", "aten::addmm": "gemm", "aten::baddbmm": "gemm"}
SHARED_TOTAL = {"aten::_foreach_norm": "clip+optimizer", "aten::_foreach_mul_": "clip+optimizer",
                "aten::_fused_adamw_": "clip+optimizer"}


def profile_step(step_fn, batch, sync) -> dict:
    """Profile one step; return its wall time and the shared kernels' time by kind (ms)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step_fn(*batch)
        sync()
        wall = time.perf_counter() - start
    shared = {"gemm": 0.0, "attention": 0.0, "clip+optimizer": 0.0}
    for event in prof.key_averages():
        if event.key in SHARED_SELF:
            shared[SHARED_SELF[event.key]] += event.self_cpu_time_total / 1e3
        elif event.key in SHARED_TOTAL:
            shared[SHARED_TOTAL[event.key]] += event.cpu_time_total / 1e3
        elif "scaled_dot_product" in event.key or "flash_attention" in event.key:
            shared["attention"] += event.self_cpu_time_total / 1e3
    return {"wall_ms": wall * 1e3, "shared_ms": shared}


def breakdown(steps_by_name: dict, batches, steps: int, sync, device: torch.device) -> dict[str, dict]:
    """Profile `steps` more steps of each framework, alternating; per-framework medians.

    The ceiling is taken within each profiled transformers step (its wall time over its own
    shared-kernel time), so drift in the machine's speed between steps cancels out of it.
    """
    if device.type == "cuda":  # the device's kernels by kind and its idle gaps (step_breakdown.py)
        from step_breakdown import profile_cuda_step, summarize

        return {name: summarize([profile_cuda_step(fn, batches[i % len(batches)], sync) for i in range(steps)])
                for name, fn in steps_by_name.items()}
    per_step = {name: [] for name in steps_by_name}
    for i in range(steps):
        for name, step_fn in steps_by_name.items():
            per_step[name].append(profile_step(step_fn, batches[i % len(batches)], sync))
    return {name: summarize_profiles(profiles) for name, profiles in per_step.items()}


def summarize_profiles(profiles: list[dict]) -> dict:
    if "kinds_ms" in profiles[0]:  # GPU breakdowns
        from step_breakdown import summarize

        return summarize(profiles)
    return {"wall_ms": statistics.median(p["wall_ms"] for p in profiles),
            "shared_ms": {kind: statistics.median(p["shared_ms"][kind] for p in profiles)
                          for kind in profiles[0]["shared_ms"]},
            # A round's summary (separate processes) carries its own per-step median.
            "wall_over_shared": statistics.median(p.get("wall_over_shared", p["wall_ms"] / sum(p["shared_ms"].values()))
                                                  for p in profiles)}


def print_breakdown(breakdowns: dict[str, dict], same_process: bool) -> None:
    if all("kinds_ms" in b for b in breakdowns.values()):
        from step_breakdown import print_breakdown as print_gpu_breakdown

        return print_gpu_breakdown(breakdowns)
    print("breakdown (profiled steps, median ms per step; shared = the same ATen kernels in both frameworks):")
    for name, b in breakdowns.items():
        shared = sum(b["shared_ms"].values())
        kinds = ", ".join(f"{kind} {ms:.1f}" for kind, ms in b["shared_ms"].items())
        print(f"  {name:13}step {b['wall_ms']:6.1f} = shared {shared:6.1f} ({kinds}) + own {b['wall_ms'] - shared:6.1f}"
              f"  (step / shared {b['wall_over_shared']:.2f})")
    if not same_process:
        print("  (no ceiling across processes: with glibc's defaults transformers' GEMMs also pay page faults on "
              "their fresh output buffers, so its shared kernels are not Tessera's; run without "
              "--separate-processes for it)")
    elif "transformers" in breakdowns:
        print(f"  ceiling {breakdowns['transformers']['wall_over_shared']:.2f}x: the ratio Tessera would reach if "
              "everything besides the shared kernels took no time (transformers' step / its shared kernels)")


def hf_standard_step(model, optim_cfg: OptimConfig, precision: Precision):
    """The usual PyTorch loop around a transformers model (what a user would write)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    fused = {"fused": True} if next(model.parameters()).device.type in ("cpu", "cuda") else {}
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": optim_cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps, **fused)
    params = list(model.parameters())

    def step(inputs: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast():
            # Packed documents: position_ids restarting per document make transformers mask
            # attention across them (masking_utils' packed-sequence detection); no KV cache.
            kwargs = {} if position_ids is None else {"position_ids": position_ids, "use_cache": False}
            logits = model(input_ids=inputs, **kwargs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, optim_cfg.grad_clip, foreach=True)
        optimizer.step()
        return loss.detach()

    return step


def tessera_step(model, optim_cfg: OptimConfig, precision: Precision, compile: bool | str,
                 documents: DocumentMasking | None = None, attention_backend: AttentionBackend = "auto",
                 loss_chunk_tokens: int | None = None):
    """The trainer's step object, fed one micro-batch per step (positions and masks, when packing
    documents, derived inside from the tokens as in the trainer), under the trainer's
    training.attention_backend and training.loss_chunk_tokens."""
    train_step = TrainStep(model, build_optimizer(model, optim_cfg), precision, optim_cfg.grad_clip,
                           loss_chunk_tokens=loss_chunk_tokens, compile=compile, documents=documents)

    def step(inputs: torch.Tensor, labels: torch.Tensor, _position_ids: torch.Tensor | None = None) -> torch.Tensor:
        with sdpa_backend(attention_backend, "--attention-backend"):
            loss, _, _ = train_step([(inputs, labels)], 1, inputs.device)
        return loss

    return step


def float8(model: torch.nn.Module, args: argparse.Namespace, device: torch.device,
           ap: argparse.ArgumentParser) -> tuple[int, Precision]:
    """--precision fp8: swap the model's eligible Linear layers for torchao Float8Linear (or, with
    --fp8-backend te, Transformer Engine Linear); how many, and the Precision to train it under.
    What Transformer Engine cannot run here (not installed, no FP8 GPU, an mxfp8 layer not in
    32s) is the trainer's one line, through ap.error (exit 2)."""
    if args.precision != "fp8":
        return 0, Precision(args.precision, device)
    if args.fp8_backend == "te":
        try:
            converted, context = apply_te(model, args.fp8_recipe, device)
        except UserError as exc:
            ap.error(str(exc))
        return len(converted), Precision("fp8", device, fp8_context=context)
    if args.fp8_emulate:
        return len(convert_to_float8(model, args.fp8_recipe)), Precision("fp8", device)
    return len(apply_float8(model, args.fp8_recipe, device)), Precision("fp8", device)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-160m", help="Model preset to start from (Llama family).")
    ap.add_argument("--hidden", type=int, default=256, help="Override hidden_size (CPU default: 256).")
    ap.add_argument("--layers", type=int, default=4, help="Override num_layers.")
    ap.add_argument("--heads", type=int, default=4, help="Override num_heads.")
    ap.add_argument("--kv-heads", type=int, default=4, help="Override num_kv_heads.")
    ap.add_argument("--ffn", type=int, default=1024, help="Override ffn_hidden_size.")
    ap.add_argument("--vocab", type=int, default=8192, help="Override vocab_size.")
    ap.add_argument("--full-size", action="store_true", help="Use the preset exactly (ignore the overrides above).")
    ap.add_argument("--seq", type=int, default=256, help="Sequence length.")
    ap.add_argument("--batch", type=int, default=4, help="Sequences per step.")
    ap.add_argument("--steps", type=int, default=10, help="Timed steps per framework.")
    ap.add_argument("--warmup", type=int, default=3, help="Untimed steps first (the first includes compilation).")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's).")
    ap.add_argument("--no-compile", action="store_true", help="Run Tessera eager (no torch.compile of forward + loss).")
    ap.add_argument("--compile-scope", choices=["model", "blocks"], default="blocks",
                    help="training.compile_scope: blocks = each block compiled (once per kind) and head + loss as "
                         "one graph; model = forward and loss as one graph.")
    ap.add_argument("--retain-host-memory", action="store_true",
                    help="Apply the trainer's host-memory setting (tessera.trainer.components.observability.host_memory) to this process: both.")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp8"], default="fp32",
                    help="bf16 = autocast over fp32 weights for both frameworks (the trainer's bf16 mode); fp8 = "
                         "bf16 with torchao Float8Linear layers in both (the trainer's fp8 mode; see above).")
    ap.add_argument("--fp8-recipe", choices=list(dict.fromkeys([*TORCHAO_RECIPES, *TE_RECIPES])), default="tensorwise",
                    help=f"With --precision fp8: the scaling recipe (training.fp8_recipe; torchao's: "
                         f"{', '.join(TORCHAO_RECIPES)}; Transformer Engine's: {', '.join(TE_RECIPES)}).")
    ap.add_argument("--fp8-backend", choices=["torchao", "te"], default="torchao",
                    help="With --precision fp8: training.fp8_backend (te = Transformer Engine Linear layers in both "
                         f"frameworks, eager: needs --no-compile; its recipes: {', '.join(TE_RECIPES)}).")
    ap.add_argument("--fp8-emulate", action="store_true",
                    help="With --precision fp8: convert without the FP8-device check (CPU: emulated casts, to test "
                         "this script's fp8 path; the figures mean nothing).")
    ap.add_argument("--breakdown", type=int, nargs="?", const=5, default=0, metavar="STEPS",
                    help="After timing, profile STEPS more steps (default 5) of each framework and split them into "
                         "shared kernels and each framework's own time, with the ceiling ratio (see above).")
    ap.add_argument("--packed-documents", type=int, default=0, metavar="MEAN",
                    help="Pack documents of about MEAN tokens per sample and train both document-aware (see above).")
    ap.add_argument("--attention-backend", choices=["auto", "flash", "cudnn", "efficient", "math"], default="auto",
                    help="Tessera's training.attention_backend: the SDPA kernel its steps run (transformers keeps "
                         "PyTorch's choice).")
    ap.add_argument("--loss-chunk-tokens", type=int, default=None,
                    help="Tessera's training.loss_chunk_tokens: head + cross-entropy this many tokens at a time.")
    ap.add_argument("--json", default=None, help="Also write the figures to this JSON file.")
    ap.add_argument("--only", choices=["tessera", "transformers"], default=None, help="Run one framework only.")
    ap.add_argument("--separate-processes", action="store_true",
                    help="Each framework in its own process with its own defaults (Tessera: the trainer's "
                         "host-memory setting; transformers: glibc's), then the ratio.")
    ap.add_argument("--rounds", type=int, default=1,
                    help="With --separate-processes: run the pair this many times, alternating which goes first "
                         "(ABBA...), and report the median over all rounds' steps plus each round's ratio.")
    args = ap.parse_args(argv)
    if args.precision == "fp8" and args.fp8_backend == "te":
        if args.fp8_emulate:
            ap.error("--fp8-emulate is torchao's (emulated casts on CPU); Transformer Engine needs an FP8 GPU: "
                     "drop one of --fp8-emulate and --fp8-backend te")
        if not args.no_compile:
            ap.error("--fp8-backend te runs Tessera eager (TE's Linear runs outside torch.compile): add --no-compile")
        if problem := te_config_problem(args.fp8_recipe, False, "none", args.batch, args.seq):
            ap.error(problem)
    if args.precision == "fp8" and args.fp8_backend == "torchao" and args.fp8_recipe not in TORCHAO_RECIPES:
        ap.error(f"--fp8-recipe {args.fp8_recipe} is Transformer Engine's: add --fp8-backend te")
    if problem := sdpa_backend_problem(args.attention_backend, torch.device(args.device), "--attention-backend"):
        ap.error(problem)
    if args.separate_processes:
        return run_separately(args)

    if args.threads:
        torch.set_num_threads(args.threads)
    retained = args.retain_host_memory and args.device == "cpu" and retain_freed_memory()
    device = torch.device(args.device)
    overrides = {} if args.full_size else dict(
        hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        ffn_hidden_size=args.ffn, vocab_size=args.vocab)
    cfg = preset(args.preset, **overrides, max_seq_len=max(args.seq, 64))
    assert cfg.arch == "llama", "the transformers peer here is LlamaForCausalLM"
    optim_cfg = OptimConfig(lr=3e-4, weight_decay=0.1, grad_clip=1.0)
    gen = torch.Generator().manual_seed(0)
    documents = DocumentMasking(0, True, True, True) if args.packed_documents else None
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
        if documents is None:
            batches.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
            continue
        tokens[tokens == 0] = 1  # id 0 is the end-of-document token: only where placed below
        tokens[torch.rand(tokens.shape, generator=gen) < 1.0 / args.packed_documents] = 0
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        positions = documents.model_inputs(inputs)["positions"]
        batches.append((inputs.to(device), documents.mask_labels(inputs, labels).to(device), positions.to(device)))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokens_per_step = args.batch * args.seq

    ours = prepare_model(cfg, device, seed=0)  # transformers' weights are copied from it
    step_fns, fp8_layers = {}, {}
    if args.only != "tessera":  # HF first: its warm-up does not benefit from Tessera's compile
        hf = hf_llama(cfg, device)
        copy_weights_to_hf(ours, hf, cfg)
        hf.train()
        fp8_layers["transformers"], precision = float8(hf, args, device, ap)
        step_fns["transformers"] = hf_standard_step(hf, optim_cfg, precision)
    if args.only != "transformers":
        fp8_layers["tessera"], precision = float8(ours, args, device, ap)
        step_fns["tessera"] = tessera_step(ours, optim_cfg, precision, not args.no_compile and args.compile_scope,
                                           documents, args.attention_backend, args.loss_chunk_tokens)
    else:
        del ours
    results = time_interleaved(step_fns, batches, args.warmup, args.steps, sync)
    if args.breakdown:
        for name, summary in breakdown(step_fns, batches, args.breakdown, sync, device).items():
            results[name]["breakdown"] = summary
    for r in results.values():
        r["median_step_s"] = statistics.median(r["step_times_s"])
        r["tokens_per_s"] = tokens_per_step / r["median_step_s"]
        r["page_faults_per_step"] = statistics.median(r["minor_faults"])
        r["malloc"] = "retains freed memory" if retained else "glibc defaults"
        r["peak_memory_bytes"] = max(r["peak_memory_bytes"], default=None)
    for name, r in results.items():
        r["fp8_layers"] = fp8_layers[name]
    print(f"model: {cfg.num_params() / 1e6:.1f}M params (d={cfg.hidden_size}, L={cfg.num_layers}, "
          f"H={cfg.num_heads}/{cfg.kv_heads}, ffn={cfg.ffn_hidden_size}, V={cfg.vocab_size}); "
          f"batch {args.batch} x seq {args.seq}; {precision_label(args)}; threads {torch.get_num_threads()}; device {device}; "
          f"tessera compile={'off' if args.no_compile else args.compile_scope}, attention {args.attention_backend}, "
          f"loss chunks {args.loss_chunk_tokens or 'off'}; "
          f"{f'packed documents of ~{args.packed_documents} tokens; ' if args.packed_documents else ''}one process, "
          f"malloc {'retains freed memory (both)' if retained else 'glibc defaults'}")
    report(args, cfg, results, device)


def run_separately(args: argparse.Namespace) -> None:
    """Each framework in a fresh process of this script, one after the other; then one table.

    With --rounds N the pair runs N times in ABBA order, so slow drift in the machine's speed (which
    on a shared VM moves a step by 20% within minutes) lands on both frameworks alike; the table
    pools all rounds' timed steps (median) and each round's own ratio is printed too.
    """
    argv = [a for a in sys.argv[1:] if a not in ("--separate-processes", "--retain-host-memory")]
    argv = [a for i, a in enumerate(argv) if a != "--rounds" and (i == 0 or argv[i - 1] != "--rounds")]
    frameworks = (("transformers", []), ("tessera", ["--retain-host-memory"]))
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            this_round = {}
            for name, extra in (frameworks if r % 2 == 0 else frameworks[::-1]):
                out = Path(tmp) / f"{name}-{r}.json"
                subprocess.run([sys.executable, __file__, *argv, "--only", name, "--json", str(out), *extra],
                               check=True, stdout=subprocess.DEVNULL)
                this_round[name] = json.loads(out.read_text())["results"][name]
            rounds.append(this_round)
    results = {}
    for name, _ in frameworks:
        runs = [rnd[name] for rnd in rounds]
        pooled = dict(runs[-1])
        pooled["step_times_s"] = [t for run in runs for t in run["step_times_s"]]
        pooled["minor_faults"] = [f for run in runs for f in run["minor_faults"]]
        pooled["median_step_s"] = statistics.median(pooled["step_times_s"])
        pooled["tokens_per_s"] = args.batch * args.seq / pooled["median_step_s"]
        pooled["page_faults_per_step"] = statistics.median(pooled["minor_faults"])
        pooled["first_step_s"] = statistics.median(run["first_step_s"] for run in runs)
        pooled["peak_memory_bytes"] = max((run["peak_memory_bytes"] for run in runs if run["peak_memory_bytes"]),
                                          default=None)
        if args.breakdown:
            pooled["breakdown"] = summarize_profiles([run["breakdown"] for run in runs])
        results[name] = pooled
    overrides = {} if args.full_size else dict(
        hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        ffn_hidden_size=args.ffn, vocab_size=args.vocab)
    cfg = preset(args.preset, **overrides, max_seq_len=max(args.seq, 64))
    print(f"model: {cfg.num_params() / 1e6:.1f}M params (d={cfg.hidden_size}, L={cfg.num_layers}, "
          f"H={cfg.num_heads}/{cfg.kv_heads}, ffn={cfg.ffn_hidden_size}, V={cfg.vocab_size}); "
          f"batch {args.batch} x seq {args.seq}; {precision_label(args)}; threads {args.threads or 'default'}; "
          f"device {args.device}; tessera compile={'off' if args.no_compile else 'on'}; separate processes: "
          + "; ".join(f"{n} malloc {r['malloc']}" for n, r in results.items()))
    if args.rounds > 1:
        per_round = [rnd["transformers"]["median_step_s"] / rnd["tessera"]["median_step_s"] for rnd in rounds]
        print(f"{args.rounds} rounds (ABBA order); per-round ratio: " + ", ".join(
            f"{x:.2f}x ({rnd['transformers']['median_step_s'] * 1e3:.0f}/{rnd['tessera']['median_step_s'] * 1e3:.0f} ms)"
            for x, rnd in zip(per_round, rounds)) + f"; median {statistics.median(per_round):.2f}x")
    report(args, cfg, results, torch.device(args.device))


def precision_label(args: argparse.Namespace) -> str:
    if args.precision != "fp8":
        return args.precision
    return f"fp8 ({args.fp8_recipe}, {fp8_layer_kind(args)}{', emulated' if args.fp8_emulate else ''})"


def fp8_layer_kind(args: argparse.Namespace) -> str:
    return "Transformer Engine Linear" if args.fp8_backend == "te" else "torchao Float8Linear"


def report(args: argparse.Namespace, cfg: ModelConfig, results: dict[str, dict], device: torch.device) -> None:
    flops = cfg.flops_per_token(args.seq)
    print(f"{'':14}{'tokens/s':>12}{'TFLOP/s':>10}{'median step':>14}{'first step':>13}{'loss after':>12}"
          f"{'page faults/step':>18}{'peak memory':>14}")
    for name, r in results.items():
        peak_memory = r.get("peak_memory_bytes")
        memory = f"{peak_memory / 2**30:>10.2f} GiB" if peak_memory else f"{'n/a':>14}"
        print(f"{name:14}{r['tokens_per_s']:>12,.0f}{r['tokens_per_s'] * flops / 1e12:>10.4f}"
              f"{r['median_step_s'] * 1e3:>11.1f} ms{r['first_step_s']:>11.1f} s{r['final_loss']:>12.4f}"
              f"{r['page_faults_per_step']:>18,.0f}{memory}")
    if args.precision == "fp8":
        print(f"fp8 layers ({fp8_layer_kind(args)}): " + ", ".join(f"{n} {r['fp8_layers']}" for n, r in results.items()))
    if all("breakdown" in r for r in results.values()):
        print_breakdown({name: r["breakdown"] for name, r in results.items()}, not args.separate_processes)
    ratio = None
    if len(results) == 2:
        ratio = results["tessera"]["tokens_per_s"] / results["transformers"]["tokens_per_s"]
        print(f"ratio tessera/transformers: {ratio:.2f}x")
    if device.type == "cuda":
        from tessera.trainer.components.observability.metrics import gpu_peak_tflops

        peak = gpu_peak_tflops(torch.cuda.get_device_name(device))
        if peak:  # the dense bf16 peak for every precision, fp8 too (torchtitan's convention)
            for name, r in results.items():
                r["mfu_bf16_peak"] = r["tokens_per_s"] * flops / 1e12 / peak
                print(f"MFU {name}: {100 * r['mfu_bf16_peak']:.1f}% of the bf16 peak {peak:g} TFLOP/s "
                      f"({precision_label(args)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "machine": platform.platform(), "torch": torch.__version__,
                       "results": results, "ratio": ratio}, f, indent=2)


if __name__ == "__main__":
    run_cli(main)
