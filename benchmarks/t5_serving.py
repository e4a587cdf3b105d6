"""Serving a T5 encoder-decoder: tessera-serve's engine vs transformers' `generate` in static batches.

Builds a random transformers `T5ForConditionalGeneration` (fp32; T5 v1.1-shaped by default: gated
GELU, untied head) and saves it as a Hugging Face directory. Each round, alternating which goes
first:
  - Tessera: `--requests` requests of `--prompt-len` encoder tokens and `--output-len` greedy
    tokens each, all added at once to the engine (in this process, `LLMEngine`, as the server runs
    it; continuous batching up to `--batch` sequences);
  - transformers: the same prompts in static batches of `--batch` (greedy, `use_cache=True`), one
    `generate` call per batch.
After one untimed warm-up round of each, reports generated tokens/s of each, the ratio Tessera / transformers, and whether the greedy tokens
agree (they should, up to float ties).

    .venv/bin/python benchmarks/t5_serving.py --requests 32 --batch 16 --prompt-len 128 --output-len 32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from hybrid_serving import VOCAB, tokenizer_files


def build(out: Path, args) -> int:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=args.hidden, d_kv=64, d_ff=args.ffn, num_layers=args.layers,
                                num_decoder_layers=args.layers, num_heads=args.hidden // 64,
                                feed_forward_proj="relu" if args.variant == "t5" else "gated-gelu",
                                tie_word_embeddings=args.variant == "t5", decoder_start_token_id=0, pad_token_id=0,
                                eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    model.save_pretrained(out)
    tokenizer_files(out)
    return sum(p.numel() for p in model.parameters())


def prompts(args) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(2, VOCAB, (args.prompt_len,), generator=gen).tolist() for _ in range(args.requests)]


def tessera_round(path: Path, args) -> tuple[float, list[list[int]]]:
    from tessera.inference.config import EngineConfig
    from tessera.inference.core.sampling_params import SamplingParams
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.loader import load_for_serving

    device = torch.device("cpu")
    loaded = load_for_serving(path, device, torch.float32)
    block, length = 16, args.prompt_len + args.output_len
    cfg = EngineConfig(block_size=block, num_kv_blocks=args.batch * -(-(length + 1) // block) + 1, max_model_len=length,
                       max_num_seqs=args.batch, max_num_batched_tokens=max(512, args.prompt_len),
                       enable_prefix_caching=False)
    engine = LLMEngine(loaded, cfg, device, torch.float32)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts(args)):
        engine.add_request(f"r{i}", p, params)
    engine.run_to_completion(lambda o: out.setdefault(o.request_id, []).extend(o.new_token_ids))
    seconds = time.perf_counter() - t0
    return args.requests * args.output_len / seconds, [out[f"r{i}"] for i in range(args.requests)]


def transformers_round(model, args) -> tuple[float, list[list[int]]]:
    ps, got = prompts(args), []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(ps), args.batch):
            ids = torch.tensor(ps[i:i + args.batch])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
            got.extend(gen[:, 1:].tolist())
    seconds = time.perf_counter() - t0
    return args.requests * args.output_len / seconds, got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=["t5", "v1_1"], default="v1_1")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4, help="encoder and decoder blocks each")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--batch", type=int, default=16, help="transformers' static batch; the engine's --max-num-seqs")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    with tempfile.TemporaryDirectory(prefix="t5-serving-") as tmp:
        path = Path(tmp) / "t5"
        numel = build(path, args)
        hf = transformers.T5ForConditionalGeneration.from_pretrained(path).eval()
        print(f"T5 {args.variant}: {numel / 1e6:.2f}M parameters, d={args.hidden}, {args.layers}+{args.layers} layers; "
              f"{args.requests} requests x {args.prompt_len} encoder tokens, {args.output_len} output tokens, "
              f"batch {args.batch}, {args.threads} threads", flush=True)
        warm = argparse.Namespace(**{**vars(args), "requests": args.batch, "output_len": 4})
        tessera_round(path, warm)  # first calls (oneDNN kernels, allocator) out of the timed rounds
        transformers_round(hf, warm)
        rates: dict[str, list[float]] = {"tessera": [], "transformers": []}
        for r in range(args.rounds):
            order = ("tessera", "transformers") if r % 2 == 0 else ("transformers", "tessera")
            tokens = {}
            for who in order:
                rate, tokens[who] = tessera_round(path, args) if who == "tessera" else transformers_round(hf, args)
                rates[who].append(rate)
                print(f"round {r + 1} {who:12s}: {rate:8.1f} generated tok/s", flush=True)
            same = sum(a == b for a, b in zip(tokens["tessera"], tokens["transformers"]))
            print(f"round {r + 1}: greedy tokens equal for {same}/{args.requests} requests", flush=True)
        t, h = statistics.median(rates["tessera"]), statistics.median(rates["transformers"])
        print(f"tessera / transformers generate (medians): {t:.1f} / {h:.1f} tok/s = {t / h:.2f}x")
        # On a shared machine a round's rate swings with the others' load: the fastest round of each
        # is the least disturbed one.
        t, h = max(rates["tessera"]), max(rates["transformers"])
        print(f"tessera / transformers generate (fastest rounds): {t:.1f} / {h:.1f} tok/s = {t / h:.2f}x; per round "
              + ", ".join(f"{a / b:.2f}x" for a, b in zip(rates["tessera"], rates["transformers"])))


if __name__ == "__main__":
    main()
