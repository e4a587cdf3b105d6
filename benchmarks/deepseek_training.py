"""Training throughput of a DeepSeek-V3-class model: Tessera's train step vs transformers'
DeepseekV3ForCausalLM of the same shape and weights (CPU, fp32, one process, steps alternating).

The shape (--hidden, --layers change it): d=256, 4 layers (the first dense), multi-head latent
attention with the query bottleneck (4 heads, q_lora 128, kv_lora 64, nope 32 + rope 16, v 32),
MoE of 16 experts top 4 in 4 groups (2 chosen) with one shared expert and sigmoid routing.
transformers' model is made from the config.json Tessera's HF adapter writes, initialised at
random and saved; Tessera loads that save (`tessera-ckpt import`'s path), so both start from the
same weights; the balancing bias and MTP stay off (transformers trains neither). Both train on
the same random batches with the same AdamW, clipping at 1.0 and mean next-token cross-entropy,
sharing the loops of benchmarks/train_throughput.py: Tessera the trainer's TrainStep (eager, as
tessera-train; --compile as training.compile), transformers the standard recipe.

    python benchmarks/deepseek_training.py                    # prints tokens/s of each and the ratio
    python benchmarks/deepseek_training.py --steps 10 --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_race import race, twins  # noqa: E402

from tessera.common.models.causal_lm.config import ModelConfig  # noqa: E402


def same_models(args: argparse.Namespace, root: Path):
    """(Tessera's model, transformers' model) of one shape with the same weights."""
    import transformers

    cfg = ModelConfig(arch="deepseek_v3", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                      num_heads=4, ffn_hidden_size=4 * args.hidden, max_seq_len=args.seq, norm_eps=1e-6,
                      mla=dict(q_lora_rank=args.hidden // 2, kv_lora_rank=args.hidden // 4, qk_nope_head_dim=32,
                               qk_rope_head_dim=16, v_head_dim=32),
                      moe=dict(num_experts=16, top_k=4, ffn_hidden_size=args.hidden // 2, first_k_dense=1,
                               score="sigmoid", routed_scaling_factor=2.5, num_shared_experts=1, num_groups=4,
                               topk_groups=2, bias_balancing=False))
    return twins(cfg, transformers.DeepseekV3ForCausalLM, root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per framework")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="Tessera's training.compile (forward + loss one graph)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, ours, hf = same_models(args, Path(tmp))
    print(f"deepseek_v3 {cfg.num_layers} layers d={cfg.hidden_size} {cfg.num_params() / 1e6:.2f}M parameters, "
          f"{args.batch}x{args.seq} "
          f"tokens per step, fp32, {args.threads} threads, {args.steps} alternating steps each")
    race(ours, hf, cfg.vocab_size, args, "DeepseekV3ForCausalLM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
