"""`tessera-data prep --tokenizer FILE`: a SentencePiece model (trained here with sentencepiece) and
a tiktoken BPE file (generated here with tiktoken) are converted by transformers' converters into
a tokenizer.json, and the shards hold exactly the ids the original library gives, document by
document, on a corpus."""

from __future__ import annotations

import base64
import io

import pytest
from dp_helpers import run, stdlib_texts, user_error, write_jsonl

from tessera.common.indexed_dataset import IndexedDataset
from tessera.common.shard import read_shard_manifest
from tessera.common.tokenizer import load_tokenizer


def _corpus(tmp_path, n: int = 12):
    # Real text (stdlib sources), a few non-ASCII and whitespace oddities included. Not included: a
    # run of one repeated character ("x" * 50), where pieces of equal score tie and sentencepiece and
    # the converted tokenizer split the run differently (seen for both BPE and unigram models).
    texts = [t[:3000] for t in stdlib_texts(n)] + ["naïve café — 東京\ttabs  and   spaces\n\n"]
    return texts, write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in texts])


def _shard_docs(prefix) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds.document_tokens(d).tolist() for d in range(ds.num_documents)]


SPM_KINDS = {  # Llama 2's settings (BPE, byte fallback, no normalisation), and sentencepiece's defaults
    "llama2-bpe": dict(model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                       remove_extra_whitespaces=False),
    "unigram-nfkc": dict(model_type="unigram"),
}


@pytest.mark.parametrize("kind", list(SPM_KINDS))
def test_sentencepiece_model_converts_to_the_same_ids(tmp_path, kind):
    spm = pytest.importorskip("sentencepiece")
    texts, corpus = _corpus(tmp_path)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(line for t in texts for line in t.splitlines() if line),
                                   model_writer=model, vocab_size=400, character_coverage=1.0, **SPM_KINDS[kind])
    path = tmp_path / "sp.model"
    path.write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert run(["prep", "--input", corpus, "--tokenizer", path, "--output-prefix", tmp_path / "out/sp", "--quiet"]) == 0
    tok = load_tokenizer(tmp_path / "out" / "tokenizer")
    assert tok.vocab_size == sp.get_piece_size() and tok.eos_id == sp.eos_id()
    docs = _shard_docs(tmp_path / "out" / "sp_text_document")
    for text, ids in zip(texts, docs):
        assert ids[:-1] == sp.encode(text), text[:60]  # then the appended end of document
        assert ids[-1] == sp.eos_id()
        assert tok.decode(ids[:-1]) == sp.decode(ids[:-1])
    assert read_shard_manifest(tmp_path / "out" / "sp_text_document").tokenizer_fingerprint == tok.fingerprint


def test_tiktoken_file_converts_to_the_same_ids(tmp_path):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken._educational import bpe_train

    from tessera.data_prep.tokenizer_convert import CL100K_PATTERN

    texts, corpus = _corpus(tmp_path)
    ranks = bpe_train("\n".join(texts)[:20000], 300, CL100K_PATTERN, visualise=None)
    path = tmp_path / "tokenizer.model"  # Llama 3's name for its tiktoken file: detected by content
    # tiktoken's file format, as tiktoken.load.dump_tiktoken_bpe writes it (which needs blobfile)
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in sorted(ranks.items(), key=lambda x: x[1])))
    enc = tiktoken.Encoding("test", pat_str=CL100K_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    assert run(["prep", "--input", corpus, "--tokenizer", path, "--output-prefix", tmp_path / "out/tt", "--quiet"]) == 0
    tok = load_tokenizer(tmp_path / "out" / "tokenizer")
    assert tok.eos_id == len(ranks)
    for text, ids in zip(texts, _shard_docs(tmp_path / "out" / "tt_text_document")):
        assert ids[:-1] == enc.encode_ordinary(text), text[:60]
        assert ids[-1] == enc.eot_token
        assert tok.decode(ids[:-1]) == text


def test_a_file_that_is_no_tokenizer_is_one_line(tmp_path, capsys):
    pytest.importorskip("sentencepiece")
    _, corpus = _corpus(tmp_path, 2)
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"\x00\x01 definitely not a tokenizer")
    line = user_error(["prep", "--input", corpus, "--tokenizer", junk, "--output-prefix", tmp_path / "o",
                       "--quiet"], capsys)
    assert str(junk) in line and "neither a tiktoken BPE file nor a SentencePiece model" in line
    assert not (tmp_path / "tokenizer").exists() and not list(tmp_path.glob("o_*"))
