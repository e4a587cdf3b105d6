"""BERT samples as Megatron-Core's BERT dataset builds them (megatron/core/datasets/bert_dataset.py
and masked_dataset.py; the facts, not the code):

* the sample index: each document of a sentence-split shard (one sequence per sentence) is cut
  into runs of consecutive sentences of about a target length (the sequence length less the
  three special tokens; with probability `short_seq_prob` a shorter one, uniform in [2, max]),
  a run ending once it reaches the target while more than one sentence remains, the last run
  taking the document's tail; documents with fewer sentences than a sample needs (two with the
  binary head) give none. The runs are shuffled.
* the pair: with the binary head the run is split at a random sentence into A and B and, with
  probability 1/2, A and B swap places (sentence-order prediction: the target is 1 when swapped);
  or, with `next_sentence` (Google BERT's next-sentence prediction), B is replaced by sentences
  from a random start in another document of the split (the target is 1 when random). Without
  the head the run is all A. The longer of A and B loses a token at a random end until both fit.
  `[CLS] A [SEP] B [SEP]`, token types 0 up to the first [SEP] and 1 after, then padding.
* the masks: `probability` of the tokens (at least one, at most probability x target length)
  are chosen as n-grams of up to `max_ngram` words (whole words when `whole_word`: a `##` piece
  belongs to the word before it), n drawn with probability proportional to 1/n, candidates in a
  random order, never [CLS]/[SEP]; each chosen token becomes [MASK] with probability 0.8, a
  random id of the vocabulary with 0.1, itself with 0.1, and is a label.

Megatron drops documents that hold a sentence over 512 tokens; here such a sentence is truncated
like any other. Every draw for a sample comes from `draws.sample_rng` of its global number, so a
sample is the same wherever and whenever it is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tessera.common.indexed_dataset import IndexedDataset
from tessera.trainer.objectives.documents import IGNORE_INDEX


@dataclass(frozen=True)
class MaskingOptions:
    probability: float = 0.15
    whole_word: bool = True
    max_ngram: int = 3
    short_seq_prob: float = 0.1
    binary_head: bool = False
    next_sentence: bool = False  # the binary target: B from another document (NSP) instead of A/B swapped (SOP)


@dataclass(frozen=True)
class SpecialIds:
    cls: int
    sep: int
    mask: int
    pad: int
    vocab_size: int  # random replacements are drawn from [0, vocab_size)


@dataclass
class BertSample:
    tokens: np.ndarray  # int64 [seq_length], padded with pad
    token_types: np.ndarray  # int64 [seq_length]: 0 for [CLS] A [SEP] (and padding), 1 for B [SEP]
    padding_mask: np.ndarray  # int64 [seq_length]: 1 on real tokens
    labels: np.ndarray  # int64 [seq_length]: the original token where masked, IGNORE_INDEX elsewhere
    binary_label: int  # 1 when A and B were swapped (B random, with next_sentence); IGNORE_INDEX without the head


def build_sample_index(dataset: IndexedDataset, first_doc: int, last_doc: int, max_tokens: int,
                       options: MaskingOptions, rng: np.random.Generator) -> np.ndarray:
    """int64 [M, 3]: (first sentence, end sentence, target length) of each sample of documents
    [first_doc, last_doc), shuffled."""
    min_sentences = 2 if options.binary_head else 1
    doc_idx = np.asarray(dataset.doc_idx[first_doc:last_doc + 1], dtype=np.int64)
    lengths = np.asarray(dataset.lengths, dtype=np.int64)
    out: list[tuple[int, int, int]] = []

    def target() -> int:
        if options.short_seq_prob > 0 and rng.random() < options.short_seq_prob:
            return int(rng.integers(2, max_tokens + 1))
        return max_tokens

    for d in range(len(doc_idx) - 1):
        s0, s1 = int(doc_idx[d]), int(doc_idx[d + 1])
        if s1 - s0 < min_sentences:
            continue
        start, tokens, count, goal = s0, 0, 0, target()
        for s in range(s0, s1):
            tokens += int(lengths[s])
            count += 1
            remaining = s1 - s - 1
            if (tokens >= goal and remaining > 1 and count >= min_sentences) or remaining == 0:
                out.append((start, s + 1, goal))
                start, tokens, count, goal = s + 1, 0, 0, target()
    index = np.asarray(out, dtype=np.int64).reshape(-1, 3)
    return index[rng.permutation(len(index))]


def continuation_flags(tokenizer_backend, vocab_size: int) -> np.ndarray:
    """bool [vocab_size]: the id is a WordPiece continuation (`##…`), part of the word before it."""
    flags = np.zeros(vocab_size, dtype=bool)
    for token, i in tokenizer_backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and token.startswith("##"):
            flags[i] = True
    return flags


RandomSentences = Callable[[np.random.Generator, int], list[np.ndarray]]


def make_pair(sentences: list[np.ndarray], target: int, options: MaskingOptions, rng: np.random.Generator,
              random_sentences: RandomSentences | None = None) -> tuple[np.ndarray, np.ndarray, bool, bool]:
    """(A, B, target, truncated): the run split into two segments that fit `target` tokens; the
    target is true when A and B were swapped (or, next_sentence, B is another document's)."""
    pivot, flipped = len(sentences), False
    if options.binary_head:
        pivot = 1 if len(sentences) < 3 else int(rng.integers(1, len(sentences)))
        flipped = bool(rng.random() < 0.5)
    empty = np.zeros(0, dtype=np.int64)
    a = np.concatenate(sentences[:pivot]).astype(np.int64) if pivot else empty
    b = np.concatenate(sentences[pivot:]).astype(np.int64) if pivot < len(sentences) else empty
    if flipped and options.next_sentence and random_sentences is not None:
        b = np.concatenate(random_sentences(rng, max(1, target - len(a)))).astype(np.int64)
    elif flipped:
        a, b = b, a
    excess = len(a) + len(b) - target
    if excess <= 0:
        return a, b, flipped, False
    coins = rng.random(excess) < 0.5  # per removed token: from the front (True) or the back
    cut = [[0, len(a)], [0, len(b)]]  # [start, end) kept of A and of B
    for front in coins:
        side = cut[0] if cut[0][1] - cut[0][0] > cut[1][1] - cut[1][0] else cut[1]
        if front:
            side[0] += 1
        else:
            side[1] -= 1
    return a[cut[0][0]:cut[0][1]], b[cut[1][0]:cut[1][1]], flipped, True


def mask_tokens(tokens: np.ndarray, target: int, special: np.ndarray, continuation: np.ndarray,
                ids: SpecialIds, options: MaskingOptions,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(masked tokens, labels) of one sequence; `special` marks positions never masked."""
    candidates: list[list[int]] = []  # words (or single tokens) as lists of positions
    for i, tok in enumerate(tokens.tolist()):
        if special[i]:
            continue
        if options.whole_word and continuation[tok] and candidates and not special[i - 1]:
            candidates[-1].append(i)
        else:
            candidates.append([i])
    budget = min(options.probability * target, max(1, int(round(len(tokens) * options.probability))))
    ngram = np.arange(1, options.max_ngram + 1)
    weights = 1.0 / ngram
    masked = tokens.copy()
    labels = np.full(len(tokens), IGNORE_INDEX, dtype=np.int64)
    chosen = 0
    for start in rng.permutation(len(candidates)).tolist():
        if chosen >= budget:
            break
        available = min(options.max_ngram, len(candidates) - start)
        p = weights[:available] / weights[:available].sum()
        n = int(rng.choice(ngram[:available], p=p))
        positions: list[int] = []
        while n > 0:  # the longest n-gram from here that stays within the budget
            positions = [pos for word in candidates[start:start + n] for pos in word]
            if chosen + len(positions) <= budget:
                break
            n -= 1
        if n == 0 or any(labels[pos] != IGNORE_INDEX for pos in positions):
            continue
        for pos in positions:
            labels[pos] = tokens[pos]
            if rng.random() < 0.8:
                masked[pos] = ids.mask
            elif rng.random() >= 0.5:
                masked[pos] = int(rng.integers(0, ids.vocab_size))
        chosen += len(positions)
    return masked, labels


def random_sentences(dataset: IndexedDataset, first_doc: int, last_doc: int, avoid_sentence: int) -> RandomSentences:
    """Next-sentence prediction's random B: from a random sentence of another document of
    [first_doc, last_doc) (Google BERT's), consecutive sentences until `need` tokens."""
    doc_idx = dataset.doc_idx

    def draw(rng: np.random.Generator, need: int) -> list[np.ndarray]:
        own = int(np.searchsorted(doc_idx, avoid_sentence, side="right")) - 1
        doc = own
        for _ in range(10):  # as Google's create_pretraining_data: a few tries to land elsewhere
            doc = int(rng.integers(first_doc, last_doc))
            if doc != own and doc_idx[doc + 1] > doc_idx[doc]:
                break
        s0, s1 = int(doc_idx[doc]), int(doc_idx[doc + 1])
        if s1 == s0:
            return [np.zeros(0, dtype=np.int64)]
        out, got = [], 0
        for s in range(int(rng.integers(s0, s1)), s1):
            out.append(np.asarray(dataset.get(s)))
            got += len(out[-1])
            if got >= need:
                break
        return out

    return draw


def build_sample(dataset: IndexedDataset, entry: np.ndarray, seq_length: int, ids: SpecialIds,
                 continuation: np.ndarray, options: MaskingOptions, rng: np.random.Generator,
                 doc_range: tuple[int, int] | None = None) -> BertSample:
    """The sample of one sample-index entry (first sentence, end sentence, target length);
    `doc_range`: the split's documents, where next-sentence prediction draws its random B."""
    first, end, target = (int(x) for x in entry)
    sentences = [np.asarray(dataset.get(s)) for s in range(first, end)]
    other = random_sentences(dataset, *doc_range, first) if options.next_sentence and doc_range else None
    a, b, swapped, _ = make_pair(sentences, target, options, rng, other)
    parts = [[ids.cls], a, [ids.sep]] + ([b, [ids.sep]] if len(b) else [])
    tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    n = len(tokens)
    special = np.zeros(n, dtype=bool)
    special[[0, len(a) + 1, n - 1]] = True
    masked, labels = mask_tokens(tokens, target, special, continuation, ids, options, rng)
    out_tokens = np.full(seq_length, ids.pad, dtype=np.int64)
    out_tokens[:n] = masked
    types = np.zeros(seq_length, dtype=np.int64)
    types[len(a) + 2:n] = 1
    padding = np.zeros(seq_length, dtype=np.int64)
    padding[:n] = 1
    out_labels = np.full(seq_length, IGNORE_INDEX, dtype=np.int64)
    out_labels[:n] = labels
    return BertSample(out_tokens, types, padding, out_labels, int(swapped) if options.binary_head else IGNORE_INDEX)
