"""`tessera-data prep`: corpus -> (tokenizer) -> `<prefix>_<key>_document` shards with manifests.

One pass over the inputs (two when a tokenizer is trained first). Records stream from the
readers into batches; batches are tokenized in order (see `encode`); tokens go straight to the
shard writers. Bad records are counted and located (file and line) and, with `--on-error fail`,
stop the run before anything is published.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from tessera.common.config import StrictModel
from tessera.common.errors import UserError
from tessera.common.fileio import (
    check_replaceable,
    check_replaceable_files,
    ensure_output_dir,
    refuse_replacing_inputs,
    tmp_name,
)
from tessera.common.indexed_dataset import bin_path, idx_path, token_dtype_for_vocab
from tessera.common.models.vision_language.image_shard import image_store_prefix
from tessera.common.models.vision_language.processor import DEFAULT_MAX_PIXELS
from tessera.common.progress import progress
from tessera.common.shard import SHARD_KIND, ShardInput, is_shard_file
from tessera.common.tokenizer import (
    TOKENIZER_JSON,
    TOKENIZER_KIND,
    Tokenizer,
    is_tokenizer_directory,
    load_tokenizer,
)
from tessera.data_prep.encode import BatchEncoder, EncodedBatch, OrderedEncoder
from tessera.data_prep.multimodal.image_text import write_image_text_shards
from tessera.data_prep.sentences import check_splitter
from tessera.data_prep.sft import OUTPUT_KEY, write_sft_shards
from tessera.data_prep.shard_writer import ShardSetWriter, output_prefixes, parse_max_shard_size
from tessera.data_prep.sources import (
    InputFile,
    Record,
    check_inputs,
    hf_fingerprint,
    read_records,
    resolve_inputs,
)
from tessera.data_prep.tokenizer_convert import convert_tokenizer
from tessera.data_prep.tokenizer_train import (
    EOD_TOKEN,
    add_sentinels,
    save_tokenizer,
    save_wordpiece,
    train_bpe,
    train_wordpiece,
)

MAX_EXAMPLES_IN_MANIFEST = 1000  # exact counts always; locations of the first this many skips


class PrepConfig(StrictModel):
    """Everything `tessera-data prep` does, validated before any work starts."""

    format: Literal["text", "chat", "prompt-completion", "image-text"] = Field(
        "text", description="Input records: text under --json-keys (pretraining), fine-tuning data with a loss mask "
        "(tessera.data_prep.sft), or image-text conversations (tessera.data_prep.multimodal).")
    image_folder: Path | None = Field(None, description="image-text: folder that LLaVA JSON image paths are relative "
                                      "to (default: the JSON file's folder).")
    image_token: str = Field("<image>", min_length=1, description="image-text: the tokenizer's image placeholder "
                             "token; one stands for each image in the text.")
    max_image_pixels: int = Field(DEFAULT_MAX_PIXELS, ge=1, description="image-text: an image with more pixels "
                                  "(width x height, read from its header) is refused.")
    inputs: list[str] = Field(min_length=1, description="Input files, folders or globs (JSONL[.gz|.zst], Parquet, "
                              "plain text, Hugging Face datasets folders).")
    json_keys: list[str] = Field(["text"], min_length=1, description="Keys (columns) holding the text; one output "
                                 "shard set per key, named <prefix>_<key>_document.")
    output_prefix: Path = Field(description="Output prefix; shards are <prefix>_<key>_document.bin/.idx/.json.")
    tokenizer: Path | None = Field(None, description="Existing Hugging Face tokenizer directory (tokenizer.json), or "
                                   "a SentencePiece .model / tiktoken BPE file, converted into --tokenizer-output "
                                   "first (tessera.data_prep.tokenizer_convert).")
    tiktoken_pattern: str | None = Field(None, description="Split regex of a tiktoken --tokenizer file (default: "
                                         "cl100k's, which Llama 3 uses).")
    train_tokenizer: bool = Field(False, description="Train a tokenizer (--tokenizer-type) on the inputs first.")
    tokenizer_type: Literal["bpe", "wordpiece"] = Field("bpe", description="Trained tokenizer: byte-level BPE "
                                                        "(decoders), or WordPiece with BERT's normalizer and "
                                                        "[PAD] [UNK] [CLS] [SEP] [MASK] (encoders).")
    lowercase: bool | None = Field(None, description="WordPiece: lowercase and strip accents (uncased BERT). "
                                   "Default: true when training; for a vocab.txt, whether it has no upper-case "
                                   "tokens.")
    vocab_size: int = Field(32000, ge=8, description="Vocabulary size of a trained tokenizer (with special tokens); "
                            "a byte-level BPE needs at least 258.")
    extra_ids: int = Field(0, ge=0, le=1000, description="Sentinel tokens <extra_id_0>.. added to a trained or "
                           "converted tokenizer as its last ids, <extra_id_0> last (T5's span corruption; T5's "
                           "spiece.model takes 100); counted in a trained tokenizer's vocab_size.")
    tokenizer_output: Path | None = Field(None, description="Where a trained tokenizer is written; default "
                                          "<output-prefix dir>/tokenizer.")
    tokenizer_train_docs: int | None = Field(None, ge=1, description="Train the tokenizer on at most this many "
                                             "documents (default: all).")
    model_max_length: int = Field(8192, ge=1, description="model_max_length written to a trained tokenizer's config.")
    split_sentences: bool = Field(False, description="One sequence per sentence, documents kept in the .idx "
                                  "document index (Megatron's --split-sentences; BERT's sentence pairs). Needs "
                                  "pysbd (tessera-data-prep[sentences]).")
    sentence_language: str = Field("en", description="Language of the sentence rules (pysbd's ISO 639-1 codes).")
    append_eod: bool = Field(True, description="Append the end-of-document token (eos) to every document.")
    append_bos: bool = Field(False, description="Prepend the beginning-of-text token (bos) to every document.")
    max_shard_size: str | None = Field(None, description="Split output into shards of at most this many tokens "
                                       "(50M) or bytes of .bin (500MB, 2GiB); shards are numbered _00000, ….")
    workers: int = Field(1, ge=1, description="Tokenizer processes; 1 = a background thread (the tokenizer is "
                         "itself multi-threaded). Output is identical for any value.")
    batch_chars: int = Field(4_000_000, ge=1, description="Characters of text per tokenization batch.")
    on_error: Literal["skip", "fail"] = Field("skip", description="What to do with a bad record: skip it (counted "
                                              "and reported) or fail the run.")
    skipped_log: Path | None = Field(None, description="Also write every skipped record (file, line, reason) here "
                                     "as JSON lines.")
    hf_split: str | None = Field(None, description="Split of a Hugging Face DatasetDict input (default train).")
    overwrite: bool = Field(False, description="Replace existing output shards and trained tokenizer.")
    quiet: bool = Field(False, description="No progress bars.")

    @field_validator("json_keys")
    @classmethod
    def _distinct_keys(cls, keys: list[str]) -> list[str]:
        if len(set(keys)) != len(keys) or any(not k for k in keys):
            raise ValueError("keys must be non-empty and distinct")
        if any("/" in k or k.startswith(".") for k in keys):
            raise ValueError("a key becomes part of the output file name: no '/' and no leading '.'")
        return keys


class SkipReport:
    """Every rejected record, counted by reason and by file; locations kept for the first few."""

    def __init__(self, on_error: str, log_path: Path | None):
        self.on_error = on_error
        self.by_reason: Counter[str] = Counter()
        self.by_file: Counter[str] = Counter()
        self.examples: list[dict[str, Any]] = []
        self._log_path = log_path
        self._log_tmp = tmp_name(log_path) if log_path else None
        if log_path:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self._log_tmp, "w", encoding="utf-8") if self._log_tmp else None  # noqa: SIM115

    def add(self, path: Path, line: int, reason: str) -> None:
        if self.on_error == "fail":
            raise UserError(f"{path}:{line}: {reason}; fix the record or pass --on-error skip")
        reason_kind = reason.split(" (")[0]
        self.by_reason[reason_kind] += 1
        self.by_file[str(path)] += 1
        entry = {"file": str(path), "line": line, "reason": reason}
        if len(self.examples) < MAX_EXAMPLES_IN_MANIFEST:
            self.examples.append(entry)
        if self._log:
            import json

            self._log.write(json.dumps(entry) + "\n")

    @property
    def total(self) -> int:
        return sum(self.by_file.values())

    def as_manifest(self) -> dict[str, Any]:
        return {"total": self.total, "by_reason": dict(sorted(self.by_reason.items())),
                "by_file": dict(sorted(self.by_file.items())), "examples": self.examples}

    def close(self, success: bool) -> None:
        """Publish the log under its name only if the run succeeded (like every other output)."""
        if self._log and self._log_tmp and self._log_path:
            self._log.close()
            if success:
                os.replace(self._log_tmp, self._log_path)
            else:
                self._log_tmp.unlink(missing_ok=True)


def shard_base(output_prefix: Path, key: str) -> Path:
    return Path(f"{output_prefix}_{key}_document")


def output_keys(cfg: PrepConfig) -> list[str]:
    """The <key> of each output shard set: --json-keys, or the fine-tuning format's one."""
    return cfg.json_keys if cfg.format == "text" else [OUTPUT_KEY[cfg.format]]


