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

from tessera.inference.core.image_inputs import ImageLimits
from tessera.inference.entrypoints.server import ServerLimits

# LLaVA-1.5's template shape: each message's images first, then its text parts.
LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}{{ '<image>\n' }}{% endif %}{% endfor %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] + ' ' }}{% endif %}{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
SIZE, PATCH = 32, 8
# The serving tests' limits: small enough that an image over 20 kB or a third image is refused.
LIMITS = ServerLimits(max_prompt_tokens=200, max_tokens=32, max_body_bytes=200_000,
                      images=ImageLimits(max_images=2, max_bytes=20_000, max_pixels=100_000))


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


def chat_message(text: str, images: list[bytes]) -> list[dict]:
    """One OpenAI user message: the images as data-URL parts, then the text."""
    parts = [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def hf_chat_message(text: str, n: int) -> list[dict]:
    """The same message as the processor's chat template takes it: n image slots, then the text."""
    return [{"role": "user", "content": [*[{"type": "image"}] * n, {"type": "text", "text": text}]}]


def concurrent_image_replies(url: str, text: str, images: list[bytes], max_tokens: int) -> list[str]:
    """The greedy replies to one request per image, all sent at once to the server at `url`."""
    import asyncio

    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")

    async def ask(image: bytes) -> str:
        r = await client.chat.completions.create(model="tiny", messages=chat_message(text, [image]),
                                                 max_tokens=max_tokens, temperature=0)
        return r.choices[0].message.content

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(ask(b) for b in images))

    return asyncio.run(all_of_them())


def check_image_keyed_prefix_cache(server, model, processor, text: str, max_tokens: int) -> tuple[str, str]:
    """The same text after another image hits no cached block (the image's tokens sit in the first
    block, so its key and every later one differ) and equals transformers; after the same image it
    hits and replies as before. Returns the replies to the first and to the other image."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")

    def ask(image: bytes) -> tuple[str, int]:
        before = server.engine.blocks.prefix_hits
        out = client.chat.completions.create(model="tiny", messages=chat_message(text, [image]),
                                             max_tokens=max_tokens, temperature=0).choices[0].message.content
        assert server.wait_idle()
        return out, server.engine.blocks.prefix_hits - before

    first, _ = ask(png(21))
    other, hits = ask(png(22))
    assert hits == 0
    assert other == hf_greedy_chat(model, processor, hf_chat_message(text, 1), [png(22)], max_tokens)
    again, hits = ask(png(21))
    assert hits > 0 and again == first
    return first, other
