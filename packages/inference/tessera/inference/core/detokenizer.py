"""Turning generated ids into text one token at a time, with stop strings and streaming hold-back.

Decoding token by token is wrong for byte-level BPE (a character can span tokens) and for
SentencePiece-style decoders (leading spaces depend on context), so each step decodes a short
window twice — up to the last emitted token, and through the new one — and takes the difference,
holding it back while it ends in an incomplete UTF-8 sequence (U+FFFD). With a Hugging Face
`tokenizers` backend that window scheme runs inside the library (`tokenizers.decoders.DecodeStream`,
the same prefix/read offsets, one call per token; vLLM V1's fast detokenizer uses it too): an
`append` takes 1.2 us instead of 2.0 us (32 sequences x 64 random ids of the serving benchmark's
byte-level BPE, best of 7, one core; the library call itself is 0.6 us). Detokenization was 0.7% of
an engine step at 32 concurrent requests (benchmarks/serving_profile.py), so this is housekeeping,
not where serving time goes. The offsets are kept here as well, so the final flush and a fallback
(should the library refuse a window) continue where the stream stopped.

Stop strings: the text is searched from just before the new piece (a stop string may straddle
tokens) and cut before the first match. While streaming, the last (longest stop - 1) characters
are withheld, since they might turn out to start a stop string.
"""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from tessera.common.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True, fast: bool = True):
        """`fast=False` keeps the decoding in Python (the reference the fast path is tested against)."""
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.emitted = 0
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.finished = False
        self._len_before_last = 0
        backend = self._backend = getattr(tokenizer, "backend", None)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) \
            if fast and isinstance(backend, HFTokenizer) else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _delta(self, flush: bool = False) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (flush or not full.endswith(_REPLACEMENT)):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def append(self, token: int, check_stop: bool = True) -> str | None:
        """Add a token; returns the stop string it completed (text is then cut before it)."""
        ids = self.ids
        ids.append(token)
        text = self.text
        self._len_before_last = len(text)
        # The text the id adds ("" while it ends in an incomplete character), from the stream (inline:
        # this runs once per sequence per step) or, without one, from the Python window.
        if self._stream is None:
            delta = self._delta()
        else:
            try:
                delta = self._stream.step(self._backend, token)
            except Exception:  # the library refused the window (a decoder whose text does not extend its prefix)
                self._stream = None
                delta = self._delta()
            else:
                if delta is None:
                    return None
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        if not delta:
            return None
        self.text = text + delta
        if not (check_stop and self.stop):
            return None
        start = max(0, len(text) - self.holdback)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[:best[0]]
        return best[1]

    def finish(self, drop_last_token: bool = False, flush: bool = True) -> None:
        """No more tokens: drop the stop token's own text if asked, and release what was held
        (a partial character is flushed as U+FFFD, except after a stop string cut the text)."""
        if drop_last_token:
            self.text = self.text[:self._len_before_last]
        elif flush:
            self.text += self._delta(flush=True)
        self.finished = True

    def take_new_text(self) -> str:
        """Text not yet handed out, minus what must be held back while still generating."""
        text = self.text
        end = len(text) if self.finished or not self.holdback else max(self.emitted, len(text) - self.holdback)
        piece = text[self.emitted:end]
        self.emitted = end
        return piece


def decode_with_offsets(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> tuple[str, list[int]]:
    """The text of `ids` and, for each token, the character offset in that text where its piece
    starts (OpenAI's `text_offset`). Decoded incrementally (linear in len(ids)), so the offsets
    are exactly aligned with the returned text: a token whose bytes complete a character started
    by an earlier one starts where that character does, and a skipped special token has an empty
    piece at the offset where it stands."""
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens)
    offsets = []
    for token in ids:
        offsets.append(len(detok.text))
        detok.append(token, check_stop=False)
    detok.finish()
    return detok.text, offsets