def validate(cfg: PrepConfig) -> tuple[list[InputFile], Path | None]:
    """All checks that need no reading of the data. Returns the inputs and the tokenizer dir to write."""
    if cfg.train_tokenizer == (cfg.tokenizer is not None):
        raise UserError("give exactly one of --tokenizer DIR (use an existing tokenizer) or --train-tokenizer")
    if cfg.format != "text" and (cfg.train_tokenizer or cfg.json_keys != ["text"]):
        raise UserError(f"--format {cfg.format}: give the model's --tokenizer (its chat template renders the records); "
                        "--train-tokenizer and --json-keys apply to --format text")
    converting = cfg.tokenizer is not None and cfg.tokenizer.is_file()
    if cfg.tokenizer_output is not None and not (cfg.train_tokenizer or converting):
        raise UserError("--tokenizer-output only applies with --train-tokenizer or a --tokenizer file to convert")
    if cfg.tiktoken_pattern is not None and not converting:
        raise UserError("--tiktoken-pattern only applies to a tiktoken --tokenizer file")
    if cfg.extra_ids and not (cfg.train_tokenizer or converting):
        raise UserError(f"--extra-ids {cfg.extra_ids} applies to --train-tokenizer or a --tokenizer file to convert "
                        "(T5's spiece.model: --extra-ids 100); a tokenizer directory keeps its vocabulary")
    if cfg.tokenizer_type != "bpe" and not cfg.train_tokenizer:
        raise UserError("--tokenizer-type applies to --train-tokenizer (a --tokenizer is used as it is)")
    if cfg.lowercase is not None and not (converting or cfg.tokenizer_type == "wordpiece"):
        raise UserError("--lowercase/--no-lowercase apply to WordPiece: --tokenizer-type wordpiece or a vocab.txt "
                        "--tokenizer")
    inputs = resolve_inputs(cfg.inputs)
    if cfg.format == "text":
        check_inputs(inputs, cfg.json_keys, cfg.hf_split)
    if cfg.skipped_log is not None and cfg.skipped_log.is_dir():
        raise UserError(f"--skipped-log {cfg.skipped_log}: is a folder; give a file name")
    # The log and a trained tokenizer replace what is there: never an input (--skipped-log
    # corpus.jsonl overwrote the corpus; --tokenizer-output DIR --overwrite deleted a corpus in DIR).
    input_paths = [i.path for i in inputs]
    if cfg.skipped_log is not None:
        refuse_replacing_inputs(cfg.skipped_log, input_paths, "--skipped-log")
    ensure_output_dir(cfg.output_prefix.parent, "--output-prefix")
    if cfg.skipped_log is not None:
        ensure_output_dir(cfg.skipped_log.parent, "--skipped-log")
    for key in output_keys(cfg):
        existing = output_prefixes(shard_base(cfg.output_prefix, key))
        if cfg.format == "image-text":  # its image store (an indexed dataset of bytes) is replaced too
            store = image_store_prefix(shard_base(cfg.output_prefix, key))
            existing += [p for p in (idx_path(store), bin_path(store)) if os.path.lexists(p)]
        if existing and not cfg.overwrite:
            raise UserError(f"{existing[0]}: output already exists; choose another --output-prefix or pass --overwrite")
        check_replaceable_files(existing, SHARD_KIND, is_shard_file)
    tok_out = None
    if cfg.train_tokenizer or converting:
        tok_out = cfg.tokenizer_output or cfg.output_prefix.parent / "tokenizer"
        refuse_replacing_inputs(tok_out, input_paths, "--tokenizer-output")
        if tok_out.exists() and not cfg.overwrite:
            raise UserError(f"{tok_out}: tokenizer directory already exists; reuse it with --tokenizer {tok_out}, "
                            "choose --tokenizer-output, or pass --overwrite")
        check_replaceable(tok_out, TOKENIZER_KIND, is_tokenizer_directory, "--tokenizer-output")
        if cfg.vocab_size >= 2**31:
            raise UserError(f"--vocab-size {cfg.vocab_size}: too large")
        if cfg.train_tokenizer and cfg.tokenizer_type == "bpe" and cfg.vocab_size - cfg.extra_ids < 258:
            raise UserError(f"--vocab-size {cfg.vocab_size}: a byte-level BPE needs at least 258 (256 bytes and two "
                            "special tokens)" + (f" besides the {cfg.extra_ids} --extra-ids" if cfg.extra_ids else ""))
    if cfg.max_shard_size is not None:
        if cfg.format == "image-text":
            raise UserError("--max-shard-size applies to token shards; split image-text inputs into several files "
                            "and prep each to its own --output-prefix")
        parse_max_shard_size(cfg.max_shard_size, 2)
    if cfg.format != "image-text" and (cfg.image_folder is not None or cfg.image_token != "<image>"):
        raise UserError("--image-folder and --image-token apply to --format image-text")
    if cfg.split_sentences:
        if cfg.format != "text":
            raise UserError(f"--split-sentences applies to --format text, not {cfg.format}")
        check_splitter(cfg.sentence_language)
    return inputs, tok_out


