"""Vision-language training throughput: Tessera's step vs transformers' LlavaForConditionalGeneration.

Both train the same LLaVA (CLIP ViT tower + projector + Llama; transformers makes it with a seed,
Tessera reads the same weights through the vision-language kind's Hugging Face adapter rules), on
the same batches (each row: one image's features over its image tokens, then text; the loss on the
second half of the text, as answers), AdamW, gradient clipping at 1.0, fp32, the same threads, in
one process, steps alternating so load from other jobs hits both alike.

- Tessera runs the trainer's own step: tessera.trainer.objectives.multimodal.loss.VisionLanguageStep
  (TrainStep's accumulate, clip and step) with the optimizer of build_optimizer.
- transformers runs the standard recipe: `model(input_ids, pixel_values, labels).loss` (its labels
  shifted inside), clip_grad_norm_(foreach), torch.optim.AdamW(fused).

Prints text tokens/s of each (median over the timed steps; image tokens included in the count,
as both models run them through the language model), the ratio and each one's loss after the
steps (same start, same data: they agree to a few digits).

    python benchmarks/vlm_training.py            # CPU-sized defaults

With --packing it compares Tessera's step on the same samples (one image each, text of random
length) unpacked (one sample per row of --row tokens, padded, as data.pack_samples=false gives)
and packed (several whole samples per row, positions and attention per sample: the trainer's own
tessera.trainer.objectives.multimodal.packing), and prints useful (non-padding) tokens/s of each and the ratio.

    python benchmarks/vlm_training.py --packing
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

IMAGE_TOKEN = 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vision-hidden", type=int, default=128)
    p.add_argument("--vision-layers", type=int, default=2)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--patch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--text", type=int, default=64, help="text tokens per row besides the image's")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="timed steps per framework")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--packing", action="store_true", help="Tessera packed vs unpacked instead of vs transformers")
    p.add_argument("--row", type=int, default=512, help="--packing: tokens per row (training.seq_length)")
    p.add_argument("--samples", type=int, default=64, help="--packing: samples per pass (text 16 to 2 x --text tokens)")
    p.add_argument("--rounds", type=int, default=3, help="--packing: passes per mode, alternating; the median counts")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from tessera.common.models.registry import kind_for_hf
    from tessera.common.models.vision_language.hf.adapter import model_config_from_hf
    from tessera.trainer.components.optimizer.optim import build_optimizer
    from tessera.trainer.components.precision.mixed import Precision
    from tessera.trainer.config import OptimConfig
    from tessera.trainer.objectives.multimodal.batches import VisionLanguageBatch
    from tessera.trainer.objectives.multimodal.loss import VisionLanguageStep

    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=args.vision_hidden, intermediate_size=4 * args.vision_hidden,
                              num_hidden_layers=args.vision_layers, num_attention_heads=4,
                              image_size=args.image_size, patch_size=args.patch)
    text = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                       max_position_embeddings=1024)
    hf = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                                                   vision_feature_layer=-2)).train()
    data = json.loads(hf.config.to_json_string(use_diff=False))
    data["architectures"] = ["LlavaForConditionalGeneration"]
    kind = kind_for_hf(data, "config.json")
    cfg = model_config_from_hf(data, "config.json")
    hf_sd = hf.state_dict()
    rules, _ = kind.hf().import_rules(cfg, set(hf_sd))
    ours = kind.build(cfg, seed=None)
    ours.load_state_dict({r.target: (r.combine or (lambda ts: ts[0]))([hf_sd[s] for s in r.sources]) for r in rules},
                         strict=False)
    ours.train()
    step = VisionLanguageStep(ours, build_optimizer(ours, OptimConfig(lr=1e-4, weight_decay=0.0)),
                              Precision("fp32", torch.device("cpu")), 1.0)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)

    if args.packing:
        packing_comparison(args, step, cfg.image_seq_len)
        return
    n_img = cfg.image_seq_len
    seq = n_img + args.text + 1
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(10, args.vocab, (args.batch, seq), generator=gen)
        tokens[:, 1:1 + n_img] = IMAGE_TOKEN
        pixels = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=gen)
        labels = tokens[:, 1:].clone()
        labels[:, : n_img + args.text // 2] = -100  # image and "prompt": not targets
        batches.append((tokens, pixels, labels))

    def tessera_step(b) -> float:
        tokens, pixels, labels = b
        inputs = VisionLanguageBatch(tokens[:, :-1], pixels[:, None], torch.ones(len(tokens), dtype=torch.int64))
        loss, _, _ = step([(inputs, labels)], 1, torch.device("cpu"))
        return float(loss.detach())

    def hf_step(b) -> float:
        tokens, pixels, labels = b
        hf_opt.zero_grad(set_to_none=True)
        full = torch.cat([torch.full_like(labels[:, :1], -100), labels], dim=1)  # transformers shifts inside
        loss = hf(input_ids=tokens, pixel_values=pixels, labels=full).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0, foreach=True)
        hf_opt.step()
        return float(loss.detach())

    times: dict[str, list[float]] = {"tessera": [], "transformers": []}
    last: dict[str, float] = {}
    for i, b in enumerate(batches):
        for name, fn in (("tessera", tessera_step), ("transformers", hf_step)):
            t0 = time.perf_counter()
            last[name] = fn(b)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    tokens_per_step = args.batch * (seq - 1)
    rate = {k: tokens_per_step / statistics.median(v) for k, v in times.items()}
    print(f"LLaVA: CLIP d={args.vision_hidden} L={args.vision_layers} {args.image_size}px/{args.patch} "
          f"({n_img} image tokens) + Llama d={args.hidden} L={args.layers} vocab {args.vocab}; "
          f"batch {args.batch} x {seq - 1} tokens, threads {torch.get_num_threads()}")
    for k in rate:
        print(f"{k:>12}: {rate[k]:8.0f} tokens/s (median of {len(times[k])} steps), loss after {last[k]:.4f}")
    print(f"ratio tessera / transformers: {rate['tessera'] / rate['transformers']:.2f}x")


def packing_comparison(args: argparse.Namespace, step, n_img: int) -> None:
    """Useful tokens/s of one pass over the same samples, unpacked vs packed (same step, same rows' width)."""
    import numpy as np

    from tessera.trainer.objectives.multimodal.batches import VisionLanguageBatch
    from tessera.trainer.objectives.multimodal.packing import SamplePacking, pack_row, stack_rows

    rng = np.random.default_rng(1)
    samples = []  # (ids with the image expanded, counted) : image first, then a prompt and an answer
    for _ in range(args.samples):
        text = int(rng.integers(16, 2 * args.text + 1))
        ids = np.concatenate([np.full(n_img, IMAGE_TOKEN), rng.integers(10, args.vocab, text + 1)])
        counted = np.zeros(len(ids), dtype=bool)
        counted[n_img + text // 2:] = True
        samples.append((ids, counted))
    if max(len(ids) - 1 for ids, _ in samples) > args.row:
        raise SystemExit(f"--row {args.row} is shorter than the longest sample; raise it")
    pixels = torch.randn(args.samples, 3, args.image_size, args.image_size, generator=torch.Generator().manual_seed(2))
    lengths = np.array([len(ids) - 1 for ids, _ in samples])
    # past the pass, a full row's length closes the last row
    packing = SamplePacking(lambda ns: np.where(ns < len(lengths), lengths[np.minimum(ns, len(lengths) - 1)],
                                                args.row), args.row)
    layouts = {"unpacked": [range(n, n + 1) for n in range(args.samples)], "packed": []}
    while not layouts["packed"] or layouts["packed"][-1].stop < args.samples:
        layouts["packed"].append(packing.row(len(layouts["packed"])))

    def batches(rows: list[range], packed: bool) -> list:
        out = []
        for at in range(0, len(rows), args.batch):
            chunk = rows[at:at + args.batch]
            packs = [pack_row([samples[n] for n in r], args.row) for r in chunk]
            counts = torch.tensor([len(r) for r in chunk])
            images = torch.zeros(len(chunk), int(counts.max()), 3, args.image_size, args.image_size)
            for i, r in enumerate(chunk):
                images[i, :len(r)] = pixels[r.start:r.stop]
            extra = {k: stack_rows(packs, k) for k in ("positions", "document_ids")} if packed else {}
            out.append((VisionLanguageBatch(stack_rows(packs, "tokens"), images, counts, **extra),
                        stack_rows(packs, "labels")))
        return out

    work = {name: batches(rows, name == "packed") for name, rows in layouts.items()}
    useful = int(lengths.sum())
    for name in work:  # warm-up: one step each
        step([work[name][0]], 1, torch.device("cpu"))
    seconds: dict[str, list[float]] = {name: [] for name in work}
    for _ in range(args.rounds):
        for name, todo in work.items():
            t0 = time.perf_counter()
            for b in todo:
                step([b], 1, torch.device("cpu"))
            seconds[name].append(time.perf_counter() - t0)
    print(f"packing: {args.samples} samples of {n_img} image + 16..{2 * args.text} text tokens "
          f"({useful} useful tokens), rows of {args.row}, batch {args.batch}, threads {torch.get_num_threads()}")
    rate = {}
    for name, rows in layouts.items():
        rate[name] = useful / statistics.median(seconds[name])
        fill = useful / (len(rows) * args.row)
        print(f"{name:>9}: {len(rows):3d} rows ({fill:.0%} useful), {rate[name]:8.0f} useful tokens/s "
              f"(median of {args.rounds} passes)")
    print(f"ratio packed / unpacked: {rate['packed'] / rate['unpacked']:.2f}x")


if __name__ == "__main__":
    main()
