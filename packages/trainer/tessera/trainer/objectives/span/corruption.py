"""T5's span corruption, from the facts of T5's preprocessors (`random_spans_noise_mask`,
`random_spans_helper`; the code is not copied):

* a window of `raw_length` tokens loses round(raw_length x noise_density) of them (at least one,
  and at least one kept), cut into round(noise / mean_span_length) spans (at least one, at most
  as many as either part has tokens): the noise and the kept tokens are each split into that many
  non-empty runs at random, and the runs alternate, kept first;
* the encoder input is the kept runs with each noise span replaced by one sentinel, then EOS;
  the decoder target is each noise span preceded by its sentinel, then EOS. Sentinel i is the
  tokenizer's `<extra_id_i>` (T5's last ids, counting down from the vocabulary's end);
* `raw_length`: the longest window whose corrupted input fits the encoder length (training.seq_length)
  and whose target fits the decoder length (span.decoder_seq_length) (T5's helper gives 568 raw tokens for 512 / 114 at 0.15 and 3).

Megatron-Core's T5 dataset reaches the same density and mean span length another way (n-gram
spans of geometric length over runs of sentences, as its BERT dataset masks); T5's own procedure
is kept here because it needs no sentence-split shards and fixes the input and target lengths of
every sample (so micro-batches have equal token counts, and no sample is cut).

Every draw of a sample comes from its own generator (trainer.mlm.draws.sample_rng), so a sample is
the same wherever and whenever it is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.common.errors import UserError
from tessera.trainer.objectives.documents import IGNORE_INDEX


@dataclass(frozen=True)
class SpanOptions:
    noise_density: float
    mean_span_length: float
    encoder_length: int
    decoder_length: int


def span_counts(length: int, opts: SpanOptions) -> tuple[int, int]:
    """(noise tokens, spans) of a `length`-token window."""
    noise = min(max(int(round(length * opts.noise_density)), 1), length - 1)
    spans = max(int(round(noise / opts.mean_span_length)), 1)
    return noise, min(spans, noise, length - noise)


def corrupted_lengths(length: int, opts: SpanOptions) -> tuple[int, int]:
    """(encoder input, decoder target) lengths of a corrupted `length`-token window, EOS included."""
    noise, spans = span_counts(length, opts)
    return length - noise + spans + 1, noise + spans + 1


def raw_length(opts: SpanOptions) -> int:
    """The longest window whose corruption fits both lengths, or a one-line UserError naming the
    model field that cannot hold even a short one."""
    best = None
    for length in range(2, 4 * opts.encoder_length + 8):
        enc, dec = corrupted_lengths(length, opts)
        if enc > opts.encoder_length:
            break
        if dec <= opts.decoder_length:
            best = length
    if best is None:
        enc, dec = corrupted_lengths(2, opts)
        field, have, need = (("training.seq_length", opts.encoder_length, enc) if enc > opts.encoder_length
                             else ("span.decoder_seq_length", opts.decoder_length, dec))
        raise UserError(f"{field} ({have}) cannot hold the corrupted spans of even a 2-token window (needs {need} "
                        "with EOS and sentinels); raise it")
    return best


def noise_mask(length: int, opts: SpanOptions, rng: np.random.Generator) -> np.ndarray:
    """bool [length]: the corrupted positions, as runs alternating kept / noise, kept first."""
    noise, spans = span_counts(length, opts)

    def segments(items: int) -> np.ndarray:
        first = np.zeros(items - 1, dtype=bool)
        first[:spans - 1] = True
        rng.shuffle(first)
        ids = np.cumsum(np.concatenate([[False], first]))
        return np.bincount(ids, minlength=spans)

    runs = np.stack([segments(length - noise), segments(noise)], axis=1).reshape(-1)
    starts = np.cumsum(runs)[:-1]
    flags = np.zeros(length, dtype=np.int64)
    flags[starts] = 1
    return np.cumsum(flags) % 2 == 1


@dataclass
class SpanSample:
    tokens: np.ndarray  # int64 [encoder_length]: kept tokens and sentinels, EOS, then pad
    padding_mask: np.ndarray  # int64 [encoder_length]: 1 on real tokens
    decoder_tokens: np.ndarray  # int64 [decoder_length]: the decoder start, then the target shifted right
    labels: np.ndarray  # int64 [decoder_length]: sentinels and noise spans, EOS, then IGNORE_INDEX


def build_sample(window: np.ndarray, opts: SpanOptions, sentinels: np.ndarray, eos: int, pad: int,
                 decoder_start: int, rng: np.random.Generator) -> SpanSample:
    """The corrupted sample of `window` (raw_length tokens); `sentinels[i]` is `<extra_id_i>`'s id."""
    window = np.asarray(window, dtype=np.int64)
    mask = noise_mask(len(window), opts, rng)
    starts = mask & ~np.concatenate([[False], mask[:-1]])  # the first token of each noise span
    span_id = np.cumsum(starts) - 1
    # Input: the kept tokens, with span i's sentinel where span i was.
    enc = np.where(starts, sentinels[span_id.clip(0)], window)[~mask | starts]
    # Target: sentinel i, then span i's tokens, for each span (each sentinel shifts what follows by one).
    noise_at = np.flatnonzero(mask)
    place = np.arange(len(noise_at)) + span_id[noise_at] + 1
    target = np.empty(len(noise_at) + int(starts.sum()), dtype=np.int64)
    target[place] = window[noise_at]
    target[place[starts[noise_at]] - 1] = sentinels[:int(starts.sum())]
    enc, target = np.append(enc, eos), np.append(target, eos)
    tokens = np.full(opts.encoder_length, pad, dtype=np.int64)
    tokens[:len(enc)] = enc
    padding = np.zeros(opts.encoder_length, dtype=np.int64)
    padding[:len(enc)] = 1
    labels = np.full(opts.decoder_length, IGNORE_INDEX, dtype=np.int64)
    labels[:len(target)] = target
    decoder = np.full(opts.decoder_length, pad, dtype=np.int64)
    decoder[0] = decoder_start
    decoder[1:len(target)] = target[:-1]
    return SpanSample(tokens, padding, decoder, labels)
