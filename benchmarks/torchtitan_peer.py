"""torchtitan's Llama 3 trainer at Tessera's llama-1b shape, bf16 and float8: tokens/s, MFU, memory.

The peer issue #19 names: torchtitan reports 33-39% MFU for Llama 3.1 8B in bf16 and ~1.3-1.5x
from Float8. This runs its own `Trainer` on one GPU, in the same run as
benchmarks/train_throughput.py, and prints the figures in that script's format.

Which torchtitan: the one installed, by its release (one code path each; the figures are the same):
- 0.3.0 is released against torch 2.14 and imports on 2.13, not on 2.11: it imports
  torch.distributed.fsdp.DataParallelMeshDims, which 2.11 lacks (the ImportError on the GPU image,
  torch 2.11.0+cu130, on 2026-11-27).
  Its config is Python: `Trainer.Config` as its registry builds `llama3_debugmodel` (its loss,
  AdamW 8e-4, LR schedule) with `model_registry("1B")`, Llama 3.2 1B (d 2048, 16 layers, 32/8 heads,
  ffn 8192, vocab 128256, tied embeddings). Attention: flex by default (0.3.0 refuses SDPA for
  language models), flex_flash or varlen. float8: its `Float8LinearConverter`, head `lm_head` left
  in bf16.
- 0.2.x (0.2.2, versioned 2026-02-20, between torch 2.10 and 2.11) imports on torch 2.10 and later:
  every torch name it imports exists in 2.10's and 2.11's sources. Its config is a JobConfig read
  from TOML (the file this script writes, parsed by its ConfigManager as its train.py does), with
  the optimizer and LR schedule of its llama3 debug model. It has no 1B flavor, so the script adds
  Llama 3.2 1B to its `llama3_args` (the same shapes and parameter count as Tessera's llama-1b) and
  ties the head to the embedding with a model converter, as 0.3.0's flavor does. Attention: SDPA
  by default (its default and Tessera's; it asks for cuDNN's kernel first, then flash), flex or
  varlen. float8: its `quantize.linear.float8` converter, head `output` left in bf16.
Both: `--fp8-recipe` is torchao's recipe name (`Float8LinearConfig.from_recipe_name`), the output
head stays in bf16 as in Tessera's fp8 mode; torch.compile of model and loss, no activation
checkpointing (Tessera's benchmark recomputes nothing either), one GPU (no FSDP: torchtitan
applies bf16 mixed precision with autocast there), `--seq` 4096, `--batch` 2, gradient clipping at
1.0; checkpointing and validation off.

Data: nothing can be fetched on the GPU machine, and torchtitan reads text through a Hugging Face
tokenizer and a `datasets` dataset, so the script writes both into a temporary directory: a
word-level tokenizer (tokenizer.json, tokenizer_config.json with BOS/EOS) over generated words and
a JSON-lines file of generated text, read by torchtitan's `c4_test` loader from `dataset_path`
(the same files for both releases). Throughput does not depend on the token values.

Figures: each precision runs in its own process (distributed init, compile caches, memory).
torchtitan's MetricsProcessor computes each step's tokens/s and memory (log_freq 1; the same keys
in both releases); the worker records those dicts, drops the first `--warmup` steps and reports
medians: tokens/s, TFLOP/s and MFU by Tessera's FLOP count (`ModelConfig.flops_per_token` of
llama-1b, the count train_throughput.py uses) against the GPU's dense bf16 peak for both
precisions, torchtitan's own MFU figure beside it (none under float8; under 0.2.x it leaves out the
tied head's GEMM, since it counts the parameters after the tying converter), and peak
memory (its max active GiB, what torch.cuda.max_memory_allocated measures, and max reserved).

Wheels: both torchtitan releases and what they import that the GPU image lacks are pure Python and
travel in .whl/ (`TITAN_WHEELS` in benchmarks/gpu_session.py, which fetches them with
--fetch-wheels); `gpu_session.py --step install titan-install titan` installs the newest one whose
`import torchtitan.train` succeeds on the machine's torch, then runs this script. Its other
requirements are in the image (tokenizers, safetensors, tensorboard, einops, pillow; datasets'
pyarrow, pandas, xxhash, fsspec, huggingface-hub, httpx, requests, tqdm, pyyaml, filelock); wandb
is imported only when enabled. Checked on CPU with torch 2.13 (tests/trainer/test_fp8_benchmarks.py:
each release's config through its own parser, the model it builds, the data through its loader);
the trainer itself needs a GPU (it picks "cuda" when no accelerator is found).

    python benchmarks/torchtitan_peer.py --steps 30 --warmup 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
# The preset whose FLOP count Tessera reports for each torchtitan flavor (same shapes).
TESSERA_PRESET = {"1B": "llama-1b"}


def write_assets(root: Path, words: int = 8000, documents: int = 400, words_per_document: int = 4000,
                 seed: int = 0) -> tuple[Path, Path]:
    """A word-level tokenizer and a JSON-lines dataset of generated text under `root`."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {BOS: 0, EOS: 1, UNK: 2, **{f"w{i}": i + 3 for i in range(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([BOS, EOS, UNK])
    assets = root / "tokenizer"
    assets.mkdir(parents=True)
    tokenizer.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "add_bos_token": True, "add_eos_token": True}))
    data = root / "data"
    data.mkdir()
    rng = random.Random(seed)
    with open(data / "train.jsonl", "w") as f:
        for _ in range(documents):
            text = " ".join(f"w{rng.randrange(words)}" for _ in range(words_per_document))
            f.write(json.dumps({"text": text}) + "\n")
    return assets, data


