"""Quantized weights (`--quantization int8`): held-out perplexity and decode tokens/s, fp32 vs int8.

The model: by default the serving benchmark's random llama-20m (6 layers x 384, 2048-token BPE;
benchmarks/serving.py's `build_checkpoint`), because no trained checkpoint ships with the repo and
the machine has no network. Neither random variant stands in for a trained model's perplexity:
as initialised (`--head-scale 1`) the logits are near uniform and perplexity is about the vocabulary
size whatever the weights; with the head scaled (`--head-scale 20`, as the inference tests do) the
logits are peaked but overconfident, perplexity is astronomically high, and small logit changes move
it by percents. Both bracket the effect; the issue's 1% criterion wants a trained model: pass
`--checkpoint` (a Tessera checkpoint or HF export), or `--demo .demo` after `make demo`: the demo's
trained `tiny` Llama, evaluated on the standard-library sources that follow its training corpus in
the demo's own walk (text of the same kind it never saw).

Trained model (issue #18's acceptance: int8 perplexity within 1% of fp32), the demo's `tiny` Llama
(2 layers x 64, GQA 4/2, 8192-token BPE, 1.1M params), 65,536 held-out tokens of 15 stdlib sources
(unittest/__init__.py .. urllib/parse.py), windows of 128 (helper run, 2026-11-24):
  after its 600 steps (training loss 4.11, validation perplexity 149.8): fp32 perplexity 110.420,
  int8 110.428: +0.008%; teacher-forced top-1 agreement 0.9936; Linear weights 2.35 -> 0.62 MiB.
  at step 300 (training loss 4.12, validation perplexity 195.6): 139.833 -> 139.851, +0.012%, 0.9944.
  Decode tok/s in those runs (int8 1.15x / 1.24x of fp32) is this loaded machine's noise.
  `TESSERA_DEMO_DIR=/tmp/cpuspeed/demo make demo; .venv/bin/python benchmarks/quantization.py --demo /tmp/cpuspeed/demo --window 128`

Measured (2-core shared CPU, 1 thread, torch 2.13, torchao 0.18, llama-20m = 12.2M params):
  --head-scale 20: perplexity 1.405e12 -> 1.454e12 (+3.5%), top-1 agreement 0.954, Linear weights
  43.5 -> 11.0 MiB, decode 511.5 -> 375.2 tok/s (0.73x; torchao's int8 weight-only path dequantizes
  before an fp32 matmul on CPU, so it saves memory, not time).
  --head-scale 1: perplexity 2224.298 -> 2224.534 (+0.011%), top-1 agreement 0.953, decode
  178.3 -> 214.0 tok/s (1.20x). The decode figures of the two runs differ 3x for fp32 alone: the
  machine was shared by five jobs, so tokens/s here is noise-dominated; the kernel timing in
  tessera/inference/worker/quantization.py's docstring is the steadier evidence.

Held-out text: the source of Python's `string` module (the tokenizer was trained on textwrap and
json sources), read in windows of `--window` tokens. Tokens/s: the serving engine (LLMEngine, greedy,
ignore_eos) generating `--max-tokens` for `--batch` prompts, fp32 and int8 alternated `--rounds` times
on the same thread count; best round reported (the machine is shared).

    .venv/bin/python benchmarks/quantization.py
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import string
import sys
import tempfile
import time
from pathlib import Path

import torch

from tessera.inference.config import EngineConfig
from tessera.inference.core.sampling_params import SamplingParams
from tessera.inference.engine.llm_engine import LLMEngine
from tessera.inference.worker.loader import load_for_serving
from tessera.inference.worker.quantization import perplexity, quantize_model, quantized_weight_dtypes


def linear_weight_bytes(model) -> int:
    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            w = m.weight
            total += w.qdata.nbytes + w.scale.nbytes if hasattr(w, "qdata") else w.nbytes
    return total


def demo_heldout_ids(demo: Path, tokenizer, max_tokens: int) -> tuple[list[int], str]:
    """Token ids of the standard-library sources `make demo` did not train on: the demo's corpus is
    the first files of the sorted stdlib walk (examples/demo.py, `build_corpus`) up to a byte budget,
    so the files after its last one are text the model never saw, of the same kind."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from demo import stdlib_sources

    seen = {json.loads(line)["source"] for line in (demo / "corpus.jsonl").open(encoding="utf-8")}
    ids: list[int] = []
    files: list[str] = []
    for rel, text in stdlib_sources():
        if rel in seen:
            continue
        ids.extend(tokenizer.encode(text))
        files.append(rel)
        if len(ids) >= max_tokens:
            break
    if not files:
        raise SystemExit(f"{demo / 'corpus.jsonl'}: the demo trained on every stdlib file; nothing is held out")
    return ids[:max_tokens], f"{len(files)} stdlib sources the demo did not train on ({files[0]} .. {files[-1]})"


