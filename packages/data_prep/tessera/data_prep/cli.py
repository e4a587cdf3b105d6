"""`tessera-data <verb>`: prep | blend | merge | verify | inspect. See docs/cli/tessera-data.md."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tessera.common.config import validate_config
from tessera.common.errors import UserError, run_cli

DESCRIPTION = """\
Turn corpora into verified, blended, Megatron-compatible token shards.

  prep     read JSONL/Parquet/text/datasets, tokenize (or first train a tokenizer), write shards
  blend    build a train/valid/test mixture of weighted shards for the trainer
  merge    concatenate shards of one tokenizer into one shard
  verify   check shards' format invariants, checksums and token ids
  inspect  counts, document-length summary, top tokens, decoded documents
  adopt    check a shard built elsewhere (Megatron) and write its manifest
"""


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors through UserError (one line, exit 2)."""

    def error(self, message: str):  # type: ignore[override]
        verb = self.prog.removeprefix("tessera-data").strip()  # run_cli already names the program
        raise UserError(f"{verb + ': ' if verb else ''}{message} (see --help)")


def _add_prep(sub) -> None:
    p = sub.add_parser("prep", help="tokenize a corpus into <prefix>_<key>_document shards",
                       description="Read the inputs, train or load a tokenizer, and write one Megatron MMIDIDX "
                       "shard set per --json-keys key with a manifest (<prefix>_<key>_document.bin/.idx/.json).")
    p.add_argument("--input", "--inputs", dest="inputs", nargs="+", action="extend", required=True, metavar="PATH",
                   help="Input files, folders or globs (quote globs): *.jsonl[.gz|.zst], *.parquet, plain-text files "
                   "(one document per file), folders, Hugging Face datasets folders (save_to_disk). Repeatable.")
    p.add_argument("--format", choices=["text", "chat", "prompt-completion", "image-text"], default="text",
                   help="text (default): pretraining text under --json-keys. chat: JSONL records with 'messages' "
                   "rendered by the tokenizer's chat template; prompt-completion: 'prompt' + 'completion' (strings, "
                   "or lists of messages). Both write <prefix>_<messages|completion>_document with a loss mask "
                   "(<prefix>.mask.bin: the answer tokens) that the trainer applies. image-text: LLaVA .json/.jsonl "
                   "conversations with image paths, Parquet with image bytes, or WebDataset .tar; writes "
                   "<prefix>_conversations_document (masked as chat, one --image-token per image) and its images "
                   "(<prefix>_conversations_document.images.bin/.idx); see docs/formats/image-text-shard.md.")
    p.add_argument("--image-folder", type=Path, metavar="DIR",
                   help="image-text: folder LLaVA JSON image paths are relative to (default: the JSON file's folder).")
    p.add_argument("--image-token", metavar="TOKEN",
                   help="image-text: the tokenizer's image placeholder token (default <image>).")
    p.add_argument("--max-image-pixels", type=int, metavar="N",
                   help="image-text: refuse an image of more than N pixels, width x height (default 67108864).")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="Keys/columns holding the text; one shard set per key (default: text).")
    p.add_argument("--output-prefix", required=True, type=Path,
                   help="Output prefix: writes <prefix>_<key>_document.{bin,idx,json}.")
    tok = p.add_argument_group("tokenizer (exactly one of --tokenizer / --train-tokenizer)")
    tok.add_argument("--tokenizer", type=Path, metavar="DIR|FILE",
                     help="Existing Hugging Face tokenizer directory, or a SentencePiece .model / tiktoken BPE file "
                     "(converted with transformers' converters into --tokenizer-output first) / BERT vocab.txt.")
    tok.add_argument("--tiktoken-pattern", metavar="REGEX",
                     help="Split pattern of a tiktoken --tokenizer file (default: cl100k's, as Llama 3).")
    tok.add_argument("--train-tokenizer", action="store_true",
                     help="Train a byte-level BPE on the inputs first (special tokens <|endoftext|> = eos/pad/EOD, "
                     "<|begin_of_text|> = bos).")
    tok.add_argument("--tokenizer-type", choices=["bpe", "wordpiece"],
                     help="What --train-tokenizer trains: bpe (default) or wordpiece (BERT's normalizer and "
                     "pre-tokenizer, ## continuations, [PAD] [UNK] [CLS] [SEP] [MASK]; also writes vocab.txt). A BERT "
                     "vocab.txt given to --tokenizer is converted the same way.")
    tok.add_argument("--lowercase", dest="lowercase", action="store_true", default=None,
                     help="WordPiece: uncased (lowercase, strip accents). Default: when training; for a vocab.txt, "
                     "when it has no upper-case tokens.")
    tok.add_argument("--no-lowercase", dest="lowercase", action="store_false", help="WordPiece: cased.")
    tok.add_argument("--vocab-size", type=int, default=32000, help="Vocabulary size to train (default 32000).")
    tok.add_argument("--extra-ids", type=int, metavar="N",
                     help="With --train-tokenizer or a --tokenizer file to convert: add T5's N sentinel tokens "
                     "<extra_id_0>..<extra_id_N-1> as the vocabulary's last ids (<extra_id_0> last, as T5's; T5's "
                     "spiece.model takes 100), for span-corruption training of an encoder-decoder; counted in "
                     "--vocab-size when training.")
    tok.add_argument("--tokenizer-output", type=Path, metavar="DIR",
                     help="Where the trained or converted tokenizer goes (default: <output-prefix dir>/tokenizer).")
    tok.add_argument("--tokenizer-train-docs", type=int, metavar="N",
                     help="Train on at most the first N documents (default: all).")
    tok.add_argument("--model-max-length", type=int, default=8192,
                     help="model_max_length in the trained tokenizer's config (default 8192).")
    p.add_argument("--split-sentences", action="store_true",
                   help="One sequence per sentence, documents kept (Megatron's --split-sentences; what BERT's "
                   "sentence-pair samples need). Splits with pysbd: pip install 'tessera-data-prep[sentences]'.")
    p.add_argument("--sentence-language", metavar="CODE",
                   help="Language of the sentence-splitting rules (pysbd's ISO 639-1 code; default en).")
    p.add_argument("--append-eod", dest="append_eod", action="store_true", default=True,
                   help="Append the end-of-document (eos) token to each document (default).")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false", help="Do not append EOD.")
    p.add_argument("--append-bos", action="store_true", help="Prepend the bos token to each document.")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="Split output into numbered shards (<prefix>_<key>_document_00000, …) of at most SIZE: "
                   "tokens (1000000, 50M) or bytes of .bin (500MB, 2GiB).")
    p.add_argument("--workers", type=int, default=1,
                   help="Tokenizer processes (default 1: a background thread; the tokenizer uses all cores "
                   "itself). Output is byte-identical for any value.")
    p.add_argument("--batch-chars", type=int, default=4_000_000, help="Characters per tokenization batch.")
    p.add_argument("--on-error", choices=["skip", "fail"], default="skip",
                   help="Bad record (malformed JSON, missing key, non-string, empty, invalid UTF-8): skip it "
                   "(default; counted and reported by file and line) or fail.")
    p.add_argument("--skipped-log", type=Path, metavar="FILE",
                   help="Write every skipped record (file, line, reason) to FILE as JSON lines.")
    p.add_argument("--hf-split", help="Split to read from a Hugging Face DatasetDict folder (default train).")
    p.add_argument("--overwrite", action="store_true", help="Replace existing shards and trained tokenizer.")
    p.add_argument("--quiet", action="store_true", help="No progress bars.")


