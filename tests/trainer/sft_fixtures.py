"""Fine-tuning fixtures: a tokenizer with a chat template and chat JSONL whose every answer has one
fixed format, prepared with `tessera-data prep --format chat` and blended with `tessera-data blend`."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tessera.data_prep.cli import entry as data_cli

# Generation prompt after the turns, as real templates have: the answer span of turn i is then
# exactly its content and closing <|end|>.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "ocean", "maple", "ember", "frost", "lemon"]
FORMAT = "ANSWER: "


def make_chat_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"{w} {FORMAT}{w.upper()} tell me about" for w in WORDS * 20], trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|eos|>", "pad_token": "<|eos|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 256}))
    return directory


def chat_record(word: str, system: bool = False) -> dict:
    messages = [{"role": "system", "content": "be brief"}] if system else []
    messages += [{"role": "user", "content": f"tell me about {word}"},
                 {"role": "assistant", "content": f"{FORMAT}{word.upper()}"}]
    return {"messages": messages}


def write_chat_jsonl(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps(chat_record(rng.choice(WORDS), system=i % 3 == 0)) + "\n")
    return path


def prep_chat_mixture(root: Path, n: int = 200, seq_length: int = 32, train_samples: int = 400) -> tuple[Path, Path]:
    """(tokenizer dir, mixture dir) of `n` chat records."""
    tok = make_chat_tokenizer(root / "tok")
    data = write_chat_jsonl(root / "chat.jsonl", n)
    assert data_cli(["prep", "--format", "chat", "--input", str(data), "--tokenizer", str(tok),
                     "--output-prefix", str(root / "sft"), "--quiet"]) == 0
    assert data_cli(["blend", "--data", str(root / "sft_messages_document"), "--seq-length", str(seq_length),
                     "--split", "1,0,0", "--train-samples", str(train_samples), "--output", str(root / "mix"),
                     "--quiet"]) == 0
    return tok, root / "mix"