def _bar(total: int, desc: str, quiet: bool) -> Any:
    return progress(total=total or None, desc=desc, unit="B", unit_scale=True, quiet=quiet, mininterval=0.5)


def _train(cfg: PrepConfig, inputs: list[InputFile], out: Path) -> Tokenizer:
    total = sum(i.size for i in inputs)
    bar = _bar(total, "training tokenizer (reading)", cfg.quiet)

    def texts() -> Iterator[str]:
        n = 0
        for inp in inputs:
            for rec in read_records(inp, cfg.json_keys, cfg.hf_split, bar.update):
                if rec.values is None:
                    continue  # counted and reported in the tokenization pass
                yield from rec.values
                n += 1
                if cfg.tokenizer_train_docs is not None and n >= cfg.tokenizer_train_docs:
                    return

    with bar:
        if cfg.tokenizer_type == "wordpiece":
            lowercase = cfg.lowercase if cfg.lowercase is not None else True
            tok = train_wordpiece(texts(), cfg.vocab_size - cfg.extra_ids, lowercase)
            add_sentinels(tok, cfg.extra_ids)
            save_wordpiece(tok, out, cfg.model_max_length, lowercase, overwrite=cfg.overwrite)
        else:
            tok = train_bpe(texts(), cfg.vocab_size - cfg.extra_ids)
            add_sentinels(tok, cfg.extra_ids)
            save_tokenizer(tok, out, cfg.model_max_length, overwrite=cfg.overwrite)
    return load_tokenizer(out)


