"""Fine-tuning data: chat (`messages`) and prompt/completion JSONL -> loss-masked shards.

`tessera-data prep --format chat` renders each record's `messages` with the tokenizer's own chat
template (tessera.common.chat_template, the renderer the server uses, so a model is trained on
the prompt layout it is served with) and marks the characters of every assistant turn: for turn
i, the text the template adds between `messages[:i]` with the generation prompt and
`messages[:i+1]` (the answer and whatever closes it, e.g. an end-of-turn token). The text is
tokenized piece by piece, context and answers apart, so the boundaries are exact (one BPE token
never straddles prompt and answer) and the first prompt is tokenized as the server tokenizes it,
the answer as generated tokens; answer tokens get loss-mask 1, all others 0. (Rejected: one
tokenization of the whole text with the mask from character offsets: a token such as "\n    "
spanning the prompt's last newline and the answer's indentation then belongs to neither.)
`--format prompt-completion`
takes `prompt` and `completion`: two strings (the completion's characters are the answer), or two
lists of messages (conversational, rendered as above).

Each record becomes one document (+ the end-of-document token, counted when the record ends with
an answer, so the model learns to stop); the blend packs documents into samples as for
pretraining, and `data.reset_attention_mask` / `reset_position_ids` keep packed conversations
apart. The mask is written beside the tokens as `<prefix>.mask.bin` (tessera.common.shard).

A record that cannot be used (no assistant turn, a message that is not {role, content}, a
template that fails, a rendering longer than the renderer's size limit) is skipped and counted,
or with `--on-error fail` stops the run (one line, exit 2). A template that runs past the
renderer's time, loop or memory limit (tessera.common.chat_template.RenderLimits, the server's
defaults) stops the run in any case: the template itself is broken or hostile, and every record
would cost as much.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from tessera.common.chat_template import ChatTemplateError, ChatTemplateLimit, render_chat
from tessera.common.errors import UserError
from tessera.common.indexed_dataset import token_dtype_for_vocab
from tessera.common.progress import progress
from tessera.common.tokenizer import Tokenizer
from tessera.data_prep.shard_writer import ShardSetWriter, parse_max_shard_size
from tessera.data_prep.sources import InputFile, read_json_objects

SFT_FORMATS = ("chat", "prompt-completion")
OUTPUT_KEY = {"chat": "messages", "prompt-completion": "completion", "image-text": "conversations"}  # <prefix>_<key>_document
BATCH_RECORDS = 1024


class BadRecord(ValueError):
    """A record that cannot become a training example (the reason is the message)."""


def _messages(value: Any, field: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRecord(f"{field!r} is not a non-empty list of messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRecord(f"{field}[{i}] is not a message {{\"role\": str, \"content\": str}}")
    return value


def answer_spans(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character ranges of its assistant turns."""
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("chat record has no assistant turn (nothing to train on)")
    try:
        text = render_chat(tokenizer, messages, add_generation_prompt=False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
            through = render_chat(tokenizer, messages[:i + 1], add_generation_prompt=False)
            if not (through.startswith(prompt) and text.startswith(through)):
                raise BadRecord(f"the chat template does not render assistant turn {i} as a continuation of its "
                                "prompt, so its tokens cannot be told apart")
            spans.append((len(prompt), len(through)))
    except ChatTemplateLimit as exc:
        if exc.limit != "max_chars":
            raise UserError(f"{tokenizer.directory}: {exc}; the tokenizer's chat template cannot be used") from None
        raise BadRecord(str(exc)) from None
    except ChatTemplateError as exc:
        raise BadRecord(str(exc)) from None
    return text, spans


class SftEncoder:
    """One JSON record -> (token ids, loss mask), both int arrays of one document."""

    def __init__(self, tokenizer: Tokenizer, fmt: str, bos_id: int | None, eod_id: int | None):
        self.tokenizer, self.fmt, self.bos_id, self.eod_id = tokenizer, fmt, bos_id, eod_id

    def _text(self, obj: Any) -> tuple[str, list[tuple[int, int]]]:
        if not isinstance(obj, dict):
            raise BadRecord(f"not a JSON object (got {type(obj).__name__})")
        if self.fmt == "chat":
            if "messages" not in obj:
                raise BadRecord("missing key 'messages'")
            return answer_spans(self.tokenizer, _messages(obj["messages"], "messages"))
        for key in ("prompt", "completion"):
            if key not in obj:
                raise BadRecord(f"missing key {key!r}")
        prompt, completion = obj["prompt"], obj["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion.strip():
                raise BadRecord("empty 'completion' (nothing to train on)")
            return prompt + completion, [(len(prompt), len(prompt) + len(completion))]
        if isinstance(prompt, list) and isinstance(completion, list):  # conversational
            return answer_spans(self.tokenizer, _messages(prompt, "prompt") + _messages(completion, "completion"))
        raise BadRecord("'prompt' and 'completion' must both be strings or both lists of messages")

    def encode(self, obj: Any) -> tuple[np.ndarray, np.ndarray]:
        text, spans = self._text(obj)
        pieces, flags, pos = [], [], 0
        for lo, hi in spans:
            pieces += [text[pos:lo], text[lo:hi]]
            flags += [0, 1]
            pos = hi
        pieces.append(text[pos:])
        flags.append(0)
        encoded = self.tokenizer.backend.encode_batch(pieces, add_special_tokens=False)
        ids = np.asarray([i for e in encoded for i in e.ids], dtype=np.int64)
        mask = np.asarray([f for e, f in zip(encoded, flags) for _ in e.ids], dtype=np.uint8)
        if not mask.any():
            raise BadRecord("the answer renders to no tokens (empty assistant content)")
        if self.bos_id is not None:
            ids, mask = np.concatenate([[self.bos_id], ids]), np.concatenate([[0], mask]).astype(np.uint8)
        if self.eod_id is not None:  # counted when the document ends with an answer: the model learns to stop
            ends_with_answer = spans[-1][1] >= len(text.rstrip())
            ids = np.concatenate([ids, [self.eod_id]])
            mask = np.concatenate([mask, [1 if ends_with_answer else 0]]).astype(np.uint8)
        return ids, mask


def check_sft_inputs(inputs: list[InputFile], fmt: str, tokenizer: Tokenizer) -> None:
    """What can be refused before reading: non-JSONL inputs, a chat format without a chat template."""
    for inp in inputs:
        if inp.kind != "jsonl":
            raise UserError(f"{inp.path}: --format {fmt} reads JSON Lines (.jsonl[.gz|.zst]) only")
    if fmt == "chat" and not tokenizer.chat_template:
        raise UserError(f"{tokenizer.directory}: tokenizer has no chat template (chat_template.jinja or "
                        "tokenizer_config.json chat_template) to render --format chat records with")


def write_sft_shards(cfg: Any, inputs: list[InputFile], tokenizer: Tokenizer, skips: Any, base: Path,
                     bos_id: int | None, eod_id: int | None) -> tuple[ShardSetWriter, int, int]:
    """Encode every record into one loss-masked shard set at `base`; returns (writer, documents,
    tokens). The caller commits or aborts the writer."""
    check_sft_inputs(inputs, cfg.format, tokenizer)
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    max_tokens = parse_max_shard_size(cfg.max_shard_size, dtype.itemsize) if cfg.max_shard_size else None
    writer = ShardSetWriter(base, dtype, max_tokens, loss_mask=True)
    encoder = SftEncoder(tokenizer, cfg.format, bos_id, eod_id)
    docs = tokens = 0
    started = time.perf_counter()
    batch: list[tuple[np.ndarray, np.ndarray]] = []

    def flush() -> None:
        if batch:
            lengths = np.asarray([len(t) for t, _ in batch], dtype=np.int32)
            writer.add(np.concatenate([t for t, _ in batch]).astype(dtype), lengths,
                       np.concatenate([m for _, m in batch]))
            batch.clear()

    bar = progress(total=sum(i.size for i in inputs) or None, desc=f"rendering {cfg.format}", unit="B",
                   unit_scale=True, quiet=cfg.quiet, mininterval=0.5)
    try:
        with bar:
            for inp in inputs:
                for line, obj, error in read_json_objects(inp, bar.update):
                    inp.records += 1
                    try:
                        if error is not None:
                            raise BadRecord(error)
                        ids, mask = encoder.encode(obj)
                    except BadRecord as exc:
                        skips.add(inp.path, line, str(exc))
                        continue
                    batch.append((ids, mask))
                    docs += 1
                    tokens += len(ids)
                    if len(batch) >= BATCH_RECORDS:
                        flush()
                    bar.set_postfix(docs=docs, tok_s=f"{tokens / max(time.perf_counter() - started, 1e-9):,.0f}",
                                    refresh=False)
        flush()
    except BaseException:
        writer.abort()
        raise
    return writer, docs, tokens
