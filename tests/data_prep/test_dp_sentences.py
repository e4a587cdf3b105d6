"""`tessera-data prep --split-sentences`: one sequence per sentence, documents kept, in the `.idx`
exactly as Megatron-Core's own IndexedDatasetBuilder writes the same documents."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dp_helpers import run, user_error, write_jsonl

from tessera.common.indexed_dataset import IndexedDataset

pysbd = pytest.importorskip("pysbd")

SENTENCES = [
    "The river rose after three days of rain.", "Mr. Smith closed the shop early on Friday.",
    "Nobody expected the bridge to hold.", "It held, and the town cheered.",
    "Dr. Jones measured the water at noon.", "The level was 4.5 metres above normal!",
    "Would the school open on Monday?", "The mayor said it would.", "Children walked along the bank.",
    "A heron stood still in the shallows.", "Boats were tied to the old oak trees.",
    "By evening the clouds had gone.",
]


def prose(n_docs: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(SENTENCES[j] for j in rng.choice(len(SENTENCES), size=int(rng.integers(1, 6))))
            for _ in range(n_docs)]


@pytest.fixture(scope="module")
def wordpiece_prep(tmp_path_factory):
    d = tmp_path_factory.mktemp("sentences")
    texts = prose(24)
    corpus = write_jsonl(d / "corpus.jsonl", [{"text": t} for t in texts])
    assert run(["prep", "--input", corpus, "--train-tokenizer", "--tokenizer-type", "wordpiece", "--vocab-size", 300,
                "--split-sentences", "--no-append-eod", "--output-prefix", d / "out/bert", "--quiet"]) == 0
    return d, texts


def test_split_sentences_writes_a_sequence_per_sentence_and_megatrons_document_index(wordpiece_prep):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tokenizers import Tokenizer

    d, texts = wordpiece_prep
    prefix = d / "out/bert_text_document"
    tok = Tokenizer.from_file(str(d / "out/tokenizer/tokenizer.json"))
    seg = pysbd.Segmenter(language="en", clean=False)
    ref = d / "megatron"
    builder = IndexedDatasetBuilder(f"{ref}.bin", dtype=np.uint16)
    for text in texts:  # Megatron's preprocess_data.py: sentences encoded one by one, empty ones dropped
        ids = [tok.encode(s, add_special_tokens=False).ids for s in seg.segment(text)]
        ids = [x for x in ids if x]
        builder.add_document(np.concatenate(ids), [len(x) for x in ids])
    builder.finalize(f"{ref}.idx")
    assert (d / "out/bert_text_document.idx").read_bytes() == ref.with_suffix(".idx").read_bytes()
    assert (d / "out/bert_text_document.bin").read_bytes() == ref.with_suffix(".bin").read_bytes()
    ds = IndexedDataset(prefix)
    manifest = json.loads(prefix.with_suffix(".json").read_text())
    assert ds.num_documents == len(texts) == manifest["num_documents"] and len(ds) > len(texts)
    assert manifest["split_sentences"] is True
    assert run(["verify", prefix]) == 0


def test_split_sentences_cuts_shards_between_documents_only_and_is_the_same_with_worker_processes(
        wordpiece_prep, tmp_path):
    d, texts = wordpiece_prep
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    assert run(["prep", "--input", corpus, "--tokenizer", d / "out/tokenizer", "--split-sentences", "--no-append-eod",
                "--max-shard-size", 100, "--output-prefix", tmp_path / "s", "--quiet"]) == 0
    assert run(["prep", "--input", corpus, "--tokenizer", d / "out/tokenizer", "--split-sentences", "--no-append-eod",
                "--workers", 2, "--batch-chars", 200, "--output-prefix", tmp_path / "w", "--quiet"]) == 0
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w_text_document{suffix}").read_bytes() == (d / f"out/bert_text_document{suffix}").read_bytes()
    whole = IndexedDataset(d / "out/bert_text_document")
    shards = [IndexedDataset(p.with_suffix("")) for p in sorted(tmp_path.glob("s_text_document_*.idx"))]
    assert len(shards) > 1
    docs = [[np.asarray(s.get(i)).tolist() for i in range(s.doc_idx[k], s.doc_idx[k + 1])]
            for s in shards for k in range(s.num_documents)]
    assert docs == [[np.asarray(whole.get(i)).tolist() for i in range(whole.doc_idx[k], whole.doc_idx[k + 1])]
                    for k in range(whole.num_documents)]


def test_split_sentences_with_an_unknown_language_is_one_line(wordpiece_prep, tmp_path, capsys):
    d, _ = wordpiece_prep
    line = user_error(["prep", "--input", d / "corpus.jsonl", "--tokenizer", d / "out/tokenizer", "--split-sentences",
                       "--sentence-language", "xx", "--no-append-eod", "--output-prefix", tmp_path / "x"], capsys)
    assert "--sentence-language" in line and "xx" in line
    assert not list(tmp_path.iterdir())


def test_split_sentences_without_pysbd_is_one_line_naming_the_extra(wordpiece_prep, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pysbd", None)  # as if not installed
    d, _ = wordpiece_prep
    line = user_error(["prep", "--input", d / "corpus.jsonl", "--tokenizer", d / "out/tokenizer", "--split-sentences",
                       "--no-append-eod", "--output-prefix", tmp_path / "x"], capsys)
    assert "pysbd" in line and "tessera-data-prep[sentences]" in line
    assert not list(tmp_path.iterdir())
