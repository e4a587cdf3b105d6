"""Speculative decoding benchmark: output tokens/s of the engine with and without n-gram prompt
lookup, in the same run, on the same weights and prompts, on CPU.

Workload (repetitive, where prompt lookup pays): each prompt is a slice of real source text
(the standard library's textwrap/json modules, tokenized) repeated `--repeats` times; greedy
decoding with ignore_eos for `--max-tokens` tokens, `--num-prompts` requests batched together
through `LLMEngine` (the engine of tessera-serve and tessera-generate: scheduler, paged KV cache,
model runner). A random model's greedy output soon repeats itself, which prompt lookup also
finds. Each round runs both engines back to back (plain first, then speculative, alternating the
order each round) and checks that their outputs are token for token the same.

Printed: output tokens/s of each, the speedup, and the acceptance rate, mean acceptance length
and per-position acceptance of the speculative run (vLLM's figures).

    .venv/bin/python benchmarks/speculative.py                       # llama-20m, 16 prompts x 128 tokens
    .venv/bin/python benchmarks/speculative.py --smoke               # seconds: 4 prompts x 16 tokens
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_race import checked_race, spec_summary  # noqa: E402


def make_prompts(tokenizer, num: int, length: int, repeats: int) -> list[list[int]]:
    import inspect
    import json
    import textwrap

    text = "".join(inspect.getsource(m) for m in (textwrap, json.decoder, json.encoder))
    ids = tokenizer.encode(text)
    step = max(1, (len(ids) - length) // max(1, num))
    return [ids[i * step:i * step + length] * repeats for i in range(num)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-20m", choices=["llama-20m", "llama-160m"])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=48, help="Tokens per repeated slice.")
    p.add_argument("--repeats", type=int, default=3, help="Times the slice is repeated in a prompt.")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="4 prompts x 16 tokens, one round (seconds).")
    args = p.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    import serving

    from tessera.inference.config import EngineConfig, SpeculativeConfig
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.loader import load_for_serving

    if args.smoke:
        args.num_prompts, args.max_tokens, args.rounds, args.prompt_len = 4, 16, 1, 16
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "run"
        ckpt, _ = serving.build_checkpoint(root, args.preset)
        dev, dtype = torch.device("cpu"), torch.float32
        loaded = load_for_serving(ckpt, dev, dtype)
        prompts = make_prompts(loaded.tokenizer, args.num_prompts, args.prompt_len, args.repeats)
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=args.num_speculative_tokens,
                                 prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min)
        max_len = args.prompt_len * args.repeats + args.max_tokens
        base = dict(kv_cache_tokens=args.num_prompts * (max_len + 64), max_model_len=max_len + 16,
                    max_num_seqs=max(args.num_prompts, 1), max_num_batched_tokens=2048,
                    enable_prefix_caching=False)
        engines = {"plain": LLMEngine(loaded, EngineConfig(**base), dev, dtype),
                   "ngram": LLMEngine(loaded, EngineConfig(**base, speculative=spec), dev, dtype)}
        raced = checked_race("speculative", engines, prompts, args.max_tokens, args.rounds, ("plain", "ngram"))
        if raced is None:
            return 1
        secs, _ = raced
        total = {name: sum(s) for name, s in secs.items()}
        tokens = args.rounds * args.num_prompts * args.max_tokens
        print(f"model {args.preset}: {loaded.config.num_params() / 1e6:.1f}M "
              f"parameters, {args.num_prompts} prompts of {args.prompt_len} x {args.repeats} tokens, "
              f"{args.max_tokens} greedy tokens each, {args.rounds} round(s), torch threads {torch.get_num_threads()}")
        for name in ("plain", "ngram"):
            print(f"  {name:6s} {tokens / total[name]:9.1f} output tokens/s ({total[name]:.2f} s)")
        print(f"  speedup {total['plain'] / total['ngram']:.2f}x (outputs identical); "
              + spec_summary(engines["ngram"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