def _batches(inputs: list[InputFile], cfg: PrepConfig, skips: SkipReport,
             progress) -> Iterator[tuple[list[tuple[Path, int]], list[list[str]]]]:
    """Good records grouped into batches of about `batch_chars` characters: (locations, texts per key)."""
    nkeys = len(cfg.json_keys)
    locs: list[tuple[Path, int]] = []
    texts: list[list[str]] = [[] for _ in range(nkeys)]
    chars = 0
    for inp in inputs:
        rec: Record
        for rec in read_records(inp, cfg.json_keys, cfg.hf_split, progress):
            inp.records += 1
            if rec.values is None:
                skips.add(inp.path, rec.line, rec.error or "unusable record")
                continue
            locs.append((inp.path, rec.line))
            for k in range(nkeys):
                texts[k].append(rec.values[k])
                chars += len(rec.values[k])
            if chars >= cfg.batch_chars:
                yield locs, texts
                locs, texts, chars = [], [[] for _ in range(nkeys)], 0
    if locs:
        yield locs, texts


def run_prep(cfg: PrepConfig) -> list[Path]:
    """Run the whole prep; returns the published shard prefixes."""
    inputs, tok_out = validate(cfg)
    made_tokenizer = tok_out is not None and not tok_out.exists()
    try:
        published = _prep(cfg, inputs, tok_out)
    except BaseException:
        if made_tokenizer and tok_out is not None:
            shutil.rmtree(tok_out, ignore_errors=True)  # a failed run leaves nothing it created
        raise
    return published


