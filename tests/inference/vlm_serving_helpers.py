"""Tiny random LLaVA models (CLIP + Llama, SigLIP + Qwen2) saved as Hugging Face directories with a
tokenizer holding `<image>`, a LLaVA chat template and the image processor's config, and
transformers' own processor and greedy `generate` over them: the reference the server must equal."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import torch
from inference_helpers import train_tokenizer

# LLaVA-1.5's template shape: each message's images first, then its text parts.
LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}{{ '<image>\n' }}{% endif %}{% endfor %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] + ' ' }}{% endif %}{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
SIZE, PATCH = 32, 8


def png(seed: int, size: int = 40) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size + 8, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def make_llava_dir(root: Path, tower: str = "clip", size: int = SIZE, text_hidden: int = 48,
                   weight_std: float | None = None, vocab: int = 300) -> Path:
    """A saved HF Llava directory (tokenizer, template, processor config) reading `size`-pixel images.
    `weight_std`: every matrix drawn at that std instead of transformers' 0.02, so that the image
    decides the greedy reply (at 0.02 a tiny model answers every image alike)."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    out = root / f"llava-{tower}"
    train_tokenizer(out, vocab_size=vocab)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<image>", normalized=False, special=True)])
    tok.save(str(out / "tokenizer.json"))
    image_id = tok.token_to_id("<image>")
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAVA_TEMPLATE}))
    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=size,
                  patch_size=PATCH)
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=text_hidden, intermediate_size=2 * text_hidden, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if tower == "clip":
        vision, lm = transformers.CLIPVisionConfig(**common), transformers.LlamaConfig(**text)
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    else:
        vision, lm = transformers.SiglipVisionConfig(**common), transformers.Qwen2Config(**text)
        processor = transformers.SiglipImageProcessor(size={"height": size, "width": size})
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=lm, image_token_id=image_id,
                                   vision_feature_select_strategy="default" if tower == "clip" else "full",
                                   vision_feature_layer=-2 if tower == "clip" else -1)
    model = transformers.LlavaForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.2)
            elif weight_std is not None:
                p.normal_(0.0, weight_std)
    model.eval().save_pretrained(out)
    processor.save_pretrained(out)
    return out


def hf_reference(directory: Path):
    """(transformers' model, its LlavaProcessor) for `directory`."""
    import transformers

    model = transformers.LlavaForConditionalGeneration.from_pretrained(directory).eval()
    cfg = model.config
    image_processor = transformers.AutoImageProcessor.from_pretrained(directory)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH, chat_template=LLAVA_TEMPLATE,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        num_additional_image_tokens=1 if cfg.vision_config.model_type == "clip_vision_model" else 0)
    return model, processor


def hf_greedy_chat(model, processor, messages: list[dict], images: list[bytes], max_new_tokens: int) -> str:
    """transformers' greedy reply to `messages` ({"type": "image"} parts) with these images."""
    from PIL import Image

    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(text=text, images=pil or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
