"""WordPiece tokenizers for BERT: trained by `tessera-data prep --tokenizer-type wordpiece`, or
converted from BERT's vocab.txt; both encode as transformers' BertTokenizer does."""

from __future__ import annotations

import json

import pytest
from dp_helpers import run, user_error, write_jsonl

from tessera.common.tokenizer import load_tokenizer

TEXT = ["The Quick brown fox jumps over the lazy dog. Café naïve résumé!", "Tokenizers split words: unbelievable."]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def bert_from_vocab(transformers, vocab_txt, tmp_path, lowercase: bool):
    """transformers' BertTokenizer made from nothing but the vocab.txt."""
    alone = tmp_path / "vocab_only"
    alone.mkdir()
    (alone / "vocab.txt").write_bytes(vocab_txt.read_bytes())
    return transformers.BertTokenizer.from_pretrained(alone, do_lower_case=lowercase)


def test_trained_wordpiece_has_berts_specials_and_encodes_as_transformers_bert_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXT * 20])
    assert run(["prep", "--input", corpus, "--train-tokenizer", "--tokenizer-type", "wordpiece", "--vocab-size", 260,
                "--no-append-eod", "--output-prefix", tmp_path / "out/w", "--quiet"]) == 0
    tok_dir = tmp_path / "out/tokenizer"
    tok = load_tokenizer(tok_dir)
    assert [tok.token_id(t) for t in SPECIALS] == [0, 1, 2, 3, 4]
    vocab = (tok_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert [tok.token_id(t) for t in vocab] == list(range(len(vocab)))
    assert any(t.startswith("##") for t in vocab)
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    from_vocab = bert_from_vocab(transformers, tok_dir / "vocab.txt", tmp_path, True)
    for text in TEXT:
        ours = tok.encode(text)
        assert ours == ref(text, add_special_tokens=False)["input_ids"]
        assert ours == from_vocab(text, add_special_tokens=False)["input_ids"]
        assert ref(text)["input_ids"] == [2, *ours, 3]  # [CLS] ... [SEP]


@pytest.mark.parametrize("cased", [False, True])
def test_berts_vocab_txt_converts_to_a_tokenizer_that_encodes_as_transformers_bert_tokenizer(tmp_path, cased):
    transformers = pytest.importorskip("transformers")
    words = ["the", "quick", "brown", "fox", "jump", "##s", "over", "lazy", "dog", "cafe", "naive", "##ve", "un",
             "##believ", "##able", "token", "##izer", "split", "word", "re", "##sume", ".", "!", ":", "a", "b"]
    if cased:
        words += ["The", "Quick", "Café", "Tokenizers"]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(SPECIALS + words) + "\n", encoding="utf-8")
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXT])
    assert run(["prep", "--input", corpus, "--tokenizer", vocab, "--no-append-eod", "--split-sentences",
                "--output-prefix", tmp_path / "out/w", "--quiet"]) == 0
    tok_dir = tmp_path / "out/tokenizer"
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["do_lower_case"] is (not cased) and config["mask_token"] == "[MASK]"
    tok = load_tokenizer(tok_dir)
    ref = bert_from_vocab(transformers, vocab, tmp_path, not cased)
    for text in TEXT:
        assert tok.encode(text) == ref(text, add_special_tokens=False)["input_ids"]


def test_lowercase_flag_on_a_byte_level_tokenizer_is_one_line(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXT])
    line = user_error(["prep", "--input", corpus, "--train-tokenizer", "--lowercase", "--output-prefix",
                       tmp_path / "out/w"], capsys)
    assert "--lowercase" in line and "wordpiece" in line
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_a_vocab_txt_listing_a_token_twice_is_one_line_and_writes_nothing(tmp_path, capsys):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(SPECIALS + ["the", "fox", "the"]) + "\n", encoding="utf-8")
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXT])
    line = user_error(["prep", "--input", corpus, "--tokenizer", vocab, "--no-append-eod", "--output-prefix",
                       tmp_path / "out/w"], capsys)
    assert str(vocab) in line and "'the'" in line and "twice" in line
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