def _prep(cfg: PrepConfig, inputs: list[InputFile], tok_out: Path | None) -> list[Path]:
    if tok_out is None:
        tokenizer = load_tokenizer(cfg.tokenizer)
    elif cfg.train_tokenizer:
        tokenizer = _train(cfg, inputs, tok_out)
    else:  # a SentencePiece / tiktoken file, converted by transformers' converters
        assert cfg.tokenizer is not None
        tokenizer = load_tokenizer(convert_tokenizer(cfg.tokenizer, tok_out, cfg.model_max_length,
                                                     cfg.tiktoken_pattern, cfg.lowercase, cfg.extra_ids))
    for inp in inputs:
        inp.sha256, inp.records = None, 0
    eod_id = bos_id = None
    if cfg.append_eod:
        eod_id = end_of_document_id(tokenizer)
        if eod_id is None:
            raise UserError(f"{tokenizer.directory}: tokenizer has no eos token (tokenizer_config.json eos_token) "
                            "to append as end of document; fix it or pass --no-append-eod")
    if cfg.append_bos:
        bos_id = tokenizer.bos_id
        if bos_id is None:
            raise UserError(f"{tokenizer.directory}: tokenizer has no bos token (tokenizer_config.json bos_token); "
                            "fix it or drop --append-bos")
    if cfg.format != "text":
        return _prep_sft(cfg, inputs, tokenizer, bos_id, eod_id)
    vocab_size = tokenizer.vocab_size
    dtype = token_dtype_for_vocab(vocab_size)
    max_tokens = parse_max_shard_size(cfg.max_shard_size, dtype.itemsize) if cfg.max_shard_size else None
    writers = [ShardSetWriter(shard_base(cfg.output_prefix, key), dtype, max_tokens) for key in cfg.json_keys]
    encoder = BatchEncoder(str(tokenizer.directory / TOKENIZER_JSON), dtype.name, bos_id, eod_id,
                           cfg.sentence_language if cfg.split_sentences else None)
    skips = SkipReport(cfg.on_error, cfg.skipped_log)
    total_bytes = sum(i.size for i in inputs)
    bar = _bar(total_bytes, "tokenizing", cfg.quiet)
    started = time.perf_counter()
    docs = tokens = 0

    def consume(locs: list[tuple[Path, int]], batches: list[EncodedBatch]) -> None:
        nonlocal docs, tokens
        bad: dict[int, str] = {}
        for b in batches:
            for i, reason in b.bad.items():
                bad.setdefault(i, reason)
        if bad:  # drop the record from every key so the shards stay aligned record by record
            for i in sorted(bad):
                skips.add(locs[i][0], locs[i][1], bad[i])
            batches = [b.without(set(bad)) for b in batches]
        for w, b in zip(writers, batches):
            w.add(b.tokens, b.lengths, sentences=b.sentences)
        docs += batches[0].num_documents
        tokens += sum(int(b.lengths.sum()) for b in batches)
        elapsed = max(time.perf_counter() - started, 1e-9)
        bar.set_postfix(docs=docs, tok_s=f"{tokens / elapsed:,.0f}", refresh=False)

    success = False
    try:
        with bar, OrderedEncoder(encoder, cfg.workers) as pool:
            for locs, texts in _batches(inputs, cfg, skips, bar.update):
                for done_locs, result in pool.submit(locs, texts):
                    consume(done_locs, result)  # type: ignore[arg-type]
            for done_locs, result in pool.drain():
                consume(done_locs, result)  # type: ignore[arg-type]
        if docs == 0:
            raise UserError(f"{cfg.inputs[0]}: no usable documents in the input ({skips.total} records skipped)")
        fields = _manifest_fields(cfg, tokenizer, inputs, skips)
        published: list[Path] = []
        for key, w in zip(cfg.json_keys, writers):
            published += w.commit({**fields, "json_key": key})
        success = True
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        skips.close(success)
    _summary(cfg, published, docs, tokens, skips, time.perf_counter() - started, tok_out)
    return published