def decode_tok_per_s(loaded, batch: int, max_tokens: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    vocab = loaded.config.vocab_size
    engine = LLMEngine(loaded, EngineConfig(block_size=16, kv_cache_tokens=batch * (64 + max_tokens) * 2,
                                            max_num_seqs=batch, max_num_batched_tokens=max(256, batch)),
                       torch.device("cpu"), torch.float32)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), torch.randint(1, vocab, (32,), generator=g).tolist(), params)
    t = time.perf_counter()
    n = 0

    def count(out) -> None:
        nonlocal n
        n += len(out.new_token_ids)

    engine.run_to_completion(count)
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="a trained checkpoint or HF export (default: random llama-20m)")
    ap.add_argument("--demo", default=None, metavar="DIR",
                    help="what `make demo` wrote (.demo): its trained checkpoint, and as held-out text the standard "
                         "library sources that follow its training corpus")
    ap.add_argument("--heldout-tokens", type=int, default=65536, help="with --demo: held-out tokens to read")
    ap.add_argument("--head-scale", type=float, default=1.0,
                    help="multiply the random model's output head by this (see above; ignored with --checkpoint)")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("torchao").setLevel(logging.ERROR)
    cpu = torch.device("cpu")
    if args.demo:
        args.checkpoint = str(Path(args.demo) / "run" / "checkpoints")
    if args.checkpoint:
        ckpt, what = args.checkpoint, args.checkpoint
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from serving import build_checkpoint

        ckpt, _ = build_checkpoint(Path(tempfile.mkdtemp(prefix="tessera-quant-")) / "run", "llama-20m")
        what = f"random llama-20m, output head x{args.head_scale:g}"
    loaded = {}
    for name in ("fp32", "int8"):
        m = load_for_serving(ckpt, cpu, torch.float32)
        if not args.checkpoint:
            with torch.no_grad():
                m.model.output_weight().mul_(args.head_scale)
        loaded[name] = m
    quantize_model(loaded["int8"].model, "int8")  # the loader's own step, after the head scaling
    assert set(quantized_weight_dtypes(loaded["int8"].model).values()) == {torch.int8}

    if args.demo:
        ids, heldout = demo_heldout_ids(Path(args.demo), loaded["fp32"].tokenizer, args.heldout_tokens)
    else:
        ids, heldout = loaded["fp32"].tokenizer.encode(inspect.getsource(string)), "the string module's source"
    ppl = {k: perplexity(v.model, ids, args.window) for k, v in loaded.items()}
    n = len(ids) // args.window * args.window
    x = torch.tensor(ids[:n]).view(-1, args.window)
    with torch.no_grad():
        top1 = (loaded["fp32"].model(x).argmax(-1) == loaded["int8"].model(x).argmax(-1)).float().mean().item()
    # Before the engines run: they stack and (fp32) oneDNN-pack the Linear weights in place.
    weight_mib = {k: linear_weight_bytes(v.model) / 2**20 for k, v in loaded.items()}
    speed: dict[str, list[float]] = {"fp32": [], "int8": []}
    for r in range(args.rounds):
        for k in ("fp32", "int8"):
            speed[k].append(decode_tok_per_s(loaded[k], args.batch, args.max_tokens, seed=r))

    params = loaded["fp32"].config.num_params()  # the engine moved Linear weights out of parameters()
    print(f"model: {what} ({params / 1e6:.1f}M params), CPU, torch {torch.__version__}, threads {args.threads}")
    print(f"command: {' '.join(sys.argv)}")
    print(f"held-out: {len(ids)} tokens of {heldout}, windows of {args.window}")
    for k in ("fp32", "int8"):
        print(f"{k}: perplexity {ppl[k]:.3f}   Linear weights {weight_mib[k]:.2f} MiB   "
              f"decode {max(speed[k]):.1f} tok/s (best of {args.rounds}: "
              f"{', '.join(f'{s:.1f}' for s in speed[k])}; {args.batch} seqs x {args.max_tokens} tokens)")
    print(f"int8 vs fp32: perplexity {100 * (ppl['int8'] / ppl['fp32'] - 1):+.3f}%, top-1 agreement {top1:.4f}, "
          f"decode speed {max(speed['int8']) / max(speed['fp32']):.2f}x")


if __name__ == "__main__":
    main()
