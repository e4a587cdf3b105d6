"""Batch tokenization: texts in, raw token arrays out, in input order for any number of workers.

The Rust tokenizer's `encode_batch_fast` already spreads one batch over all cores (and releases
the GIL while it works), so the Python side does as little per document as it can: one list of
ids per document, one `np.fromiter` over all of them, and the bytes go to disk unchanged.

`--workers 1` runs the tokenizer on a background thread, so reading the next batch and packing
the previous one into arrays overlap the encoding of this one; `--workers N` runs whole batches
(encode and pack) in N spawned processes. Either way results come back in
submission order and the batches are cut the same way, so the output is byte-identical.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context

import numpy as np


@dataclass
class EncodedBatch:
    """Tokens of a batch of documents, concatenated, with per-sequence lengths: one sequence per
    document, or (`sentences`, from --split-sentences) that many sequences per document."""

    tokens: np.ndarray  # token dtype, all documents back to back
    lengths: np.ndarray  # int64 [sequences]
    bad: dict[int, str] = field(default_factory=dict)  # document index in the batch -> reason
    sentences: np.ndarray | None = None  # int64 [documents]: sequences of each document

    @property
    def num_documents(self) -> int:
        return len(self.lengths) if self.sentences is None else len(self.sentences)

    def without(self, drop: set[int]) -> EncodedBatch:
        """The batch minus documents `drop` (records rejected by another key's encoding)."""
        keep = np.ones(self.num_documents, dtype=bool)
        keep[sorted(drop)] = False
        if self.sentences is None:
            return EncodedBatch(self.tokens[np.repeat(keep, self.lengths)], self.lengths[keep])
        seq_keep = np.repeat(keep, self.sentences)
        return EncodedBatch(self.tokens[np.repeat(seq_keep, self.lengths)], self.lengths[seq_keep],
                            sentences=self.sentences[keep])


class BatchEncoder:
    """Encodes lists of texts with one tokenizer; picklable by path so workers can rebuild it."""

    def __init__(self, tokenizer_json: str, dtype: str, bos_id: int | None, eod_id: int | None,
                 sentence_language: str | None = None):
        self.tokenizer_json = tokenizer_json
        self.dtype = np.dtype(dtype)
        self.bos_id = bos_id
        self.eod_id = eod_id
        # --split-sentences: documents are split (tessera.data_prep.sentences) and each sentence is
        # encoded as its own sequence; BOS opens the first, EOD closes the last (as Megatron appends it).
        self.sentence_language = sentence_language
        self._tok = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tok": None}

    @property
    def tokenizer(self):
        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(self.tokenizer_json)
        return self._tok

    def encode(self, texts: list[str]) -> tuple[list, dict[int, str]]:
        """Run the Rust tokenizer (GIL released) -> (Encoding objects or id lists, rejected docs)."""
        tok = self.tokenizer
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips offsets (tokenizers>=0.20)
        try:
            return encode(texts, add_special_tokens=False), {}
        except Exception:
            pass
        # Some text in the batch cannot be encoded (e.g. a lone UTF-16 surrogate from a JSON
        # "\\udXXX" escape, which is not valid Unicode text): find which, one by one.
        ids: list[list[int]] = []
        bad: dict[int, str] = {}
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                ids.append([])
                bad[i] = f"invalid UTF-8 (lone surrogate at character {exc.start})"
                continue
            try:
                ids.append(tok.encode(text, add_special_tokens=False).ids)
            except Exception as exc:
                ids.append([])
                msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                bad[i] = f"cannot be tokenized ({msg})"
        return ids, bad

    def pack(self, encoded: list, bad: dict[int, str]) -> EncodedBatch:
        """Id lists -> one token array plus lengths, with BOS/EOD added (needs the GIL)."""
        n = len(encoded)
        ids = [x for i, x in enumerate(encoded) if i not in bad] if bad else [e.ids for e in encoded]
        if self.bos_id is not None:
            bos = self.bos_id
            for x in ids:
                x.insert(0, bos)
        if self.eod_id is not None:
            eod = self.eod_id
            for x in ids:
                x.append(eod)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        total = int(lengths.sum())
        tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype, count=total)
        if bad:
            # Re-insert the rejected documents as empty so indices still match the batch.
            full = np.zeros(n, dtype=np.int64)
            full[[i for i in range(n) if i not in bad]] = lengths
            lengths = full
        return EncodedBatch(tokens, lengths, bad)

    def __call__(self, texts: list[str]) -> EncodedBatch:
        if self.sentence_language is not None:
            return self.pack_sentences(*self.encode_sentences(texts))
        return self.pack(*self.encode(texts))

    def encode_sentences(self, texts: list[str]) -> tuple[list, dict[int, str], np.ndarray]:
        """Split each text into sentences and encode them all in one batch -> (encodings, rejected
        documents, sentences per document)."""
        from tessera.data_prep.sentences import split_sentences

        pieces: list[str] = []
        counts = np.zeros(len(texts), dtype=np.int64)
        bad: dict[int, str] = {}
        for i, text in enumerate(texts):
            try:
                sentences = split_sentences(text, self.sentence_language or "en")
            except Exception as exc:  # pysbd's regexes on pathological text: reject the record, not the run
                bad[i] = f"cannot be split into sentences ({type(exc).__name__})"
                continue
            pieces.extend(sentences)
            counts[i] = len(sentences)
        encoded, bad_sentences = self.encode(pieces)
        if bad_sentences:  # a sentence that cannot be encoded rejects its whole document
            owner = np.repeat(np.arange(len(texts)), counts)
            for j, reason in bad_sentences.items():
                bad.setdefault(int(owner[j]), reason)
            encoded = [e if isinstance(e, list) else e.ids for e in encoded]
            for j in bad_sentences:
                encoded[j] = []
        return encoded, bad, counts

    def pack_sentences(self, encoded: list, bad: dict[int, str], counts: np.ndarray) -> EncodedBatch:
        """Sentence encodings -> one token array, per-sentence lengths and sentences per document.
        Sentences of no tokens are dropped (Megatron's rule); a rejected document keeps none."""
        ids = [e if isinstance(e, list) else e.ids for e in encoded]
        lengths: list[int] = []
        flat: list[list[int]] = []
        kept = np.zeros(len(counts), dtype=np.int64)
        start = 0
        for d, n in enumerate(counts.tolist()):
            doc = [x for x in ids[start:start + n] if x] if d not in bad else []
            start += n
            if doc and self.bos_id is not None:
                doc[0] = [self.bos_id, *doc[0]]
            if doc and self.eod_id is not None:
                doc[-1] = [*doc[-1], self.eod_id]
            flat.extend(doc)
            lengths.extend(map(len, doc))
            kept[d] = len(doc)
        lengths_arr = np.asarray(lengths, dtype=np.int64)
        tokens = np.fromiter(itertools.chain.from_iterable(flat), dtype=self.dtype, count=int(lengths_arr.sum()))
        return EncodedBatch(tokens, lengths_arr, bad, kept)

    def encode_keys(self, texts_per_key: list[list[str]]) -> list[tuple]:
        if self.sentence_language is not None:
            return [self.encode_sentences(texts) for texts in texts_per_key]
        return [self.encode(texts) for texts in texts_per_key]

    def pack_any(self, encoded: tuple) -> EncodedBatch:
        """What `encode_keys` gave for one key, packed (on the caller's thread)."""
        return self.pack_sentences(*encoded) if self.sentence_language is not None else self.pack(*encoded)

    def encode_and_pack_keys(self, texts_per_key: list[list[str]]) -> list[EncodedBatch]:
        return [self(texts) for texts in texts_per_key]