def _prep_sft(cfg: PrepConfig, inputs: list[InputFile], tokenizer: Tokenizer, bos_id: int | None,
              eod_id: int | None) -> list[Path]:
    """Fine-tuning data (tessera.data_prep.sft): one loss-masked shard set, same manifest and summary."""
    key = output_keys(cfg)[0]
    skips = SkipReport(cfg.on_error, cfg.skipped_log)
    started = time.perf_counter()
    success = False
    try:
        write = write_image_text_shards if cfg.format == "image-text" else write_sft_shards
        writer, docs, tokens = write(cfg, inputs, tokenizer, skips, shard_base(cfg.output_prefix, key), bos_id, eod_id)
        try:
            if docs == 0:
                raise UserError(f"{cfg.inputs[0]}: no usable {cfg.format} records in the input "
                                f"({skips.total} records skipped)")
            fields = {**_manifest_fields(cfg, tokenizer, inputs, skips), "json_key": key, "sft_format": cfg.format}
            published = writer.commit(fields)
        except BaseException:
            writer.abort()
            raise
        success = True
    finally:
        skips.close(success)
    _summary(cfg, published, docs, tokens, skips, time.perf_counter() - started, None)
    return published


def end_of_document_id(tokenizer: Tokenizer) -> int | None:
    """The token appended after each document: the tokenizer's eos, else <|endoftext|> if it has one."""
    return tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.token_id(EOD_TOKEN)


def _manifest_fields(cfg: PrepConfig, tokenizer: Tokenizer, inputs: list[InputFile], skips: SkipReport) -> dict:
    input_entries = []
    for inp in inputs:
        entry = ShardInput(path=str(inp.path), sha256=inp.sha256, format=inp.kind, records=inp.records)
        if inp.kind == "hf":
            entry = ShardInput(path=str(inp.path), sha256=None, format="hf", records=inp.records,
                               hf_fingerprint=hf_fingerprint(inp, cfg.hf_split))
        input_entries.append(entry.model_dump(mode="json"))
    tok_rel = os.path.relpath(tokenizer.directory.resolve(), cfg.output_prefix.parent.resolve())
    return {
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "tokenizer": tok_rel,
        "vocab_size": tokenizer.vocab_size,
        "append_eod": cfg.append_eod,
        "append_bos": cfg.append_bos,
        "eod_id": end_of_document_id(tokenizer) if cfg.append_eod else None,
        **({"split_sentences": True, "sentence_language": cfg.sentence_language} if cfg.split_sentences else {}),
        "inputs": input_entries,
        "skipped": skips.as_manifest(),
        "created_by": "tessera-data prep",
    }


def _summary(cfg: PrepConfig, published: list[Path], docs: int, tokens: int, skips: SkipReport,
             seconds: float, tok_out: Path | None) -> None:
    import sys

    out = sys.stderr
    if tok_out is not None:
        print(f"tokenizer: {tok_out}", file=out)
    for p in published:
        print(f"shard: {p}.bin/.idx/.json", file=out)
    print(f"{docs:,} documents, {tokens:,} tokens in {seconds:.1f}s ({tokens / max(seconds, 1e-9):,.0f} tokens/s)",
          file=out)
    if skips.total:
        print(f"skipped {skips.total:,} records: " + ", ".join(f"{r}: {n}" for r, n in skips.by_reason.most_common()),
              file=out)
        for e in skips.examples[:20]:
            print(f"  {e['file']}:{e['line']}: {e['reason']}", file=out)
        if skips.total > 20:
            print(f"  … {skips.total - 20} more (see 'skipped' in the manifest"
                  + (f" and {cfg.skipped_log})" if cfg.skipped_log else ")"), file=out)