def torchtitan_release() -> tuple[int, int]:
    """(major, minor) of the installed torchtitan, read from its metadata without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("torchtitan")
    except PackageNotFoundError:
        raise SystemExit("torchtitan is not installed: install its wheel (benchmarks/gpu_session.py "
                         "--install-torchtitan on the GPU machine, or pip install torchtitan)") from None
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", release).groups())
    return major, minor


def uses_job_config() -> bool:
    """torchtitan 0.2.x is configured by a JobConfig dataclass parsed from TOML and CLI flags; 0.3.0
    by Trainer.Config objects built in Python (its config registry)."""
    return torchtitan_release() < (0, 3)


def attention_backends() -> tuple[str, ...]:
    """The installed torchtitan's attention backends, its default first."""
    return ("sdpa", "flex", "varlen") if uses_job_config() else ("flex", "flex_flash", "varlen")


def trainer_config(args: argparse.Namespace, assets: Path, data: Path, dump: Path):
    """torchtitan 0.3.0's Trainer.Config for this run (it imports on torch 2.13, not on 2.11, which lacks
    torch.distributed.fsdp.DataParallelMeshDims; see the module docstring)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.quantization import Float8LinearConverter
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import decoder_vocab_size, llama3_debugmodel

    config = llama3_debugmodel()
    converters = None
    if args.precision == "fp8":
        converters = [Float8LinearConverter.Config(recipe_name=args.fp8_recipe, filter_fqns=["lm_head"],
                                                   model_compile_enabled=not args.no_compile)]
    config.model_spec = model_registry(args.flavor, attn_backend=args.attn_backend, converters=converters)
    config.loss.loss_fn.global_vocab_size = decoder_vocab_size(config.model_spec)  # the debug model's is 2048
    config.hf_assets_path = str(assets)
    config.dump_folder = str(dump)
    config.training = TrainingConfig(local_batch_size=args.batch, seq_len=args.seq, steps=args.warmup + args.steps,
                                     max_norm=1.0)
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(data))
    config.metrics = MetricsProcessor.Config(log_freq=1)
    config.checkpoint = CheckpointManager.Config(enable=False)
    config.validator = Validator.Config(enable=False)
    config.activation_checkpoint = None
    config.compile = CompileConfig(enable=not args.no_compile, components=["model", "loss"])
    return config


# torchtitan 0.2.x has no 1B flavor: Llama 3.2 1B as its TransformerModelArgs (ffn: 4 x 2048 x 2/3
# x 1.5 rounded up to 1024 = 8192; rope scaled by 32 from 8192 positions), and its embedding tied
# to the output head by a model converter, as 0.3.0's "1B" (enable_weight_tying) and Tessera's preset.
LLAMA32_1B = dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.5,
                  multiple_of=1024, rope_theta=500000.0)
TIE = "tie_embeddings"


class TieEmbeddings:
    """torchtitan 0.2.x model converter: the output head shares the token embedding's weight."""

    def __init__(self, job_config, parallel_dims):
        pass

    def convert(self, model) -> None:
        model.output.weight = model.tok_embeddings.weight

    def post_optimizer_hook(self, model) -> None:
        pass


def register_flavor(flavor: str, attn_backend: str) -> list[str]:
    """torchtitan 0.2.x: `flavor` with `attn_backend` in its llama3 registry (1B added as Llama 3.2
    1B, its other flavors as they are); the model converters the flavor needs."""
    import dataclasses

    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
    from torchtitan.protocols import model_converter

    mask = "block_causal" if attn_backend == "varlen" else "causal"  # varlen takes documents only
    if flavor != "1B":
        llama3_args[flavor] = dataclasses.replace(llama3_args[flavor], attn_type=attn_backend, attn_mask_type=mask)
        return []
    llama3_args[flavor] = TransformerModelArgs(**LLAMA32_1B, rope_scaling_args=RoPEScalingArgs(scaling_factor=32.0),
                                               attn_type=attn_backend, attn_mask_type=mask)
    if TIE not in model_converter._registry_model_converter_cls:
        model_converter.register_model_converter(TieEmbeddings, TIE)
    return [TIE]


