"""`tessera-data prep`: parity with the tokenizer, every reader, bad records, atomicity, workers, sharding."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dp_helpers import run, user_error, write_jsonl
from tokenizers import Tokenizer as HFTokenizer

from tessera.common.fileio import sha256_file
from tessera.common.indexed_dataset import IndexedDataset
from tessera.common.shard import read_shard_manifest
from tessera.common.tokenizer import tokenizer_fingerprint
from tessera.data_prep.shard_writer import parse_max_shard_size
from tessera.data_prep.tokenizer_train import BOS_TOKEN, EOD_TOKEN, save_tokenizer, train_bpe


def _ref_tokens(tokenizer_dir: Path, text: str) -> list[int]:
    return HFTokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_prep_matches_tokenizer_and_manifest(tokenizer_dir, base_shard, corpus_texts):
    ds = IndexedDataset(base_shard)
    tok = HFTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eod = tok.token_to_id(EOD_TOKEN)
    assert ds.num_documents == len(corpus_texts) and ds.dtype == np.uint16
    for i, text in enumerate(corpus_texts):
        assert ds.document_tokens(i).tolist() == tok.encode(text, add_special_tokens=False).ids + [eod]
    m = read_shard_manifest(base_shard)
    assert m.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer_dir)
    assert (m.vocab_size, m.dtype, m.num_documents, m.num_tokens) == (1024, "uint16", ds.num_documents, ds.num_tokens)
    assert m.checksums == {"bin": sha256_file(f"{base_shard}.bin"), "idx": sha256_file(f"{base_shard}.idx")}
    corpus = tokenizer_dir.parent.parent / "corpus.jsonl"
    assert m.inputs[0].sha256 == sha256_file(corpus) and m.inputs[0].records == len(corpus_texts)
    assert (base_shard.parent / m.model_extra["tokenizer"]).resolve() == tokenizer_dir.resolve()


def test_trained_tokenizer_works_with_transformers(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == (EOD_TOKEN, EOD_TOKEN, BOS_TOKEN)
    text = "def f(x):\n    return x  # héllo ✓"
    assert tok(text, add_special_tokens=False)["input_ids"] == _ref_tokens(tokenizer_dir, text)
    assert tok.decode(_ref_tokens(tokenizer_dir, text)) == text  # byte-level: lossless
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.startswith(BOS_TOKEN) and "hi" + EOD_TOKEN in chat and chat.endswith("<|assistant|>\n")
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["model_max_length"] == 8192


def _write_all_formats(d: Path, texts: list[str]) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    from datasets import Dataset

    lines = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts)
    paths = {"jsonl": d / "c.jsonl", "gz": d / "c.jsonl.gz", "zst": d / "c.jsonl.zst", "parquet": d / "c.parquet",
             "folder": d / "txt", "hf": d / "hf"}
    paths["jsonl"].write_bytes(lines)
    paths["gz"].write_bytes(gzip.compress(lines))
    paths["zst"].write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.table({"text": texts, "other": list(range(len(texts)))}), paths["parquet"], row_group_size=3)
    paths["folder"].mkdir()
    for i, t in enumerate(texts):
        (paths["folder"] / f"doc{i:03d}.txt").write_text(t, encoding="utf-8")
    Dataset.from_dict({"text": texts}).save_to_disk(str(paths["hf"]))
    return paths


def test_every_reader_gives_the_same_shard(tmp_path, tokenizer_dir, corpus_texts):
    texts = corpus_texts[:8]
    paths = _write_all_formats(tmp_path, texts)
    blobs = {}
    for name, path in paths.items():
        run(["prep", "--input", path, "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / f"o_{name}",
             "--quiet", "--batch-chars", 20000])
        prefix = tmp_path / f"o_{name}_text_document"
        blobs[name] = (Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes())
        assert read_shard_manifest(prefix).num_documents == len(texts)
    assert all(b == blobs["jsonl"] for b in blobs.values()), [k for k, b in blobs.items() if b != blobs["jsonl"]]
    # A glob over several inputs concatenates them in sorted order.
    run(["prep", "--input", str(tmp_path / "c.jsonl*"), "--tokenizer", tokenizer_dir, "--output-prefix",
         tmp_path / "glob", "--quiet"])
    assert IndexedDataset(tmp_path / "glob_text_document").num_documents == 3 * len(texts)


def test_bad_records_are_skipped_and_reported(tmp_path, tokenizer_dir, capsys):
    good = [{"text": f"document number {i}"} for i in range(6)]
    raw = {
        1: b'{"text": "unterminated',
        2: b'{"text": "bad utf8 \xff\xfe here"}',
        3: b'{"txt": "wrong key"}',
        4: b'{"text": 42}',
        5: b'{"text": "   "}',
    }
    corpus = write_jsonl(tmp_path / "bad.jsonl", good, raw)
    with open(corpus, "ab") as f:
        f.write(b'{"text": "lone surrogate \\ud800 here"}\n[1, 2]\n')
    run(["prep", "--input", corpus, "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / "o", "--quiet",
         "--skipped-log", tmp_path / "skipped.jsonl"])
    prefix = tmp_path / "o_text_document"
    ds = IndexedDataset(prefix)
    assert ds.num_documents == 6
    assert ds.document_tokens(5)[:-1].tolist() == _ref_tokens(tokenizer_dir, "document number 5")
    skipped = read_shard_manifest(prefix).model_extra["skipped"]
    where = {(e["line"], e["reason"].split(" (")[0]) for e in skipped["examples"]}
    assert where == {(2, "malformed JSON"), (4, "invalid UTF-8"), (6, "missing key 'text'"),
                     (8, "key 'text' is int, not a string"), (10, "empty document under key 'text'"),
                     (12, "invalid UTF-8"), (13, "not a JSON object")}
    assert skipped["total"] == 7 and skipped["by_file"] == {str(corpus): 7}
    assert len((tmp_path / "skipped.jsonl").read_text().splitlines()) == 7
    err = capsys.readouterr().err
    assert "skipped 7 records" in err and f"{corpus}:12: invalid UTF-8" in err


def test_on_error_fail_leaves_no_finished_looking_file(tmp_path, corpus_texts, capsys):
    records = [{"text": t} for t in corpus_texts[:20]]
    corpus = write_jsonl(tmp_path / "c.jsonl", records, {18: b'{"text": oops}'})
    out = tmp_path / "out"
    # Small batches and shards: several shards are already staged when the bad record is met.
    err = user_error(["prep", "--input", corpus, "--train-tokenizer", "--vocab-size", 300, "--output-prefix",
                       out / "x", "--quiet", "--on-error", "fail", "--batch-chars", 5000,
                       "--max-shard-size", 3000, "--skipped-log", out / "skipped.jsonl"], capsys)
    assert f"{corpus}:19: malformed JSON" in err and "--on-error skip" in err
    leftovers = sorted(p.name for p in out.rglob("*")) if out.exists() else []
    assert leftovers == []  # no shards, no manifests, no staged or temporary files, no tokenizer


@pytest.mark.slow
def test_output_identical_for_any_worker_count(tmp_path, tokenizer_dir, corpus_texts):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in corpus_texts])
    blobs = []
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        run(["prep", "--input", corpus, "--tokenizer", tokenizer_dir, "--output-prefix", prefix, "--quiet",
             "--workers", workers, "--batch-chars", 30000])
        blobs.append([Path(f"{prefix}_text_document{s}").read_bytes() for s in (".bin", ".idx", ".json")])
    assert blobs[0] == blobs[1]


def test_max_shard_size_then_merge_equals_single_shard(tmp_path, tokenizer_dir, base_shard, corpus_texts, capsys):
    corpus = tokenizer_dir.parent.parent / "corpus.jsonl"
    run(["prep", "--input", corpus, "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / "s", "--quiet",
         "--max-shard-size", "20KB", "--batch-chars", 30000])
    shards = sorted(tmp_path.glob("s_text_document_*.idx"))
    assert len(shards) > 2
    full = IndexedDataset(base_shard)
    doc = 0
    for idx in shards:
        prefix = Path(str(idx)[:-4])
        ds = IndexedDataset(prefix)
        m = read_shard_manifest(prefix)
        assert ds.num_tokens * 2 <= 20000 or ds.num_documents == 1  # one oversized document may stand alone
        assert m.model_extra["num_shards"] == len(shards)
        for i in range(ds.num_documents):
            np.testing.assert_array_equal(ds.document_tokens(i), full.document_tokens(doc))
            doc += 1
    assert doc == full.num_documents
    run(["merge", "--inputs", str(tmp_path / "s_text_document_*"), "--output-prefix", tmp_path / "merged", "--quiet"])
    for suffix in (".bin", ".idx"):
        assert Path(f"{tmp_path}/merged{suffix}").read_bytes() == Path(f"{base_shard}{suffix}").read_bytes()
    run(["verify", tmp_path / "merged"])
    assert "OK" in capsys.readouterr().out
    eod = HFTokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id(EOD_TOKEN)
    assert read_shard_manifest(tmp_path / "merged").eod_id == read_shard_manifest(base_shard).eod_id == eod
    # A shard from another tokenizer cannot be merged in.
    other = tmp_path / "tok2"
    save_tokenizer(train_bpe(corpus_texts[:3], 300), other, 512)
    run(["prep", "--input", corpus, "--tokenizer", other, "--output-prefix", tmp_path / "o", "--quiet"])
    err = user_error(["merge", "--inputs", base_shard, tmp_path / "o_text_document", "--output-prefix",
                       tmp_path / "m2"], capsys)
    assert "o_text_document.json" in err and "tokenizer" in err


def test_json_keys_bos_and_no_eod(tmp_path, tokenizer_dir):
    records = [{"title": "t0", "body": "b0"}, {"title": "t1"}, {"title": "t2", "body": "b2"}]
    corpus = write_jsonl(tmp_path / "c.jsonl", records)
    run(["prep", "--input", corpus, "--json-keys", "title", "body", "--tokenizer", tokenizer_dir,
         "--output-prefix", tmp_path / "o", "--quiet", "--no-append-eod", "--append-bos"])
    bos = HFTokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id(BOS_TOKEN)
    for key, want in (("title", ["t0", "t2"]), ("body", ["b0", "b2"])):  # record 2 lacks body: skipped in both
        ds = IndexedDataset(tmp_path / f"o_{key}_document")
        got = [ds.document_tokens(i).tolist() for i in range(ds.num_documents)]
        assert got == [[bos] + _ref_tokens(tokenizer_dir, t) for t in want]
        m = read_shard_manifest(tmp_path / f"o_{key}_document")
        assert m.json_key == key and m.append_eod is False and m.eod_id is None


def test_eod_id_records_the_appended_token_without_an_eos_token(tmp_path, tokenizer_dir):
    """A tokenizer without eos_token gets <|endoftext|> appended; the manifest records that id (the
    trainer's packed-document options read it)."""
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config.pop("eos_token")
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}, {"text": "b"}])
    run(["prep", "--input", corpus, "--tokenizer", tok, "--output-prefix", tmp_path / "o", "--quiet"])
    eod = HFTokenizer.from_file(str(tok / "tokenizer.json")).token_to_id(EOD_TOKEN)
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert [ds.document_tokens(i).tolist()[-1] for i in range(2)] == [eod, eod]
    assert read_shard_manifest(tmp_path / "o_text_document").eod_id == eod


