"""Vision-language serving benchmark: tessera-serve's chat API with one image per request vs
transformers' LlavaForConditionalGeneration.generate with its LlavaProcessor, same random model
directory, same images and prompts, same machine, same run.

Builds a random LLaVA directory at start (CLIP ViT tower, default d=128, 4 layers, 112 px images in
16 px patches: 49 image tokens; a Llama d=256, 4 layers; trained BPE tokenizer with `<image>`; a
LLaVA chat template; CLIPImageProcessor config), starts `tessera-serve` on it (engine in its own
process, as users run it), then per round, alternating which runs first:
  - tessera: N chat requests, each with its own PNG as a data URL, `--concurrency` in flight,
    streamed through the openai client, greedy, `--output-len` tokens (ignore_eos): TTFT per
    request (first content chunk) and output tokens/s over the whole batch;
  - transformers: the same N requests one at a time (processor, then generate), TTFT as the time
    of a generate of one token, tokens/s as output tokens over the time of full generates.
Prints both, their ratio per round, and whether the first request's text is the same in both.

    .venv/bin/python benchmarks/vlm_serving.py --requests 16 --concurrency 8 --output-len 32 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}{{ '<image>\n' }}{% endif %}{% endfor %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] + ' ' }}{% endif %}{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def build(d: Path, vision_d: int, text_d: int, layers: int, image: int, patch: int) -> None:
    import inspect
    import textwrap

    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [inspect.getsource(m) for m in (textwrap, json.decoder, json.encoder, argparse)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken("<image>", normalized=False, special=True)])
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": TEMPLATE,
                                                         "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(hidden_size=vision_d, intermediate_size=4 * vision_d, num_hidden_layers=layers,
                                           num_attention_heads=vision_d // 32, image_size=image, patch_size=patch)
    lm = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=text_d, intermediate_size=3 * text_d,
                                  num_hidden_layers=layers, num_attention_heads=text_d // 64, num_key_value_heads=2,
                                  max_position_embeddings=1024)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=lm, image_token_id=tok.token_to_id("<image>"))
    transformers.LlavaForConditionalGeneration(cfg).eval().save_pretrained(d)
    transformers.CLIPImageProcessor(size={"shortest_edge": image},
                                    crop_size={"height": image, "width": image}).save_pretrained(d)


def pngs(n: int, side: int) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (side, side + side // 4, 3), dtype=np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


async def run_tessera(url: str, images: list[bytes], prompt: str, output_len: int, concurrency: int):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(image: bytes) -> tuple[float, str, int]:
        url_ = "data:image/png;base64," + base64.b64encode(image).decode()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url_}},
                                                 {"type": "text", "text": prompt}]}]
        async with gate:
            start = time.perf_counter()
            ttft, text, n = None, "", 0
            stream = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=output_len, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and ttft is None:
                    ttft = time.perf_counter() - start
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    n = chunk.usage.completion_tokens
            return ttft or (time.perf_counter() - start), text, n

    start = time.perf_counter()
    results = await asyncio.gather(*(one(b) for b in images))
    seconds = time.perf_counter() - start
    return seconds, [r[0] for r in results], [r[1] for r in results], sum(r[2] for r in results)


def run_hf(model, processor, images: list[bytes], prompt: str, output_len: int):
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ttfts, texts, seconds = [], [], 0.0
    for image in images:
        start = time.perf_counter()
        inputs = processor(text=text, images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=0)
        ttfts.append(time.perf_counter() - start)
        start = time.perf_counter()
        inputs = processor(text=text, images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                 pad_token_id=0)
        seconds += time.perf_counter() - start
        texts.append(processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    return seconds, ttfts, texts, output_len * len(images)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vision-hidden", type=int, default=128)
    p.add_argument("--text-hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--patch-size", type=int, default=16)
    args = p.parse_args()
    import httpx
    import transformers

    prompt = "Describe the picture in a few words."
    images = pngs(args.requests, 160)
    with tempfile.TemporaryDirectory(prefix="tessera-vlm-bench-") as tmp:
        d = Path(tmp) / "llava"
        build(d, args.vision_hidden, args.text_hidden, args.layers, args.image_size, args.patch_size)
        model = transformers.LlavaForConditionalGeneration.from_pretrained(d).eval()
        processor = transformers.LlavaProcessor(
            image_processor=transformers.AutoImageProcessor.from_pretrained(d),
            tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json")),
            patch_size=args.patch_size, vision_feature_select_strategy="default", num_additional_image_tokens=1,
            chat_template=TEMPLATE)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        log = open(Path(tmp) / "serve.log", "w")
        server = subprocess.Popen([sys.executable, "-c", "from tessera.inference.entrypoints.serve_cli import entry; entry()",
                                   "--checkpoint", str(d), "--port", str(port), "--served-model-name", "m", "--quiet",
                                   "--max-num-seqs", str(args.concurrency)], stderr=log, start_new_session=True)
        try:
            deadline = time.time() + 600
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.time() > deadline:
                    print(Path(log.name).read_text(), file=sys.stderr)
                    return 1
                time.sleep(0.5)
            params = sum(v.numel() for v in model.state_dict().values())
            print(f"LLaVA CLIP d={args.vision_hidden} + Llama d={args.text_hidden}, {args.layers} layers each "
                  f"({params / 1e6:.1f}M params), {args.image_size} px images ({(args.image_size // args.patch_size) ** 2} "
                  f"image tokens), {args.requests} requests x 1 image, {args.output_len} output tokens, "
                  f"concurrency {args.concurrency}, torch threads here {torch.get_num_threads()}, "
                  f"load average {os.getloadavg()[0]:.1f}")
            asyncio.run(run_tessera(url, images[:2], prompt, 4, 2))  # warm-up
            ratios = []
            for r in range(args.rounds):
                order = ["tessera", "hf"] if r % 2 == 0 else ["hf", "tessera"]
                got = {}
                for who in order:
                    if who == "tessera":
                        got[who] = asyncio.run(run_tessera(url, images, prompt, args.output_len, args.concurrency))
                    else:
                        got[who] = run_hf(model, processor, images, prompt, args.output_len)
                rate = {w: got[w][3] / got[w][0] for w in got}
                ttft = {w: statistics.median(got[w][1]) * 1e3 for w in got}
                ratios.append(rate["tessera"] / rate["hf"])
                same = got["tessera"][2][0] == got["hf"][2][0]
                print(f"round {r + 1} ({' first, '.join(order)} second): output tok/s tessera-serve "
                      f"{rate['tessera']:.1f} vs transformers {rate['hf']:.1f}: {ratios[-1]:.2f}x; TTFT p50 "
                      f"{ttft['tessera']:.0f} ms (at concurrency {args.concurrency}) vs {ttft['hf']:.0f} ms (alone); "
                      f"first reply identical: {same}; load average {os.getloadavg()[0]:.1f}")
            print(f"median ratio {statistics.median(ratios):.2f}x")
        finally:
            server.terminate()
            server.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