def _add_blend(sub) -> None:
    p = sub.add_parser("blend", help="build a mixture (train/valid/test sample indices) from weighted shards",
                       description="Build the mixture directory the trainer reads (format: tessera.common.mixture). "
                       "Flags override the same fields of --config.")
    p.add_argument("--config", help="YAML file with the fields below (data: [{prefix, weight}], seq_length, …).")
    p.add_argument("--data", nargs="+", metavar="W PREFIX",
                   help="Weighted shard prefixes: 0.7 data/a_text_document 0.3 data/b_text_document "
                   "(or prefixes only, equal weights).")
    p.add_argument("--seq-length", type=int, help="Tokens per sample (each stores seq_length + 1).")
    p.add_argument("--split", help="train,valid,test document ratios (default 969,30,1).")
    p.add_argument("--train-samples", type=int, help="Samples in the train split (required, >= 1).")
    p.add_argument("--valid-samples", type=int, help="Samples in the valid split (default 0).")
    p.add_argument("--test-samples", type=int, help="Samples in the test split (default 0).")
    p.add_argument("--seed", type=int, help="Shuffle seed (default 1234).")
    p.add_argument("--output", type=Path, help="Mixture directory to create.")
    p.add_argument("--overwrite", action="store_true", default=None, help="Replace an existing mixture.")
    p.add_argument("--quiet", action="store_true", default=None, help="No progress bars.")


def _add_merge(sub) -> None:
    p = sub.add_parser("merge", help="concatenate shards into one",
                       description="Concatenate shards of one tokenizer (in the order given) into one shard.")
    p.add_argument("--inputs", nargs="+", required=True, metavar="PREFIX", help="Shard prefixes or globs.")
    p.add_argument("--output-prefix", required=True, type=Path, help="Output prefix (<prefix>.bin/.idx/.json).")
    p.add_argument("--overwrite", action="store_true", help="Replace an existing output.")
    p.add_argument("--quiet", action="store_true", help="No summary line.")


def _add_verify(sub) -> None:
    p = sub.add_parser("verify", help="check shards (format, checksums, token ids)",
                       description="Check format invariants, manifest checksums and token ids < vocab size. "
                       "Exit 0 with a summary when every shard is good; 2 naming the file and problem otherwise.")
    p.add_argument("prefixes", nargs="+", metavar="PREFIX", help="Shard prefixes or globs.")
    p.add_argument("--vocab-size", type=int, help="Check ids against this vocab size (default: the manifest's).")
    p.add_argument("--no-checksums", action="store_true", help="Skip the sha256 checks (faster).")