def test_prep_refuses_bad_input_with_one_line(tmp_path, tokenizer_dir, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "x"}])
    assert "nope.jsonl: no such file" in user_error(
        ["prep", "--input", tmp_path / "nope.jsonl", "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / "o"],
        capsys)
    assert "exactly one of --tokenizer" in user_error(
        ["prep", "--input", corpus, "--tokenizer", tokenizer_dir, "--train-tokenizer", "--output-prefix",
         tmp_path / "o"], capsys)
    assert "tokenizer.json not found" in user_error(
        ["prep", "--input", corpus, "--tokenizer", tmp_path, "--output-prefix", tmp_path / "o"], capsys)
    (tmp_path / "notes.txt").write_text("hello")
    assert "plain-text input provides only the key 'text'" in user_error(
        ["prep", "--input", tmp_path / "notes.txt", "--json-keys", "body", "--tokenizer", tokenizer_dir,
         "--output-prefix", tmp_path / "o"], capsys)
    run(["prep", "--input", corpus, "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / "o", "--quiet"])
    assert "already exists" in user_error(
        ["prep", "--input", corpus, "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / "o"], capsys)
    assert "--max-shard-size" in user_error(
        ["prep", "--input", corpus, "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / "p",
         "--max-shard-size", "lots"], capsys)


def test_console_script_exit_codes(tmp_path):
    exe = Path(sys.executable).parent / "tessera-data"
    help_text = subprocess.run([exe, "prep", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--json-keys", "--train-tokenizer", "--max-shard-size", "--workers", "--on-error", "--no-append-eod"):
        assert flag in help_text
    proc = subprocess.run([exe, "verify", tmp_path / "missing"], capture_output=True, text=True)
    assert proc.returncode == 2 and "missing.idx: not found" in proc.stderr and "Traceback" not in proc.stderr


def test_parse_max_shard_size():
    assert parse_max_shard_size("1000", 2) == 1000
    assert parse_max_shard_size("50M", 2) == 50_000_000
    assert parse_max_shard_size("500MB", 2) == 250_000_000
    assert parse_max_shard_size("1GiB", 4) == 2**30 // 4



def test_hf_dataset_dict_split(tmp_path, tokenizer_dir, capsys):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_dict({"text": ["a b c"]}),
                 "validation": Dataset.from_dict({"text": ["one", "two", None]})}).save_to_disk(str(tmp_path / "dd"))
    run(["prep", "--input", tmp_path / "dd", "--hf-split", "validation", "--tokenizer", tokenizer_dir,
         "--output-prefix", tmp_path / "o", "--quiet"])
    m = read_shard_manifest(tmp_path / "o_text_document")
    assert m.num_documents == 2 and m.model_extra["skipped"]["examples"][0]["line"] == 3  # the null row
    assert m.inputs[0].model_extra["hf_fingerprint"]
    assert "no split 'test'" in user_error(["prep", "--input", tmp_path / "dd", "--hf-split", "test", "--tokenizer",
                                           tokenizer_dir, "--output-prefix", tmp_path / "p"], capsys)


def test_compressed_inputs_multi_frame_and_truncated(tmp_path, tokenizer_dir, corpus_texts, capsys):
    import zstandard

    lines = [json.dumps({"text": t}).encode() + b"\n" for t in corpus_texts[:6]]
    plain = tmp_path / "p.jsonl"
    plain.write_bytes(b"".join(lines))
    c = zstandard.ZstdCompressor()
    (tmp_path / "m.jsonl.zst").write_bytes(c.compress(b"".join(lines[:2])) + c.compress(b"".join(lines[2:])))
    for name in ("p.jsonl", "m.jsonl.zst"):
        run(["prep", "--input", tmp_path / name, "--tokenizer", tokenizer_dir, "--output-prefix", tmp_path / name,
             "--quiet"])
    assert Path(f"{tmp_path}/m.jsonl.zst_text_document.bin").read_bytes() == \
        Path(f"{tmp_path}/p.jsonl_text_document.bin").read_bytes()
    (tmp_path / "t.jsonl.zst").write_bytes(c.compress(b"".join(lines))[:-40])
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(b"".join(lines))[:-40])
    for name in ("t.jsonl.zst", "t.jsonl.gz"):
        err = user_error(["prep", "--input", tmp_path / name, "--tokenizer", tokenizer_dir, "--output-prefix",
                          tmp_path / "out" / "t", "--quiet"], capsys)
        assert f"{name}: cannot read" in err and "truncated" in err
        assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
