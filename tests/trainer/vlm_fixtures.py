"""Tiny image-text data and a tiny LLaVA config for the vision-language training tests (a uniquely
named module: every test folder has a conftest): coloured shapes drawn with Pillow, a caption naming
the shape as the answer, prepared by `tessera-data prep --format image-text` and blended."""

from __future__ import annotations

import io
import json
from pathlib import Path

import yaml

from tessera.data_prep.cli import entry as data_main

SHAPES = ("circle", "square", "triangle")
COLOURS = ("red", "green", "blue", "yellow")
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
IMAGE = 16  # pixels per side; patches of 8 -> 4 features per image (CLIP's class token dropped)


def shape_png(shape: str, colour: str, size: int = IMAGE, offset: int = 0) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    lo, hi = 2 + offset, size - 3 + offset
    if shape == "circle":
        draw.ellipse((lo, lo, hi, hi), fill=colour)
    elif shape == "square":
        draw.rectangle((lo, lo, hi, hi), fill=colour)
    else:
        draw.polygon([(size // 2 + offset, lo), (lo, hi), (hi, hi)], fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_tokenizer(directory: Path) -> Path:
    """A small BPE over the captions' words, with <image> a special token and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|pad|>", "<|eos|>", "<image>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = [f"<|user|>What shape is this? It is a {c} {s}.\n<|assistant|>" for s in SHAPES for c in COLOURS]
    tok.train_from_iterator(words * 10, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|eos|>", "pad_token": "<|pad|>", "chat_template": TEMPLATE}))
    return directory


def records(n: int, seed: int = 0, two_images_every: int = 0) -> tuple[dict[str, bytes], list[dict]]:
    """n LLaVA records of shapes (images by name) asking which shape; every `two_images_every`th
    record has two images and names both."""
    import random

    rng = random.Random(seed)
    images, out = {}, []
    for i in range(n):
        picks = [(rng.choice(SHAPES), rng.choice(COLOURS), rng.randint(-1, 1))
                 for _ in range(2 if two_images_every and i % two_images_every == 0 else 1)]
        names = []
        for j, (shape, colour, off) in enumerate(picks):
            name = f"{i}_{j}.png"
            images[name] = shape_png(shape, colour, offset=off)
            names.append(name)
        question = "<image>" * len(picks) + "What shape is this?"
        answer = " and ".join(f"a {shape}" for shape, _, _ in picks)
        out.append({"id": str(i), "image": names, "conversations": [
            {"from": "human", "value": question}, {"from": "gpt", "value": answer}]})
    return images, out


def image_text_data(root: Path, n: int = 48, seed: int = 0, two_images_every: int = 4,
                    train_samples: int = 256) -> dict[str, Path]:
    """tokenizer, shard prefix and blended mixture under root."""
    tokenizer = make_tokenizer(root / "tok")
    images, recs = records(n, seed, two_images_every)
    folder = root / "imgs"
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in images.items():
        (folder / name).write_bytes(data)
    (folder / "llava.json").write_text(json.dumps(recs))
    assert data_main(["prep", "--format", "image-text", "--input", str(folder / "llava.json"), "--tokenizer",
                      str(tokenizer), "--output-prefix", str(root / "shard" / "vl"), "--quiet"]) == 0
    prefix = root / "shard" / "vl_conversations_document"
    assert data_main(["blend", "--data", str(prefix), "--seq-length", "48", "--train-samples", str(train_samples),
                      "--split", "1,0,0", "--output", str(root / "mix"), "--quiet"]) == 0
    return {"tokenizer": tokenizer, "prefix": prefix, "mixture": root / "mix"}


def image_token_id(tokenizer: Path) -> int:
    from tessera.common.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer).token_id("<image>")


def vlm_model(tokenizer: Path, **over) -> dict:
    """A tiny LLaVA model section: CLIP tower 16 px / patch 8, a 2-layer Llama-style LM of width 32."""
    from tessera.common.tokenizer import load_tokenizer

    vocab = load_tokenizer(tokenizer).vocab_size
    return {"kind": "vision_language", "image_token_id": image_token_id(tokenizer), "vision_feature_layer": -1,
            "vision": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "ffn_hidden_size": 64,
                       "image_size": IMAGE, "patch_size": 8},
            "text": {"vocab_size": vocab, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2,
                     "ffn_hidden_size": 64, "max_seq_len": 64}, **over}


def vlm_config(data: dict[str, Path], root: Path, model: dict | None = None, **training) -> Path:
    cfg = {
        "run_dir": str(root / "run"),
        "model": model or vlm_model(data["tokenizer"]),
        "data": {"mixture": str(data["mixture"]), "tokenizer": str(data["tokenizer"])},
        "optim": {"lr": 3e-3, "min_lr": 3e-4},
        "schedule": {"kind": "cosine", "warmup_steps": 2},
        "training": {"global_batch_size": 8, "micro_batch_size": 4, "seq_length": 32, "steps": 4,
                     "log_interval": 1, "threads": 1, **training},
        "logging": {"tensorboard": False},
    }
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
