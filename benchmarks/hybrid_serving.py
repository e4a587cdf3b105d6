"""Serving a hybrid model vs an attention-only model of the same size, at long context.

Builds two random models of about the same parameter count with transformers (fp32) and saves
them as Hugging Face directories: a Nemotron-H-shaped hybrid (Mamba-2 layers, one attention layer,
MLPs) and a Llama (attention + SwiGLU in every layer). Serves each through tessera-serve's engine
(in this process, `LLMEngine`, as the server runs it) with `--concurrency` requests of
`--context` prompt tokens and `--output-len` greedy tokens each, all at once, and reports:
  - prefill tokens/s (until every request has its first token) and decode tokens/s (the rest);
  - memory per sequence at that context, from the engine's own pools: the KV blocks one sequence
    holds (attention layers only for the hybrid) plus, for the hybrid, its slot of the state pool;
then the ratios hybrid / attention-only. The two models run alternately, `--rounds` times.

    .venv/bin/python benchmarks/hybrid_serving.py --context 4096 --concurrency 8 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

VOCAB = 2048


def tokenizer_files(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [Path(__file__).read_text(), Path(json.__file__).read_text(), Path(argparse.__file__).read_text()]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def build(kind: str, out: Path, args) -> int:
    """Save a random transformers model to `out`; returns its parameter count."""
    import transformers

    torch.manual_seed(0)
    d, ctx = args.hidden, args.context + args.output_len
    if kind == "hybrid":
        pattern = args.pattern
        names = {"M": "mamba", "*": "attention", "-": "mlp"}
        cfg = transformers.NemotronHConfig(
            vocab_size=VOCAB, hidden_size=d, num_attention_heads=d // 64, num_key_value_heads=2, head_dim=64,
            intermediate_size=4 * d, ssm_state_size=128, mamba_num_heads=2 * d // 64, mamba_head_dim=64,
            n_groups=1, chunk_size=128, max_position_embeddings=ctx,
            layers_block_type=[{"M": "linear_attention", "*": "full_attention", "-": "mlp"}[s] for s in pattern])
        assert all(s in names for s in pattern)
        model = transformers.NemotronHForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=d, intermediate_size=args.llama_ffn, num_hidden_layers=args.llama_layers,
            num_attention_heads=d // 64, num_key_value_heads=2, head_dim=64, max_position_embeddings=ctx,
            tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tokenizer_files(out)
    return sum(p.numel() for p in model.parameters())


def serve_round(path: Path, args) -> dict:
    from tessera.inference.config import EngineConfig
    from tessera.inference.core.sampling_params import SamplingParams
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.loader import load_for_serving

    device = torch.device("cpu")
    loaded = load_for_serving(path, device, torch.float32)
    block = 16
    per_seq_blocks = -(-(args.context + args.output_len) // block)
    cfg = EngineConfig(block_size=block, num_kv_blocks=args.concurrency * per_seq_blocks + 1,
                       max_model_len=args.context + args.output_len, max_num_seqs=args.concurrency,
                       max_num_batched_tokens=args.batched_tokens, enable_prefix_caching=False,
                       cpu_compile=False)
    engine = LLMEngine(loaded, cfg, device, torch.float32)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for i in range(args.concurrency):
        engine.add_request(f"r{i}", torch.randint(1, VOCAB, (args.context,), generator=gen).tolist(), params)
    first: set[str] = set()
    t0 = time.perf_counter()
    while len(first) < args.concurrency:
        for out in engine.step():
            if out.new_token_ids:
                first.add(out.request_id)
    t1 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    t2 = time.perf_counter()
    runner = engine.runner
    kv_per_seq = runner.kv.nbytes / runner.num_blocks * per_seq_blocks
    states = getattr(runner, "state_bytes", 0)
    return {"prefill_tok_s": args.concurrency * args.context / (t1 - t0),
            "decode_tok_s": args.concurrency * (args.output_len - 1) / (t2 - t1),
            "kv_mib_per_seq": kv_per_seq / 2**20, "state_mib_per_seq": states / 2**20,
            "mib_per_seq": (kv_per_seq + states) / 2**20, "summary": runner.state_summary()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--batched-tokens", type=int, default=2048, help="--max-num-batched-tokens (prefill chunk)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--pattern", default="M-M-M*-M-M-", help="the hybrid's layers (M Mamba-2, * attention, - MLP)")
    p.add_argument("--llama-layers", type=int, default=6, help="layers of the attention-only model")
    p.add_argument("--llama-ffn", type=int, default=864, help="its MLP width (sized to match the hybrid's parameters)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="hybrid-serving-") as tmp:
        paths, numel = {}, {}
        for kind in ("hybrid", "attention"):
            paths[kind] = Path(tmp) / kind
            numel[kind] = build(kind, paths[kind], args)
        print(f"hybrid {args.pattern}: {numel['hybrid'] / 1e6:.2f}M parameters; attention-only llama "
              f"{args.llama_layers} layers: {numel['attention'] / 1e6:.2f}M; context {args.context}, "
              f"{args.concurrency} concurrent, {args.output_len} output tokens, {args.threads} threads", flush=True)
        results: dict[str, list[dict]] = {"hybrid": [], "attention": []}
        for r in range(args.rounds):
            order = ("hybrid", "attention") if r % 2 == 0 else ("attention", "hybrid")
            for kind in order:
                res = serve_round(paths[kind], args)
                results[kind].append(res)
                print(f"round {r + 1} {kind:9s}: prefill {res['prefill_tok_s']:8.1f} tok/s, decode "
                      f"{res['decode_tok_s']:7.1f} tok/s, {res['mib_per_seq']:.2f} MiB/sequence (KV "
                      f"{res['kv_mib_per_seq']:.2f} + state {res['state_mib_per_seq']:.3f})"
                      + (f"; {res['summary']}" if res["summary"] else ""), flush=True)
        med = {k: {m: statistics.median(x[m] for x in v) for m in ("prefill_tok_s", "decode_tok_s", "mib_per_seq")}
               for k, v in results.items()}
        h, a = med["hybrid"], med["attention"]
        print(f"hybrid / attention-only (medians): prefill {h['prefill_tok_s'] / a['prefill_tok_s']:.2f}x, decode "
              f"{h['decode_tok_s'] / a['decode_tok_s']:.2f}x tok/s; memory per sequence "
              f"{h['mib_per_seq'] / a['mib_per_seq']:.3f}x ({h['mib_per_seq']:.2f} vs {a['mib_per_seq']:.2f} MiB)")


if __name__ == "__main__":
    main()
