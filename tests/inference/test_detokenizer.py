"""Incremental detokenization: the library's stream (tokenizers' DecodeStream) against the
Python window decode it replaced, token by token, on ids that split characters."""

from __future__ import annotations

import random

import pytest

from tessera.common.tokenizer import load_tokenizer
from tessera.inference.core.detokenizer import IncrementalDetokenizer, decode_with_offsets


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return load_tokenizer(next(tiny_ckpt.glob("checkpoints/iter_*/tokenizer")))


def stream(tok, ids: list[int], fast: bool, stop: list[str], skip_special_tokens: bool) -> list:
    """What a server sees: per token the stop string completed and the text released, then the rest."""
    det = IncrementalDetokenizer(tok, stop, skip_special_tokens, fast=fast)
    assert (det._stream is not None) == fast
    seen = []
    for t in ids:
        stopped = det.append(t)
        if stopped:
            det.finish(flush=False)
        seen.append((stopped, det.take_new_text()))
        if stopped:
            return seen
    det.finish()
    seen.append(("end", det.take_new_text()))
    return seen


def token_streams(tok) -> list[list[int]]:
    rng = random.Random(0)
    vocab = tok.vocab_size
    specials = [tok.eos_id, tok.bos_id]
    text = tok.encode("naïve café — 東京 🙂 json.loads(s)\n")
    return ([rng.randrange(vocab) for _ in range(300)] + specials,  # byte tokens >= 0x80 split characters
            text + specials[:1] + text,
            [rng.choice(specials + text) for _ in range(200)])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("stop", [[], ["json.lo"], ["é", "\n"]])
def test_library_stream_releases_the_same_text_as_the_window_decode(tok, stop, skip_special_tokens):
    for ids in token_streams(tok):
        fast = stream(tok, ids, True, stop, skip_special_tokens)
        assert fast == stream(tok, ids, False, stop, skip_special_tokens)
        assert any(piece for _, piece in fast)


def test_a_stream_the_library_refuses_continues_in_python(tok, monkeypatch):
    ids = token_streams(tok)[0]
    reference = stream(tok, ids, False, [], True)
    det = IncrementalDetokenizer(tok, [])
    calls = 0

    class Refusing:
        def step(self, backend, token):
            nonlocal calls
            calls += 1
            if calls > 40:
                raise Exception("invalid prefix")
            return inner.step(backend, token)

    inner, det._stream = det._stream, Refusing()
    seen = []
    for t in ids:
        assert det.append(t) is None
        seen.append((None, det.take_new_text()))
    det.finish()
    seen.append(("end", det.take_new_text()))
    assert det._stream is None and calls == 41
    assert seen == reference


def test_offsets_index_the_decoded_text(tok):
    ids = token_streams(tok)[1]
    text, offsets = decode_with_offsets(tok, ids)
    assert text == tok.decode(ids)
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(text)
