"""SentencePiece `.model`, tiktoken BPE and BERT `vocab.txt` files -> a Hugging Face tokenizer
directory, at prep time.

Tessera's stages load `tokenizer.json` only (tessera.common.tokenizer). Tokenizers released in the
original formats — a SentencePiece model (Llama 2, T5, Gemma) or a tiktoken BPE file (Llama 3's
original `tokenizer.model`, OpenAI encodings) — are converted once, when `tessera-data prep
--tokenizer FILE` is given a file instead of a directory, with the converters transformers
maintains for its own fast tokenizers (`transformers.convert_slow_tokenizer`): `SpmConverter`
(`LlamaConverter` for models with byte fallback) and `TikTokenConverter`. No conversion code of
our own: those converters are what every HF tokenizer of these models was made with.

The format is decided by the content, not the name (Llama 3's tiktoken file is called
`tokenizer.model`): lines of `<base64 token> <rank>` are tiktoken, anything else must parse as a
SentencePiece model. A tiktoken file holds no split pattern and no special tokens: the pattern is
the cl100k / Llama 3 one unless `--tiktoken-pattern` gives another, and `<|endoftext|>` is added
after the ranks as end-of-document (eos) token.

Needs `sentencepiece` (and protobuf) or `tiktoken`, and transformers: the extras
`tessera-data-prep[spm]` / `[tiktoken]`.

A BERT `vocab.txt` (one WordPiece token per line, the id is the line number, `[UNK]` among them)
becomes the tokenizer `tokenizers`' own `BertWordPieceTokenizer` builds from it, with BERT's
normalizer; the file says nothing about case, so it is uncased (lowercase and strip accents, as
bert-base-uncased) unless some ordinary token has an upper-case letter, or `--lowercase` /
`--no-lowercase` says otherwise.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import json
from pathlib import Path

from tessera.common.errors import UserError
from tessera.common.fileio import atomic_directory, ensure_output_dir
from tessera.data_prep.tokenizer_train import add_sentinels

EOD_TOKEN = "<|endoftext|>"
CL100K_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def _need(module: str, extra: str, path: Path):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{path}: converting this tokenizer needs {module.split('.')[0]}; install "
                        f"tessera-data-prep[{extra}]") from None


def is_tiktoken_file(path: Path) -> bool:
    """True when the first lines are `<base64 bytes> <int rank>` (tiktoken's BPE format)."""
    with open(path, "rb") as f:
        head = f.read(4096).splitlines()[:8]
    if not head:
        return False
    for line in head:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            return False
        try:
            base64.b64decode(parts[0], validate=True)
        except (binascii.Error, ValueError):
            return False
    return True


class _SentencePieceSource:
    """What transformers' SentencePiece converters read of a slow tokenizer: the model file, its
    pieces, and Llama's legacy flags (prepend a space, as sentencepiece's add_dummy_prefix does)."""

    def __init__(self, path: Path, processor):
        self.vocab_file = str(path)
        self.sp = processor
        self.legacy = True
        self.add_prefix_space = True

    def convert_ids_to_tokens(self, index: int) -> str:
        return self.sp.id_to_piece(index)


def convert_sentencepiece(path: Path):
    """(tokenizers.Tokenizer, config fields) from a SentencePiece `.model`."""
    spm = _need("sentencepiece", "spm", path)
    _need("google.protobuf", "spm", path)
    hf = importlib.import_module("transformers.convert_slow_tokenizer")  # the package re-exports a function by that name

    class Extractor(hf.SentencePieceExtractor):
        # transformers 5's SpmConverter calls `extract(vocab_scores)` on its extractor, whose base
        # class now takes a model type instead (a mismatch inside transformers 5.x): this is the
        # Gemma extractor's body (merges ordered by piece score), without its tab workaround.
        def extract(self, vocab_scores=None):  # type: ignore[override]
            vocab = {p.piece: i for i, p in enumerate(self.proto.pieces)}
            return vocab, hf.generate_merges(vocab, vocab_scores)

    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except Exception as exc:
        raise UserError(f"{path}: neither a tiktoken BPE file nor a SentencePiece model "
                        f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    source = _SentencePieceSource(path, sp)
    base = hf.SpmConverter
    if sp.IsByte(sp.piece_to_id("<0x00>")) if sp.get_piece_size() > 3 else False:
        base = hf.LlamaConverter  # byte fallback (Llama 2 style): unknown bytes become <0xNN> pieces
    backend = type("Converter", (base,), {"SpmExtractor": Extractor})(source).converted()
    fields = {}
    for key, index in (("unk_token", sp.unk_id()), ("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()),
                       ("pad_token", sp.pad_id())):
        if 0 <= index < sp.get_piece_size():
            fields[key] = sp.id_to_piece(index)
    return backend, fields


def convert_tiktoken(path: Path, pattern: str):
    _need("tiktoken", "tiktoken", path)
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(path), pattern=pattern, extra_special_tokens=[EOD_TOKEN]).converted()
    return backend, {"eos_token": EOD_TOKEN, "pad_token": EOD_TOKEN}


MAX_VOCAB_TXT_BYTES = 64 << 20


def wordpiece_vocab(path: Path) -> list[str] | None:
    """The tokens of a BERT vocab.txt, or None when `path` is not one (a line with inner
    whitespace, not UTF-8 text, or no [UNK])."""
    if path.stat().st_size > MAX_VOCAB_TXT_BYTES:
        return None
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return None
    tokens = [line.strip() for line in lines]
    if "[UNK]" not in tokens or any(not t or len(t.split()) != 1 for t in tokens):
        return None
    return tokens


def convert_wordpiece(path: Path, tokens: list[str], lowercase: bool | None):
    """What `tokenizers`' BertWordPieceTokenizer assembles from a vocab.txt (WordPiece model, BERT's
    normalizer and pre-tokenizer, the specials the vocabulary has declared special, the
    `[CLS] A [SEP]` template), built here so a vocabulary without [CLS]/[SEP] still converts."""
    from tokenizers import Tokenizer, models

    from tessera.data_prep.tokenizer_train import (
        WORDPIECE_SPECIALS,
        bert_pipeline,
        bert_post_processor,
        wordpiece_config,
    )

    if lowercase is None:  # cased vocabularies hold upper-case tokens; uncased ones cannot
        lowercase = not any(ch.isupper() for t in tokens if not (t.startswith("[") and t.endswith("]")) for ch in t)
    if len(set(tokens)) != len(tokens):
        dup = next(t for i, t in enumerate(tokens) if t in tokens[:i])
        raise UserError(f"{path}: token {dup!r} appears twice; a vocab.txt lists each token once")
    backend = Tokenizer(models.WordPiece({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    backend.add_special_tokens([v for v in WORDPIECE_SPECIALS.values() if v in tokens])
    bert_pipeline(backend, lowercase)
    if "[CLS]" in tokens and "[SEP]" in tokens:
        bert_post_processor(backend)
    fields = {k: v for k, v in wordpiece_config(0, lowercase).items() if k != "model_max_length"}
    missing = [v for v in WORDPIECE_SPECIALS.values() if v not in tokens]
    for key in [k for k, v in WORDPIECE_SPECIALS.items() if v in missing]:
        fields.pop(key)  # a token the vocabulary lacks is not declared (the trainer names what it needs)
    return backend, fields


def convert_tokenizer(source: Path, out: Path, model_max_length: int, pattern: str | None = None,
                      lowercase: bool | None = None, extra_ids: int = 0) -> Path:
    """Write `out/` (tokenizer.json + tokenizer_config.json) converted from the file `source`;
    `extra_ids` sentinels appended as T5's tokenizer appends them to its spiece.model."""
    if not source.is_file():
        raise UserError(f"{source}: tokenizer file not found")
    vocab = wordpiece_vocab(source)
    if vocab is not None:
        if pattern is not None:
            raise UserError(f"--tiktoken-pattern: {source} is not a tiktoken BPE file")
        backend, fields = convert_wordpiece(source, vocab, lowercase)
        kind = "wordpiece"
    elif lowercase is not None:
        raise UserError(f"--lowercase/--no-lowercase: {source} is not a WordPiece vocab.txt (it applies to those "
                        "and to --tokenizer-type wordpiece)")
    elif is_tiktoken_file(source):
        backend, fields = convert_tiktoken(source, pattern or CL100K_PATTERN)
        kind = "tiktoken"
    else:
        if pattern is not None:
            raise UserError(f"--tiktoken-pattern: {source} is not a tiktoken BPE file")
        backend, fields = convert_sentencepiece(source)
        kind = "sentencepiece"
    add_sentinels(backend, extra_ids)
    ensure_output_dir(out.parent, "--tokenizer-output")
    # Written whole and swapped in: with --overwrite (prep checked `out` is a tokenizer folder) an
    # earlier tokenizer's other files (its chat_template.jinja, special_tokens_map.json) must not
    # stay beside the converted one and be read as its own.
    with atomic_directory(out, overwrite=True) as tmp:
        backend.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length, **fields,
            "converted_from": {"path": str(source), "format": kind}}, indent=2, sort_keys=True) + "\n")
        if kind == "wordpiece":  # BERT's own file beside it, as transformers saves a BertTokenizer
            (tmp / "vocab.txt").write_text("".join(t + "\n" for t in vocab or []), encoding="utf-8")
    return out
