"""Fixtures for the ckpt_convert tests (helpers live in ckpt_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ckpt_helpers import make_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")
