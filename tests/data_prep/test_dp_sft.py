"""`tessera-data prep --format chat|prompt-completion`: fine-tuning shards with a loss mask beside
the tokens, which Megatron's reader still reads as plain tokens; bad records are one line (exit 2)
or skipped and counted."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from dp_helpers import run, user_error, write_jsonl

from tessera.common.errors import ArtifactError
from tessera.common.fileio import sha256_file
from tessera.common.indexed_dataset import IndexedDataset
from tessera.common.shard import mask_path, open_loss_mask, read_shard_manifest
from tessera.common.tokenizer import load_tokenizer

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture
def chat_tokenizer(tokenizer_dir, tmp_path):
    """The session tokenizer with a chat template added."""
    d = tmp_path / "chat_tok"
    shutil.copytree(tokenizer_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return d


def test_prompt_completion_masks_exactly_the_completion_and_megatron_reads_the_tokens(tokenizer_dir, tmp_path):
    records = [{"prompt": f"def f{i}(x):\n", "completion": f"    return x * {i}\n"} for i in range(30)]
    data = write_jsonl(tmp_path / "pc.jsonl", records)
    assert run(["prep", "--format", "prompt-completion", "--input", data, "--tokenizer", tokenizer_dir,
                "--output-prefix", tmp_path / "pc", "--quiet"]) == 0
    prefix = tmp_path / "pc_completion_document"
    manifest = read_shard_manifest(prefix)
    assert manifest.loss_mask and manifest.checksums["mask"] == sha256_file(mask_path(prefix))
    ds = IndexedDataset(prefix)  # the Megatron MMIDIDX reader: tokens only, the mask file is not its concern
    tok = load_tokenizer(tokenizer_dir)
    mask = open_loss_mask(prefix, ds.num_tokens)
    for d, rec in enumerate(records):
        start, n = ds.document_range(d)
        ids, m = ds.document_tokens(d), mask[start:start + n]
        assert tok.decode(ids.tolist()) == rec["prompt"] + rec["completion"]
        assert tok.decode(ids[m == 1].tolist()) == rec["completion"]  # + the counted eos (a special token)
        assert m[-1] == 1 and ids[-1] == manifest.eod_id


def test_chat_masks_the_assistant_turns(chat_tokenizer, tmp_path):
    rec = {"messages": [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
                        {"role": "assistant", "content": "ciao"}]}
    data = write_jsonl(tmp_path / "chat.jsonl", [rec])
    assert run(["prep", "--format", "chat", "--input", data, "--tokenizer", chat_tokenizer,
                "--output-prefix", tmp_path / "c", "--quiet"]) == 0
    prefix = tmp_path / "c_messages_document"
    ds, tok = IndexedDataset(prefix), load_tokenizer(chat_tokenizer)
    mask = open_loss_mask(prefix, ds.num_tokens)
    ids = ds.document_tokens(0)
    answer = tok.decode(ids[mask == 1].tolist())
    assert answer == "hello\nciao\n"  # the turns' content and their closing newline, nothing of the prompts
    assert tok.decode(ids[mask == 0].tolist()) == "<|system|>terse\n<|user|>hi\n<|assistant|><|user|>bye\n<|assistant|>"


def test_chat_record_without_an_assistant_turn_is_one_line_or_skipped_and_counted(chat_tokenizer, tmp_path, capsys):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    bad = {"messages": [{"role": "user", "content": "only a question"}]}
    data = write_jsonl(tmp_path / "chat.jsonl", [good, bad, good])
    argv = ["prep", "--format", "chat", "--input", data, "--tokenizer", chat_tokenizer, "--output-prefix",
            tmp_path / "c", "--quiet"]
    line = user_error(argv + ["--on-error", "fail"], capsys)
    assert f"{data}:2:" in line and "no assistant turn" in line
    assert not list(tmp_path.glob("c_messages_document*"))  # nothing half-written
    assert run(argv) == 0  # --on-error skip (the default)
    skipped = read_shard_manifest(tmp_path / "c_messages_document").skipped
    assert skipped["total"] == 1 and skipped["examples"][0]["line"] == 2
    assert read_shard_manifest(tmp_path / "c_messages_document").num_documents == 2


def test_chat_format_needs_a_chat_template(tokenizer_dir, tmp_path, capsys):
    plain = tmp_path / "plain_tok"
    shutil.copytree(tokenizer_dir, plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": []}])
    line = user_error(["prep", "--format", "chat", "--input", data, "--tokenizer", plain,
                       "--output-prefix", tmp_path / "c", "--quiet"], capsys)
    assert "no chat template" in line and str(plain) in line


def test_a_changed_loss_mask_is_refused_by_readers(tokenizer_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}] * 3)
    assert run(["prep", "--format", "prompt-completion", "--input", data, "--tokenizer", tokenizer_dir,
                "--output-prefix", tmp_path / "pc", "--quiet"]) == 0
    prefix = tmp_path / "pc_completion_document"
    raw = bytearray(mask_path(prefix).read_bytes())
    raw[0] ^= 1
    mask_path(prefix).write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="mask.bin: sha256 does not match"):
        open_loss_mask(prefix, IndexedDataset(prefix).num_tokens)
    line = user_error(["verify", prefix], capsys)
    assert "mask.bin: sha256 does not match" in line
    assert np.frombuffer(raw, dtype=np.uint8).size == IndexedDataset(prefix).num_tokens
