"""Fine-tune an imported Hugging Face model on chat data and serve it, on CPU: `python examples/finetune_chat.py`.

1. A Hugging Face Llama directory: yours (TESSERA_FINETUNE_HF_DIR, with tokenizer.json and a chat
   template), or else a random tiny one written by transformers with a small BPE tokenizer.
2. tessera-ckpt import: the directory becomes a Tessera checkpoint (vocabulary padded to 128).
3. Chat JSONL whose answers all follow one format ("ANSWER: <WORD>").
4. tessera-data prep --format chat: rendered with the tokenizer's chat template, answer tokens
   marked in a loss mask beside the tokens; tessera-data blend packs the conversations.
5. tessera-train from the imported weights (checkpoint.init_from), loss on the answers only,
   packed conversations kept apart (reset_attention_mask, reset_position_ids).
6. tessera-serve: a /v1/chat/completions request answers in the learned format.

Everything lands under .finetune/ (override with TESSERA_FINETUNE_DIR).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import yaml
from demo import BIN, banner, run, serve_and_generate

WORK = Path(os.environ.get("TESSERA_FINETUNE_DIR", Path(__file__).resolve().parent.parent / ".finetune"))
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "ocean", "maple", "ember", "frost", "lemon"]


def random_hf_model(out: Path) -> None:
    """A random tiny LlamaForCausalLM saved by transformers, with a BPE tokenizer and a chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([f"tell me about {w} ANSWER: {w.upper()}" for w in WORDS * 20], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, eos_token_id=0, bos_token_id=None))
    hf.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>", "chat_template": TEMPLATE}))


def chat_data(path: Path, n: int = 400) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            w = rng.choice(WORDS)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"tell me about {w}"},
                                             {"role": "assistant", "content": f"ANSWER: {w.upper()}"}]}) + "\n")


def main() -> None:
    start = time.time()
    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)

    banner("1/6 a Hugging Face model directory")
    hf_dir = Path(os.environ["TESSERA_FINETUNE_HF_DIR"]) if "TESSERA_FINETUNE_HF_DIR" in os.environ else WORK / "hf"
    if not hf_dir.exists():
        random_hf_model(hf_dir)
    print(f"hf model: {hf_dir}")

    banner("2/6 tessera-ckpt import")
    imported = WORK / "imported"
    run(BIN / "tessera-ckpt", "import", "--format", "hf", "--input", hf_dir, "--output", imported)

    banner("3/6 chat JSONL with a fixed answer format")
    data = WORK / "chat.jsonl"
    chat_data(data)
    print(f"chat data: {data}")

    banner("4/6 tessera-data prep --format chat + blend")
    tokenizer = imported / "iter_0000000" / "tokenizer"
    run(BIN / "tessera-data", "prep", "--format", "chat", "--input", data, "--tokenizer", tokenizer,
        "--output-prefix", WORK / "data" / "chat")
    mixture = WORK / "mixture"
    run(BIN / "tessera-data", "blend", "--data", WORK / "data" / "chat_messages_document", "--seq-length", "64",
        "--split", "1,0,0", "--train-samples", "1600", "--output", mixture)

    banner("5/6 tessera-train from the imported weights (loss on the answers)")
    sidecar = json.loads((imported / "iter_0000000" / "tessera_checkpoint.json").read_text())
    config = WORK / "finetune.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(WORK / "run"), "model": sidecar["model"],
        "data": {"mixture": str(mixture), "tokenizer": str(tokenizer), "valid_split": None,
                 "reset_attention_mask": True, "reset_position_ids": True},
        "checkpoint": {"init_from": str(imported)},
        "optim": {"lr": 3e-3, "min_lr": 3e-4}, "schedule": {"warmup_steps": 10},
        "training": {"steps": 100, "global_batch_size": 16, "micro_batch_size": 16, "seq_length": 64,
                     "log_interval": 20, "save_interval": 100},
        "logging": {"tensorboard": False}}))
    run(BIN / "tessera-train", "--config", config)

    banner("6/6 tessera-serve: /v1/chat/completions")
    messages = [{"role": "user", "content": "tell me about tiger"}]
    reply = serve_and_generate(WORK / "run" / "checkpoints", "/v1/chat/completions",
                               {"messages": messages, "max_tokens": 8, "temperature": 0.0})
    print(f"user:      {messages[0]['content']!r}\nassistant: {reply['choices'][0]['message']['content']!r}")
    print(f"\nfine-tune finished in {time.time() - start:.0f} s; artifacts under {WORK}")


if __name__ == "__main__":
    main()