def job_toml(args: argparse.Namespace, assets: Path, data: Path, dump: Path, converters: list[str]) -> str:
    """torchtitan 0.2.x's job config for this run, as the TOML its train.py reads (--job.config_file),
    with the optimizer and LR schedule of its llama3 debug model (AdamW 8e-4, 2 warmup steps,
    linear decay over the last 80%)."""
    fp8 = args.precision == "fp8"
    sections = {
        "job": {"dump_folder": str(dump), "description": f"Tessera peer: llama3 {args.flavor} {args.precision}"},
        "metrics": {"log_freq": 1},
        "model": {"name": "llama3", "flavor": args.flavor, "hf_assets_path": str(assets),
                  "converters": [*converters, *(["quantize.linear.float8"] if fp8 else [])]},
        "optimizer": {"name": "AdamW", "lr": 8e-4},
        "lr_scheduler": {"warmup_steps": 2, "decay_ratio": 0.8, "decay_type": "linear", "min_lr_factor": 0.0},
        "training": {"local_batch_size": args.batch, "seq_len": args.seq, "steps": args.warmup + args.steps,
                     "max_norm": 1.0, "dataset": "c4_test", "dataset_path": str(data)},
        "checkpoint": {"enable": False},
        "validation": {"enable": False},
        "activation_checkpoint": {"mode": "none"},
        "compile": {"enable": not args.no_compile, "components": ["model", "loss"]},
    }
    if fp8:  # the output head stays bf16, as in Tessera's fp8 mode
        sections["quantize.linear.float8"] = {"recipe_name": args.fp8_recipe, "filter_fqns": ["output"]}
    lines = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]  # JSON's scalars are TOML's
        lines.append("")
    return "\n".join(lines)


def job_config(args: argparse.Namespace, assets: Path, data: Path, dump: Path):
    """torchtitan 0.2.x's JobConfig for this run, parsed and validated by its own ConfigManager
    (torchtitan 0.2.2 imports on torch 2.10 and later: see the module docstring)."""
    from torchtitan.config import ConfigManager

    converters = register_flavor(args.flavor, args.attn_backend)
    dump.mkdir(parents=True, exist_ok=True)
    toml = dump / "job.toml"
    toml.write_text(job_toml(args, assets, data, dump, converters))
    return ConfigManager().parse_args(["--job.config_file", str(toml)])


def build_trainer(args: argparse.Namespace, assets: Path, data: Path, dump: Path):
    if uses_job_config():
        from torchtitan.train import Trainer

        return Trainer(job_config(args, assets, data, dump))
    return trainer_config(args, assets, data, dump).build()


def worker(args: argparse.Namespace) -> None:
    """One precision: run torchtitan's trainer and write its per-step metrics to args.out."""
    with socket.socket() as s:  # one process group of one rank, as torchrun --nproc_per_node 1 sets up
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}.items():  # nothing is fetched
        os.environ.setdefault(key, value)
    from torchtitan.tools.logging import init_logger

    init_logger()  # torchtitan's own step lines in the log, as its train.py sets up
    with tempfile.TemporaryDirectory() as tmp:
        assets, data = write_assets(Path(tmp))
        trainer = build_trainer(args, assets, data, Path(tmp) / "outputs")
        steps: list[dict] = []
        container = trainer.metrics_processor.logger
        log = container.log

        def record(metrics: dict, step: int) -> None:
            steps.append({"step": step, **{k: float(v) for k, v in metrics.items()}})
            log(metrics, step)

        container.log = record
        try:
            trainer.train()
        finally:
            trainer.close()
    import torch
    import torchtitan

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    Path(args.out).write_text(json.dumps({"steps": steps, "device": device, "torch": torch.__version__,
                                          "torchtitan": torchtitan.__version__}))