def _add_adopt(sub) -> None:
    p = sub.add_parser("adopt", help="check a shard built elsewhere (e.g. Megatron) and give it a manifest",
                       description="Check a .bin/.idx shard made by another tool (Megatron-LM's preprocess_data.py, "
                       "Megatron-Core's IndexedDatasetBuilder) against a tokenizer (index structure, every id "
                       "inside the vocabulary) and write <prefix>.json beside it, so blend, merge and the trainer "
                       "accept it. The .bin/.idx are not modified.")
    p.add_argument("prefix", type=Path, help="Shard prefix (<prefix>.bin and <prefix>.idx).")
    p.add_argument("--tokenizer", type=Path, required=True, metavar="DIR",
                   help="Tokenizer directory (tokenizer.json) the shard was made with.")
    p.add_argument("--eod-id", default="auto",
                   help="End-of-document id: auto (default: the tokenizer's, if every document ends with it), "
                   "none, or an id every document must end with.")
    p.add_argument("--overwrite", action="store_true", help="Replace an existing manifest.")
    p.add_argument("--quiet", action="store_true", help="No progress or summary line.")


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="counts, length summary, top tokens, decoded documents",
                       description="Print what a shard holds and decode chosen documents.")
    p.add_argument("prefix", type=Path, help="Shard prefix.")
    p.add_argument("--docs", default="", help="Comma-separated document numbers to decode, e.g. 0,5.")
    p.add_argument("--tokenizer", type=Path, metavar="DIR",
                   help="Tokenizer to decode with (default: the one recorded in the manifest).")
    p.add_argument("--top", type=int, default=10, help="How many most frequent tokens to list (default 10).")
    p.add_argument("--max-chars", type=int, default=400, help="Characters of each decoded document to print.")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tessera-data", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    sub.required = True
    for add in (_add_prep, _add_blend, _add_merge, _add_verify, _add_inspect, _add_adopt):
        add(sub)
    return parser


def _prep(args: argparse.Namespace) -> int:
    from tessera.data_prep.prep import PrepConfig, run_prep

    fields = {k: getattr(args, k) for k in PrepConfig.model_fields if getattr(args, k, None) is not None}
    cfg = validate_config(PrepConfig, fields, "tessera-data prep")
    run_prep(cfg)
    return 0


def _blend(args: argparse.Namespace) -> int:
    from tessera.data_prep.blend import load_blend_config, parse_data_args, run_blend

    cli = {"data": [s.model_dump() for s in parse_data_args(args.data)] if args.data else None,
           "seq_length": args.seq_length, "split": args.split, "train_samples": args.train_samples,
           "valid_samples": args.valid_samples, "test_samples": args.test_samples, "seed": args.seed,
           "output": args.output, "overwrite": args.overwrite, "quiet": args.quiet}
    run_blend(load_blend_config(args.config, cli))
    return 0


def _merge(args: argparse.Namespace) -> int:
    from tessera.data_prep.merge import expand_prefixes, run_merge

    run_merge(expand_prefixes(args.inputs), args.output_prefix, args.overwrite, args.quiet)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from tessera.data_prep.merge import expand_prefixes
    from tessera.data_prep.verify import verify_shard

    for prefix in expand_prefixes(args.prefixes):
        r = verify_shard(prefix, args.vocab_size, check_checksums=not args.no_checksums)
        note = "manifest and checksums ok" if r.manifest and not args.no_checksums else (
            "manifest ok, checksums not checked" if r.manifest else "no manifest: format only")
        images = f", {r.num_images:,} images" if r.num_images is not None else ""
        print(f"OK {prefix}: {r.dtype}, {r.num_documents:,} documents, {r.num_sequences:,} sequences, "
              f"{r.num_tokens:,} tokens{images}, max id {r.max_token}; {note}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from tessera.data_prep.inspection import inspect_shard

    try:
        docs = [int(x) for x in args.docs.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--docs {args.docs!r}: expected comma-separated document numbers, e.g. 0,5") from None
    for flag, value in (("--top", args.top), ("--max-chars", args.max_chars)):
        if value < 0:
            raise UserError(f"{flag} {value}: must be 0 or more")
    report = inspect_shard(args.prefix, docs, args.tokenizer, args.top, args.max_chars)
    try:
        print(report, flush=True)
    except BrokenPipeError:  # e.g. piped into `head`: not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the interpreter's flush at exit
    return 0


def _adopt(args: argparse.Namespace) -> int:
    from tessera.data_prep.adopt import run_adopt

    run_adopt(args.prefix, args.tokenizer, args.eod_id, args.overwrite, args.quiet)
    return 0


VERBS = {"prep": _prep, "blend": _blend, "merge": _merge, "verify": _verify, "inspect": _inspect, "adopt": _adopt}


def entry(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return VERBS[args.verb](args)


def main(argv: list[str] | None = None) -> None:
    run_cli(entry, argv if argv is not None else sys.argv[1:])