_WORKER_ENCODER: BatchEncoder | None = None  # one per worker process, set by its initializer


def _init_worker(encoder: BatchEncoder, threads: int) -> None:
    global _WORKER_ENCODER
    # Share the cores between the workers instead of giving each a full-size Rust thread pool
    # (read when the pool starts, i.e. at the first encode; a user's own setting wins).
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    _WORKER_ENCODER = encoder


def _encode_in_worker(texts_per_key: list[list[str]]) -> list[EncodedBatch]:
    assert _WORKER_ENCODER is not None
    return _WORKER_ENCODER.encode_and_pack_keys(texts_per_key)


class OrderedEncoder:
    """Submit batches, get results back in submission order, with a bounded number in flight."""

    def __init__(self, encoder: BatchEncoder, workers: int):
        self.encoder = encoder
        self.workers = workers
        self.max_in_flight = 2 if workers <= 1 else 2 * workers
        self._executor: Executor
        if workers <= 1:
            self._executor = ThreadPoolExecutor(max_workers=1)
        else:
            # spawn, not fork: a forked child would inherit the Rust thread pool's state.
            self._executor = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"),
                                                 initializer=_init_worker,
                                                 initargs=(encoder, max(1, (os.cpu_count() or 1) // workers)))
        self._pending: deque[tuple[object, Future]] = deque()

    def submit(self, tag: object, texts_per_key: list[list[str]]) -> Iterator[tuple[object, list[EncodedBatch]]]:
        """Queue a batch; yields the finished results that had to be collected to make room."""
        if self.workers <= 1:
            future = self._executor.submit(self.encoder.encode_keys, texts_per_key)
        else:
            future = self._executor.submit(_encode_in_worker, texts_per_key)
        self._pending.append((tag, future))
        while len(self._pending) > self.max_in_flight:
            yield self._pop()

    def drain(self) -> Iterator[tuple[object, list[EncodedBatch]]]:
        while self._pending:
            yield self._pop()

    def _pop(self) -> tuple[object, list[EncodedBatch]]:
        tag, future = self._pending.popleft()
        if self.workers > 1:
            return tag, future.result()
        # Thread mode: the encoder thread only runs the Rust tokenizer; turning its output into
        # arrays happens here, on the caller's thread, while the encoder thread (and the Rust
        # thread pool) already works on the next batch.
        return tag, [self.encoder.pack_any(encoded) for encoded in future.result()]

    def close(self) -> None:
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> OrderedEncoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
