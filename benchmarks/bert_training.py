"""Masked-LM training throughput: Tessera's MLM step vs transformers' BertForPreTraining.

Both train the same BERT (transformers makes it with a seed; Tessera reads the same weights through
the encoder kind's Hugging Face adapter), on the same masked batches (15% of the tokens labelled,
token types, sentence-order targets), with AdamW (fused where available), gradient clipping at
1.0, fp32, dropout 0.1, the same threads, in one process, steps alternating so load from other
jobs hits both alike.

- Tessera runs the trainer's own step: tessera.trainer.objectives.mlm.loss.MLMStep (TrainStep's accumulate,
  clip and step; the MLM + sentence-order loss), the optimizer of build_optimizer.
- transformers runs the standard recipe: `model(input_ids, token_type_ids, attention_mask,
  labels, next_sentence_label).loss`, clip_grad_norm_(foreach), torch.optim.AdamW(fused).

Prints tokens/s of each (median over the timed steps), their ratio and each one's loss after the
steps (the same start and data: they should agree to a few digits, dropout masks aside).
`--full-head` makes Tessera compute the MLM logits at every position as transformers does (the
trainer computes them at the masked positions only): the comparison of the models alone.

    python benchmarks/bert_training.py                    # CPU-sized defaults
    python benchmarks/bert_training.py --hidden 768 --layers 12 --heads 12 --ffn 3072 --vocab 30522
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from peer_race import hf_recipe_step, report
from train_throughput import time_interleaved


def batches(n: int, batch: int, seq: int, vocab: int, mask_id: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(5, vocab, (batch, seq), generator=gen)
        chosen = torch.rand(tokens.shape, generator=gen) < 0.15
        chosen[:, 1] = True  # at least one label per row
        labels = torch.where(chosen, tokens, -100)
        inputs = torch.where(chosen, mask_id, tokens)
        types = torch.zeros_like(tokens)
        types[:, seq // 2:] = 1
        padding = torch.ones_like(tokens)
        order = torch.randint(0, 2, (batch,), generator=gen)
        out.append((inputs, types, padding, order, labels))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10, help="timed steps per framework")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", nargs="?", const="blocks", default=None, choices=["blocks", "model"],
                   help="Tessera's step with training.compile, per block (the default scope) or as one graph")
    p.add_argument("--full-head", action="store_true", help="Tessera's MLM logits at every position")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from tessera.common.hf.directory import load_hf_weights, read_hf_config
    from tessera.common.models.registry import kind_of
    from tessera.trainer.components.optimizer.optim import build_optimizer
    from tessera.trainer.components.precision.mixed import Precision
    from tessera.trainer.config import OptimConfig
    from tessera.trainer.objectives.mlm.batches import MLMBatch
    from tessera.trainer.objectives.mlm.loss import MLMStep, mlm_loss

    torch.manual_seed(0)
    hf_cfg = transformers.BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                     num_attention_heads=args.heads, intermediate_size=args.ffn,
                                     max_position_embeddings=max(512, args.seq), attn_implementation="sdpa")
    hf = transformers.BertForPreTraining(hf_cfg).train()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        cfg, _ = read_hf_config(tmp)
        ours = kind_of(cfg).build(cfg, seed=None)
        ours.load_state_dict(load_hf_weights(tmp, cfg), strict=True)
    ours.train()
    optim = OptimConfig(lr=1e-4, weight_decay=0.01, beta2=0.999)
    step = MLMStep(ours, build_optimizer(ours, optim), Precision("fp32", torch.device("cpu")), 1.0,
                   compile=args.compile or False)
    if args.full_head:
        def full(inputs, labels, reduction):
            out = ours(inputs.tokens, token_types=inputs.token_types, attention_mask=inputs.padding_mask)
            return mlm_loss(out, labels, inputs.binary_labels, reduction)
        step._mlm = full
    def hf_loss(model, inputs, types, padding, order, labels) -> torch.Tensor:
        return model(input_ids=inputs, token_type_ids=types, attention_mask=padding, labels=labels,
                     next_sentence_label=order).loss

    def tessera_step(inputs, types, padding, order, labels) -> torch.Tensor:
        loss, _, _ = step([(MLMBatch(inputs, types, padding, order), labels)], 1, torch.device("cpu"))
        return loss.detach()

    steps = {"tessera": tessera_step, "transformers": hf_recipe_step(hf, hf_loss, 1e-4, (0.9, 0.999))}
    data = batches(args.warmup + args.steps, args.batch, args.seq, args.vocab, mask_id=4)
    print(f"BERT d={args.hidden} L={args.layers} heads={args.heads} ffn={args.ffn} vocab={args.vocab} "
          f"seq={args.seq} batch={args.batch}, fp32, {torch.get_num_threads()} threads, "
          f"{args.steps} timed steps after {args.warmup}{f', tessera compiled ({args.compile})' if args.compile else ''}"
          f"{', tessera full head' if args.full_head else ''}")
    report(time_interleaved(steps, data, args.warmup, args.steps, lambda: None), args.batch * args.seq,
           "BertForPreTraining")

if __name__ == "__main__":
    main()
