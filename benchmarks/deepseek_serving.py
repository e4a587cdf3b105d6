"""DeepSeek-V3-class serving benchmark (multi-head latent attention), CPU, one run:

  - cache capacity: tokens the engine's latent KV pool holds in `--kv-cache-memory`, against the
    tokens the same bytes hold as full K/V of the same model (every head's key and value), from
    the engine's own pool and the startup summary;
  - output tokens/s through `LLMEngine` (tessera-serve's engine: scheduler, paged latent cache,
    absorbed decode), greedy, ignore_eos, `--num-prompts` requests batched together; with
    `--speculative` a second engine on the same weights and prompts speculates (the engines
    alternate which runs first each round, and their outputs must be token for token the same);
    with `--unabsorbed` another engine decodes by up-projecting the cached latents to full heads
    every step (what absorption avoids);
  - with `--tensor-parallel N`: every engine over N gloo workers, and the round trips to them per
    engine step; with MTP a third engine drafts one round trip per draft (greedy drafts otherwise
    chain on the workers: spec_decode/mtp.py); with `--expert-parallel` another engine splits the
    routed experts over the workers (`--enable-expert-parallel`) instead of replicating them
    (`--moe-ffn` widens the experts so that they weigh in the step as at full size);
  - with `--decode-batch-ab`: another engine that builds every decode step with `prepare` (its
    sequences' block tables packed and grouped from scratch each step, as MLA steps were built
    before they took their inputs from the persistent decode batch), outputs checked equal, and
    each engine's host time per step (the step's wall time less its layer stack's).

The model is random, DeepSeek-V3's structure scaled down for a 2-core CPU (first layer dense, then
group-limited sigmoid MoE with a shared expert; q-lora; YaRN off; one MTP depth), fp32. Random MTP
weights draft at random: `--speculative '{"method": "mtp", ...}'` measures the cost of drafting and
verifying, not the speed-up a trained MTP module gives (DeepSeek reports 85-90% acceptance of
the second token).

    .venv/bin/python benchmarks/deepseek_serving.py
    .venv/bin/python benchmarks/deepseek_serving.py --smoke       # seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_race import checked_race, run_engine, spec_summary  # noqa: E402

# DeepSeek-V3's config.json fields, scaled down (V3: 7168 hidden, 61 layers, 128 heads, q-lora 1536,
# kv-lora 512, rope 64, nope 128, v 128, 256 routed experts top-8 in 8 groups top-4).
SHAPE = dict(hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=8,
             num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
             q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
             max_position_embeddings=4096, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
             norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", num_nextn_predict_layers=1)


def make_config(vocab: int, moe_ffn: int | None = None):
    from tessera.common.models.registry import model_config_from_hf

    shape = SHAPE if moe_ffn is None else {**SHAPE, "moe_intermediate_size": moe_ffn}
    return model_config_from_hf({**shape, "vocab_size": vocab}, "benchmark shape")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="Bytes of the cache pool.")
    p.add_argument("--speculative", default=None,
                   help="--speculative-config JSON of the second engine (none: plain serving only).")
    p.add_argument("--unabsorbed", action="store_true",
                   help="Also time an engine whose decode rows up-project the cached latents (as prefill does) "
                        "instead of attending with absorbed projections.")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="Serve every engine over N gloo worker processes; also prints the round trips to the "
                        "workers per engine step (a target forward, and with MTP one per draft).")
    p.add_argument("--expert-parallel", action="store_true",
                   help="With --tensor-parallel: also an engine with the routed experts split over the workers.")
    p.add_argument("--moe-ffn", type=int, default=None, help="Each routed expert's inner width (default: the shape's 128).")
    p.add_argument("--decode-batch-ab", action="store_true",
                   help="Also time an engine building every decode step with prepare (no persistent decode batch).")
    p.add_argument("--rounds", type=int, default=5, help="Timed rounds per engine (the median is reported).")
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="4 prompts x 8 tokens, one round (seconds).")
    args = p.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.smoke:
        args.num_prompts, args.prompt_len, args.max_tokens, args.rounds = 4, 32, 8, 1

    import serving

    from tessera.inference.config import EngineConfig, SpeculativeConfig
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.latent.runner import full_kv_bytes_per_token
    from tessera.inference.worker.loader import load_for_serving

    with tempfile.TemporaryDirectory() as tmp:
        ckpt, _ = serving.build_checkpoint(Path(tmp) / "run", "deepseek",
                                           lambda vocab: make_config(vocab, args.moe_ffn))
        dev, dtype = torch.device("cpu"), torch.float32
        loaded = load_for_serving(ckpt, dev, dtype, tensor_parallel=args.tensor_parallel)
        cfg = loaded.config
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
                   for _ in range(args.num_prompts)]
        base = dict(kv_cache_memory=args.kv_cache_memory, max_model_len=args.prompt_len + args.max_tokens + 16,
                    max_num_seqs=args.num_prompts, max_num_batched_tokens=2048, enable_prefix_caching=False,
                    tensor_parallel=args.tensor_parallel)
        engines = {"plain": LLMEngine(loaded, EngineConfig(**base), dev, dtype)}
        if args.speculative:
            spec = SpeculativeConfig(**json.loads(args.speculative))
            engines["spec"] = LLMEngine(loaded, EngineConfig(**base, speculative=spec), dev, dtype)
            if args.tensor_parallel > 1 and spec.method == "mtp":  # greedy drafts one round trip each, as sampled ones
                engines["k-trips"] = LLMEngine(loaded, EngineConfig(**base, speculative=spec), dev, dtype)
                engines["k-trips"].proposer.chain = False
        if args.expert_parallel:
            engines["ep"] = LLMEngine(loaded, EngineConfig(**base, enable_expert_parallel=True), dev, dtype)
        if args.unabsorbed:
            engines["unabs"] = LLMEngine(loaded, EngineConfig(**base), dev, dtype)
            engines["unabs"].runner.batch_decodes = False  # no decode groups: every row takes the prefill path
        if args.decode_batch_ab:
            engines["prepare"] = LLMEngine(loaded, EngineConfig(**base), dev, dtype)
            engines["prepare"].runner.keeps_decode_batch = lambda: False  # ModelRunner.execute asks the instance

        trips = {name: count_round_trips(engine) for name, engine in engines.items()}
        host = {name: time_host(engines[name]) for name in ("plain", "prepare") if name in engines}
        runner = engines["plain"].runner
        if args.tensor_parallel > 1:
            return race_tensor_parallel(args, engines, prompts, trips)
        pool_bytes = runner.kv.numel() * runner.kv.element_size()
        latent_tokens = runner.num_blocks * runner.block_size
        full_tokens = pool_bytes // full_kv_bytes_per_token(cfg, runner.kv.dtype)
        m = cfg.mla
        print(f"model: {cfg.num_params() / 1e6:.1f}M parameters ({cfg.num_layers} layers, {cfg.num_heads} heads, "
              f"kv_lora_rank {m.kv_lora_rank} + rope {m.qk_rope_head_dim}, head dims {m.qk_head_dim}/{m.v_head_dim}), "
              f"fp32, torch threads {torch.get_num_threads()}")
        print(f"cache: {pool_bytes / 2**20:.1f} MiB latent pool holds {latent_tokens} tokens "
              f"({pool_bytes // latent_tokens} B/token); as full K/V it would hold {full_tokens} "
              f"({full_kv_bytes_per_token(cfg, runner.kv.dtype)} B/token): {latent_tokens / full_tokens:.2f}x")
        print(f"  startup summary: {runner.state_summary()}")

        for engine in engines.values():  # warm-up (oneDNN primitives, allocator), not timed
            run_engine(engine, [q[:16] for q in prompts[:4]], 4)
        for h in host.values():
            h.update(steps=0, step_s=0.0, forward_s=0.0)
        raced = checked_race("deepseek_serving", engines, prompts, args.max_tokens, args.rounds, ("plain", "spec"))
        if raced is None:
            return 1
        rounds, outputs = raced
        total = {name: sum(secs) for name, secs in rounds.items()}
        tokens = args.rounds * args.num_prompts * args.max_tokens
        per_round = args.num_prompts * args.max_tokens
        best = {name: per_round / statistics.median(secs) for name, secs in rounds.items()}
        print(f"serving: {args.num_prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} greedy tokens each, "
              f"{args.rounds} round(s)")
        for name in engines:
            print(f"  {name:6s} {best[name]:9.1f} output tokens/s, median of rounds ({tokens / total[name]:.1f} over all "
                  f"{total[name]:.2f} s; rounds {', '.join(f'{x:.2f}' for x in rounds[name])} s)")
        if "unabs" in engines:  # the same math summed in another order: greedy ties may flip
            same = sum(a == b for x, y in zip(outputs["plain"], outputs["unabs"]) for a, b in zip(x, y))
            print(f"  absorbed decode {best['plain'] / best['unabs']:.2f}x the up-projected one (medians); "
                  f"{same} of {per_round} greedy tokens the same in the last round")
        if "prepare" in engines:
            same = outputs["plain"] == outputs["prepare"]
            print(f"  decode batch {best['plain'] / best['prepare']:.2f}x the per-step prepare (medians); outputs "
                  f"{'identical' if same else 'DIFFER'} in the last round")
            for name, h in host.items():
                print(f"  {name:7s} host ms per engine step (its wall less the layer stack's), over all rounds: "
                      f"{1e3 * (h['step_s'] - h['forward_s']) / h['steps']:.3f} ({h['steps']} steps)")
            if not same:
                return 1
        if "spec" in engines:
            print(f"  speedup {best['spec'] / best['plain']:.2f}x (medians; outputs identical); "
                  + spec_summary(engines["spec"]))
    return 0


def time_host(engine) -> dict:
    """From now on, the engine's steps, their seconds, and the seconds of its runner's layer stack
    (`_logits`: the forward and the head); the rest of a step is host work."""
    import time

    counts = {"steps": 0, "step_s": 0.0, "forward_s": 0.0}
    step, logits = engine.step, engine.runner._logits

    def timed_step():
        t = time.perf_counter()
        try:
            return step()
        finally:
            counts["steps"] += 1
            counts["step_s"] += time.perf_counter() - t

    def timed_logits(*a, **k):
        t = time.perf_counter()
        try:
            return logits(*a, **k)
        finally:
            counts["forward_s"] += time.perf_counter() - t
    engine.step, engine.runner._logits = timed_step, timed_logits
    return counts


def count_round_trips(engine) -> dict[str, int]:
    """Counts, from now on, of the engine's steps and (under tensor parallel) of the replies it
    waited for from the workers (each a round trip: the target's forward, each MTP forward)."""
    counts = {"steps": 0, "trips": 0}
    step = engine.step

    def counted_step():
        counts["steps"] += 1
        return step()
    engine.step = counted_step
    executor = getattr(engine.runner, "executor", None)
    if executor is not None:
        recv = executor.recv_logits

        def counted_recv(*a, **k):
            counts["trips"] += 1
            return recv(*a, **k)
        executor.recv_logits = counted_recv
    return counts


def race_tensor_parallel(args, engines: dict, prompts: list[list[int]], trips: dict) -> int:
    try:
        for engine in engines.values():  # warm-up, not timed
            run_engine(engine, [q[:16] for q in prompts[:4]], 4)
        for c in trips.values():
            c.update(steps=0, trips=0)
        raced = checked_race("deepseek_serving", engines, prompts, args.max_tokens, args.rounds, ("plain", "spec"))
        if raced is None:
            return 1
        rounds, outputs = raced
        if "k-trips" in outputs and outputs["k-trips"] != outputs["spec"]:
            print("deepseek_serving: the MTP engines' outputs differ (chained vs one round trip per draft)",
                  file=sys.stderr)
            return 1
        per_round = args.num_prompts * args.max_tokens
        print(f"serving, --tensor-parallel {args.tensor_parallel}: {args.num_prompts} prompts x {args.prompt_len} "
              f"tokens, {args.max_tokens} greedy tokens each, {args.rounds} round(s)")
        for name in engines:
            c = trips[name]
            print(f"  {name:6s} {per_round / statistics.median(rounds[name]):9.1f} output tokens/s (median; rounds "
                  f"{', '.join(f'{x:.2f}' for x in rounds[name])} s); {c['trips'] / max(c['steps'], 1):.2f} round "
                  f"trips per engine step ({c['trips']} / {c['steps']})")
        if "spec" in engines:
            print("  outputs identical; " + spec_summary(engines["spec"]))
        if "ep" in engines:  # the routed outputs summed in another order: greedy ties may flip
            same = sum(a == b for x, y in zip(outputs["plain"], outputs["ep"]) for a, b in zip(x, y))
            print(f"  experts split {statistics.median(rounds['plain']) / statistics.median(rounds['ep']):.2f}x the "
                  f"replicated ones (medians); {same} of {per_round} greedy tokens the same in the last round")
        return 0
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    sys.exit(main())
