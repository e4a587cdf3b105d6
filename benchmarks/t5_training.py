"""Span-corruption training throughput: Tessera's span step vs transformers' T5ForConditionalGeneration.

Both train the same T5 (transformers makes it with a seed; Tessera reads the same weights through
the encoder-decoder kind's Hugging Face adapter), on the same corrupted batches (T5's span
corruption of random token windows, the trainer's own corruption code), with AdamW (fused where
available), gradient clipping at 1.0, fp32, dropout 0, the same threads, in one process, steps
alternating so load from other jobs hits both alike.

- Tessera runs the trainer's own step: tessera.trainer.objectives.span.loss.SpanStep (TrainStep's accumulate,
  clip and step), the optimizer of build_optimizer.
- transformers runs the standard recipe: `model(input_ids, attention_mask, labels).loss`,
  clip_grad_norm_(foreach), torch.optim.AdamW(fused).

Prints tokens/s of each (encoder input + decoder target tokens per step over the median step
time), their ratio, and each one's loss after the steps (the same start and data: they agree to a
few digits).

    python benchmarks/t5_training.py                       # CPU-sized defaults (T5 v1.1 shape, small)
    python benchmarks/t5_training.py --variant t5 --d-model 768 --d-kv 64 --d-ff 3072 --layers 12 --heads 12
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
import torch
from peer_race import hf_recipe_step, report
from train_throughput import time_interleaved


def batches(n: int, batch: int, enc: int, dec: int, vocab: int, extra: int, eos: int, seed: int = 0):
    from tessera.trainer.objectives.draws import sample_rng
    from tessera.trainer.objectives.span.batches import SpanBatch
    from tessera.trainer.objectives.span.corruption import SpanOptions, build_sample, raw_length

    opts = SpanOptions(0.15, 3.0, enc, dec)
    raw = raw_length(opts)
    sentinels = np.arange(vocab - 1, vocab - 1 - extra, -1)
    out = []
    for i in range(n):
        samples = []
        for j in range(batch):
            rng = sample_rng(seed, i * batch + j)
            window = rng.integers(2, vocab - extra, raw)
            samples.append(build_sample(window, opts, sentinels, eos, 0, 0, rng))

        def stack(name: str) -> torch.Tensor:
            return torch.from_numpy(np.stack([getattr(s, name) for s in samples]))  # noqa: B023
        out.append((SpanBatch(stack("tokens"), stack("padding_mask"), stack("decoder_tokens")), stack("labels")))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=["t5", "v1_1"], default="v1_1")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-kv", type=int, default=64)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4, help="encoder and decoder blocks each")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--enc", type=int, default=128, help="encoder input length")
    p.add_argument("--dec", type=int, default=32, help="decoder target length")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10, help="timed steps per framework")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", nargs="?", const="blocks", default=None, choices=["blocks", "model"],
                   help="Tessera's step with training.compile, per block (the default scope) or as one graph")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from tessera.common.hf.directory import load_hf_weights, read_hf_config
    from tessera.common.models.registry import kind_of
    from tessera.trainer.components.optimizer.optim import build_optimizer
    from tessera.trainer.components.precision.mixed import Precision
    from tessera.trainer.config import OptimConfig
    from tessera.trainer.objectives.span.loss import SpanStep

    v11 = args.variant == "v1_1"
    torch.manual_seed(0)
    hf_cfg = transformers.T5Config(vocab_size=args.vocab, d_model=args.d_model, d_kv=args.d_kv, d_ff=args.d_ff,
                                   num_layers=args.layers, num_heads=args.heads, dropout_rate=0.0,
                                   feed_forward_proj="gated-gelu" if v11 else "relu", tie_word_embeddings=not v11,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    hf = transformers.T5ForConditionalGeneration(hf_cfg).train()
    if v11:  # T5 v1.1's own head (transformers 5 ties it unless the saved one differs)
        hf.lm_head.weight = torch.nn.Parameter(hf.shared.weight.detach().clone() * args.d_model ** -0.5)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        cfg, _ = read_hf_config(tmp)
        ours = kind_of(cfg).build(cfg, seed=None)
        ours.load_state_dict(load_hf_weights(tmp, cfg), strict=True)
    ours.train()
    optim = OptimConfig(lr=1e-4, weight_decay=0.01)
    step = SpanStep(ours, build_optimizer(ours, optim), Precision("fp32", torch.device("cpu")), 1.0,
                    compile=args.compile or False)
    def hf_loss(model, inputs, labels) -> torch.Tensor:
        return model(input_ids=inputs.tokens, attention_mask=inputs.padding_mask, labels=labels).loss

    def tessera_step(inputs, labels) -> torch.Tensor:
        loss, _, _ = step([(inputs, labels)], 1, torch.device("cpu"))
        return loss.detach()

    steps = {"tessera": tessera_step, "transformers": hf_recipe_step(hf, hf_loss, 1e-4, (0.9, 0.95))}
    data = batches(args.warmup + args.steps, args.batch, args.enc, args.dec, args.vocab, extra=100, eos=1)
    print(f"T5 {args.variant} d={args.d_model} d_kv={args.d_kv} ff={args.d_ff} L={args.layers}+{args.layers} "
          f"heads={args.heads} vocab={args.vocab} enc={args.enc} dec={args.dec} batch={args.batch}, fp32, "
          f"{torch.get_num_threads()} threads, {args.steps} timed steps after {args.warmup}"
          f"{f', tessera compiled ({args.compile})' if args.compile else ''}")
    report(time_interleaved(steps, data, args.warmup, args.steps, lambda: None), args.batch * (args.enc + args.dec),
           "T5ForConditionalGeneration")

if __name__ == "__main__":
    main()