def summarize(run: dict, args: argparse.Namespace, flops_per_token: float | None, peak: float | None) -> dict:
    timed = run["steps"][args.warmup:] or run["steps"]
    tps = statistics.median(s["throughput(tps)"] for s in timed)
    tflops = tps * flops_per_token / 1e12 if flops_per_token else statistics.median(s["tflops"] for s in timed)
    own_mfu = [s["mfu(%)"] for s in timed if "mfu(%)" in s]
    return {"tokens_per_s": tps, "tflops": tflops, "mfu_bf16_peak": tflops / peak if peak else None,
            "torchtitan_mfu_pct": statistics.median(own_mfu) if own_mfu else None,
            "peak_active_gib": max(s["memory/max_active(GiB)"] for s in timed),
            "peak_reserved_gib": max(s["memory/max_reserved(GiB)"] for s in timed),
            "final_loss": timed[-1]["loss_metrics/global_avg_loss"], "steps_timed": len(timed)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="1B", help="torchtitan llama3 flavor (1B = Tessera's llama-1b).")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2, help="Sequences per step (torchtitan's local_batch_size).")
    ap.add_argument("--steps", type=int, default=30, help="Timed steps per precision.")
    ap.add_argument("--warmup", type=int, default=10, help="Steps first, left out of the figures (compilation).")
    ap.add_argument("--precisions", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    ap.add_argument("--fp8-recipe", choices=["tensorwise", "rowwise"], default="tensorwise")
    ap.add_argument("--attn-backend", choices=["sdpa", "flex", "flex_flash", "varlen"], default=None,
                    help="torchtitan's attention backend (its default: sdpa in 0.2.x, flex in 0.3.0; 0.2.x has no "
                         "flex_flash, 0.3.0 no sdpa).")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json", default=None, help="Also write the figures to this JSON file.")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="bf16", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    backends = attention_backends()
    args.attn_backend = args.attn_backend or backends[0]
    if args.attn_backend not in backends:
        ap.error(f"--attn-backend {args.attn_backend}: torchtitan {'.'.join(map(str, torchtitan_release()))} "
                 f"has {', '.join(backends)}")
    if args.worker:
        return worker(args)

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions:
            out = Path(tmp) / f"{precision}.json"
            worker_argv = ["--flavor", args.flavor, "--seq", str(args.seq), "--batch", str(args.batch),
                           "--steps", str(args.steps), "--warmup", str(args.warmup), "--fp8-recipe", args.fp8_recipe,
                           "--attn-backend", args.attn_backend,
                           *(["--no-compile"] if args.no_compile else []),
                           "--worker", "--precision", precision, "--out", str(out)]
            proc = subprocess.run([sys.executable, __file__, *worker_argv])
            if proc.returncode != 0 or not out.exists():
                print(f"torchtitan {precision}: the trainer exited {proc.returncode} (its log is above)")
                continue
            results[precision] = json.loads(out.read_text())
    if not results:
        sys.exit(1)
    device = next(iter(results.values()))["device"]
    from tessera.common.models.causal_lm.config import preset
    from tessera.trainer.components.observability.metrics import gpu_peak_tflops

    name = TESSERA_PRESET.get(args.flavor)
    flops = preset(name, max_seq_len=max(args.seq, 64)).flops_per_token(args.seq) if name else None
    peak = gpu_peak_tflops(device) if device != "cpu" else None
    figures = {p: summarize(r, args, flops, peak) for p, r in results.items()}
    run = next(iter(results.values()))
    print(f"torchtitan {run.get('torchtitan', '?')} llama3 {args.flavor} ({name or 'no Tessera preset: its own FLOP count'}); batch {args.batch} x "
          f"seq {args.seq}; {device}; torch {run['torch']}; compile "
          f"{'off' if args.no_compile else 'on'}; attention {args.attn_backend}; fp8 = torchao Float8Linear, {args.fp8_recipe}; medians of "
          f"{next(iter(figures.values()))['steps_timed']} steps after {args.warmup}")
    print(f"{'':18}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU (bf16 peak)':>17}{'its MFU':>9}{'peak active':>13}"
          f"{'reserved':>10}{'loss after':>12}")
    for precision, f in figures.items():
        mfu = f"{100 * f['mfu_bf16_peak']:>16.1f}%" if f["mfu_bf16_peak"] is not None else f"{'n/a':>17}"
        own = f"{f['torchtitan_mfu_pct']:>8.1f}%" if f["torchtitan_mfu_pct"] is not None else f"{'n/a':>9}"
        print(f"{'torchtitan ' + precision:18}{f['tokens_per_s']:>12,.0f}{f['tflops']:>10.1f}{mfu}{own}"
              f"{f['peak_active_gib']:>9.2f} GiB{f['peak_reserved_gib']:>6.1f} GiB{f['final_loss']:>12.4f}")
    if "bf16" in figures and "fp8" in figures:
        print(f"ratio torchtitan fp8/bf16: {figures['fp8']['tokens_per_s'] / figures['bf16']['tokens_per_s']:.2f}x")
    if peak:
        print(f"MFU against the bf16 dense peak {peak:g} TFLOP/s for both precisions (torchtitan's convention)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "device": device, "torchtitan": run.get("torchtitan"), "figures": figures,
                       "steps": {p: r["steps"] for p, r in results.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
