"""Training throughput of a hybrid model: Tessera's train step vs transformers' NemotronHForCausalLM
of the same shape and weights (CPU, fp32, one process, steps alternating).

The shape is the `hybrid-tiny` preset widened (d=256, 8 layers, pattern M-M*M-ME: Mamba-2,
attention, MLP and MoE layers; --pattern, --hidden change it). transformers' model is made from
the config.json Tessera's HF adapter writes for that config, initialised at random and saved;
Tessera loads that save (`tessera-ckpt import`'s path), so both start from the same weights.
Both train on the same random token batches with the same AdamW hyper-parameters, clipping at
1.0 and mean next-token cross-entropy, sharing the loops of benchmarks/train_throughput.py:
Tessera runs the trainer's TrainStep (eager by default, as tessera-train; --compile as
training.compile), transformers the standard recipe (logits, F.cross_entropy, clip_grad_norm_,
fused AdamW). On CPU both run their PyTorch Mamba-2 scans (transformers' torch_forward without
mamba_ssm; Tessera's tessera.kernels references).

    python benchmarks/hybrid_training.py                      # prints tokens/s of each and the ratio
    python benchmarks/hybrid_training.py --steps 10 --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_race import race, twins  # noqa: E402

from tessera.common.models.hybrid.config import preset  # noqa: E402


def same_models(args: argparse.Namespace, root: Path):
    """(Tessera's model, transformers' model) of one shape with the same weights."""
    import transformers

    mamba = dict(num_heads=2 * args.hidden // 64, head_dim=64, state_size=64, num_groups=2, chunk_size=args.chunk,
                 dt_limit_min=0.001)
    cfg = preset("hybrid-tiny", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=len(args.pattern),
                 pattern=args.pattern, max_seq_len=args.seq, mamba=mamba, num_heads=args.hidden // 64,
                 num_kv_heads=max(1, args.hidden // 128), ffn_hidden_size=4 * args.hidden,
                 moe=dict(num_experts=8, top_k=2, ffn_hidden_size=args.hidden, score="sigmoid", num_shared_experts=1))
    return twins(cfg, transformers.NemotronHForCausalLM, root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pattern", default="M-M*M-ME")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64, help="Mamba chunk size (both frameworks)")
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
    print(f"hybrid {cfg.pattern} d={cfg.hidden_size} {cfg.num_params() / 1e6:.2f}M parameters, {args.batch}x{args.seq} "
          f"tokens per step, fp32, {args.threads} threads, {args.steps} alternating steps each")
    race(ours, hf, cfg.vocab_size, args, "NemotronHForCausalLM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
