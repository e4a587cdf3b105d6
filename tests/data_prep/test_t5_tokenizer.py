"""T5's tokenizer through `tessera-data prep`: a SentencePiece model made as T5's spiece.model is (pad
0, eos 1, unk 2, no bos; trained here with sentencepiece) converted with `--extra-ids` gets T5's
100-style sentinels after its pieces, `<extra_id_0>` last, with the ids transformers' T5 tokenizer
gives them, and the text's ids unchanged."""

from __future__ import annotations

import io

import pytest
from dp_helpers import run, stdlib_texts, write_jsonl

from tessera.common.tokenizer import load_tokenizer


def test_t5s_sentencepiece_model_converts_with_its_sentinels_at_t5s_ids(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    transformers = pytest.importorskip("transformers")
    texts = [t[:2000] for t in stdlib_texts(6)]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in texts])
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(line for t in texts for line in t.splitlines() if line),
                                   model_writer=model, vocab_size=300, model_type="unigram", pad_id=0, eos_id=1,
                                   unk_id=2, bos_id=-1)
    (tmp_path / "t5").mkdir()
    path = tmp_path / "t5" / "spiece.model"
    path.write_bytes(model.getvalue())
    assert run(["prep", "--input", corpus, "--tokenizer", path, "--extra-ids", "10",
                "--output-prefix", tmp_path / "out/t5", "--quiet"]) == 0
    tok = load_tokenizer(tmp_path / "out" / "tokenizer")
    ref = transformers.T5Tokenizer.from_pretrained(tmp_path / "t5", extra_ids=10)
    assert tok.vocab_size == 310 == len(ref)
    for i in range(10):
        assert tok.token_id(f"<extra_id_{i}>") == ref.convert_tokens_to_ids(f"<extra_id_{i}>") == 309 - i
    assert tok.eos_id == 1
    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert tok.encode(texts[0]) == sp.encode(texts[0])
