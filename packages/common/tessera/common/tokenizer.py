"""Loading a Hugging Face tokenizer directory, and its fingerprint.

A tokenizer artifact is a directory with `tokenizer.json` (the `tokenizers` library's format)
and `tokenizer_config.json` (special tokens, chat template, as transformers writes it). The chat
template is read from either place transformers keeps it: `chat_template.jinja` (what
transformers >= 4.50 saves) or `tokenizer_config.json`'s `chat_template` (older saves); the
file wins when both exist, as in transformers. Its
fingerprint is the SHA-256 of `tokenizer.json`; shards, mixtures and checkpoints record it and
stages refuse to combine artifacts with different fingerprints.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.common.errors import ArtifactError
from tessera.common.fileio import artifact_path, holds_only, read_json, sha256_file

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_KIND = "tokenizer folder (tokenizer.json)"
# vocab.txt: a WordPiece (BERT) tokenizer's own vocabulary, carried along for tools that read it;
# spiece.model: T5's SentencePiece model likewise (copied as bytes, never parsed here).
# preprocessor_config.json: a vision-language model's image processor (tessera.common.models.
# vision_language.processor reads it), carried with the text processor as transformers keeps them.
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, "special_tokens_map.json", CHAT_TEMPLATE_FILE, "vocab.txt",
                   "preprocessor_config.json", "spiece.model")


def tokenizer_fingerprint(directory: str | os.PathLike) -> str:
    path = artifact_path(directory, TOKENIZER_JSON)
    if not path.is_file():
        raise ArtifactError(f"{path}: tokenizer.json not found; pass a Hugging Face tokenizer directory")
    return "sha256:" + sha256_file(path)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass
class Tokenizer:
    """A loaded tokenizer plus the special-token facts every stage needs."""

    directory: Path
    backend: Any  # tokenizers.Tokenizer
    fingerprint: str
    config: dict[str, Any] = field(default_factory=dict)
    chat_template_file: str | None = None  # the text of chat_template.jinja, when the directory has one

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token(self) -> str | None:
        return _token_content(self.config.get("eos_token"))

    @property
    def bos_token(self) -> str | None:
        return _token_content(self.config.get("bos_token"))

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.bos_token)

    @property
    def pad_id(self) -> int | None:
        return self.token_id(_token_content(self.config.get("pad_token")))

    @property
    def chat_template(self) -> str | list[dict[str, str]] | None:
        """The template source (or tokenizer_config.json's list of named templates)."""
        return self.chat_template_file or self.config.get("chat_template")

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens (callers add BOS/EOD explicitly)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | os.PathLike) -> None:
        """Copy the tokenizer files into `directory` (used by checkpoints and exports)."""
        copy_tokenizer_files(self.directory, directory)


def copy_tokenizer_files(source: str | os.PathLike, directory: str | os.PathLike) -> None:
    """Copy a tokenizer folder's files (TOKENIZER_FILES, those present, each only from inside
    `source`) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        src = artifact_path(source, name)
        if src.is_file():
            shutil.copyfile(src, directory / name)


def check_tokenizer_files(directory: str | os.PathLike) -> None:
    """Refuse (one line) a tokenizer folder any of whose files leads outside it (fileio.artifact_path),
    before any is read."""
    for name in TOKENIZER_FILES:
        artifact_path(directory, name)


def is_tokenizer_directory(path: Path) -> bool:
    """A folder with a tokenizer.json and nothing but tokenizer files: what a trained tokenizer's
    --overwrite may replace."""
    return (path / TOKENIZER_JSON).is_file() and holds_only(path, lambda name: name in TOKENIZER_FILES)


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer directory; any problem is a one-line ArtifactError naming the file."""
    from tokenizers import Tokenizer as HFTokenizer

    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: tokenizer directory not found")
    check_tokenizer_files(directory)
    path = artifact_path(directory, TOKENIZER_JSON)
    fingerprint = tokenizer_fingerprint(directory)
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises plain Exceptions
        raise ArtifactError(f"{path}: not a valid Hugging Face tokenizer.json ({str(exc).splitlines()[0]})") from None
    config: dict[str, Any] = {}
    cfg_path = artifact_path(directory, TOKENIZER_CONFIG)
    if cfg_path.is_file():
        config = read_json(cfg_path, "tokenizer config")
        if not isinstance(config, dict):
            raise ArtifactError(f"{cfg_path}: expected a JSON object")
    template_path = artifact_path(directory, CHAT_TEMPLATE_FILE)
    template = None
    if template_path.is_file():
        try:
            template = template_path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ArtifactError(f"{template_path}: not UTF-8 text; a chat template is a Jinja text file") from None
    return Tokenizer(directory=directory, backend=backend, fingerprint=fingerprint, config=config,
                     chat_template_file=template)


def check_tokenizer_fits(tokenizer: Tokenizer, vocab_size: int, model: str) -> None:
    """The tokenizer's ids all index the model's vocabulary (`vocab_size`, stated by `model`: the file
    that says it); ids past it would index rows the model does not have. Every reader that pairs a
    tokenizer with a model checks this: import, verify, export, serving."""
    if tokenizer.vocab_size > vocab_size:
        raise ArtifactError(f"{tokenizer.directory}: tokenizer has {tokenizer.vocab_size} tokens but the model "
                            f"({model}) only {vocab_size}; they do not belong together")
