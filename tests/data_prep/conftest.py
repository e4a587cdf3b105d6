"""Fixtures for tessera-data tests: a small real corpus (stdlib source files) and a tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from dp_helpers import run, stdlib_texts, write_jsonl


@pytest.fixture(scope="session")
def corpus_texts() -> list[str]:
    return stdlib_texts()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, corpus_texts) -> Path:
    """A byte-level BPE trained by `tessera-data prep --train-tokenizer` (vocab 1024)."""
    d = tmp_path_factory.mktemp("tok")
    corpus = write_jsonl(d / "corpus.jsonl", [{"text": t} for t in corpus_texts])
    run(["prep", "--input", corpus, "--train-tokenizer", "--vocab-size", 1024, "--output-prefix", d / "out/base",
         "--quiet"])
    return d / "out" / "tokenizer"


@pytest.fixture(scope="session")
def base_shard(tokenizer_dir) -> Path:
    """The shard written alongside the trained tokenizer."""
    return tokenizer_dir.parent / "base_text_document"
