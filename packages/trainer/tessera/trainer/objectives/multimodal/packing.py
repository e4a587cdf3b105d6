"""Packed samples (`data.pack_samples`): rows of seq_length filled with several whole samples.

Samples go into rows in their global order (the mixture's seeded order, epoch after epoch), a row
closing when the next sample does not fit, so no sample, and so no image, is ever cut, and a pass
over the rows reads exactly the samples an unpacked pass reads, in the same order. Row r is a pure
function of the sample lengths, found by one greedy scan from sample 0: the data position stays one
integer (rows consumed) and a resumed run rebuilds the same rows. A sample longer than a row gets a
row of its own, where the builder refuses it as it does unpacked.

In a row each sample keeps its own positions (0, 1, ...), its own document id (attention never
crosses samples: the causal model's `document_ids`, as the text path's reset_attention_mask) and its
own labels; padding at the end is one more document whose labels are ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from tessera.trainer.objectives.documents import IGNORE_INDEX

PAD_ID = 0  # input id of padding positions; their labels are ignored and causal attention never reads them
CHUNK = 4096  # sample lengths computed at a time by the scan


class SamplePacking:
    """Row number -> the global sample numbers it holds; `lengths(n)` gives the positions (input
    tokens: the expanded length minus the last token, a label only) of samples n, an int array."""

    def __init__(self, lengths: Callable[[np.ndarray], np.ndarray], seq_length: int):
        self.lengths = lengths
        self.seq_length = seq_length
        self._starts = [0]  # first sample of each row found so far; the last row is still open
        self._next = 0  # next sample to place
        self._fill = 0  # positions used in the open row
        self._buf_start, self._buf = 0, np.zeros(0, dtype=np.int64)

    def row(self, r: int) -> range:
        """The global sample numbers of row r, in order."""
        while len(self._starts) < r + 2:
            self._place_next()
        return range(self._starts[r], self._starts[r + 1])

    def _place_next(self) -> None:
        n = self._next
        i = n - self._buf_start
        if i >= len(self._buf):
            self._buf_start, self._buf, i = n, np.asarray(self.lengths(np.arange(n, n + CHUNK)), dtype=np.int64), 0
        length = min(int(self._buf[i]), self.seq_length)  # a longer sample fills a row alone (and is refused there)
        # at most seq_length samples a row, so samples of no positions (one token) cannot keep a row open forever
        if self._fill + length > self.seq_length or n - self._starts[-1] >= self.seq_length:
            self._starts.append(n)
            self._fill = 0
        self._fill += length
        self._next = n + 1


def pack_row(samples: Sequence[tuple[np.ndarray, np.ndarray]], seq_length: int) -> dict[str, np.ndarray]:
    """One row from whole samples, each (token ids [L] with images expanded, counted [L]: whether
    token t is a target the loss counts): `tokens`, `labels`, `positions`, `document_ids`, each
    [seq_length]. Sample i takes L - 1 positions: its tokens but the last as inputs, the next token
    as label where counted."""
    tokens = np.full(seq_length, PAD_ID, dtype=np.int64)
    labels = np.full(seq_length, IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros(seq_length, dtype=np.int64)
    document_ids = np.full(seq_length, len(samples), dtype=np.int64)
    at = 0
    for i, (ids, counted) in enumerate(samples):
        n = max(len(ids) - 1, 0)
        if at + n > seq_length:
            raise ValueError(f"samples of {at + n} positions do not fit a row of {seq_length}")
        tokens[at:at + n] = ids[:n]
        labels[at:at + n] = np.where(counted[1:n + 1], ids[1:n + 1], IGNORE_INDEX)
        positions[at:at + n] = np.arange(n)
        document_ids[at:at + n] = i
        at += n
    positions[at:] = np.arange(seq_length - at)
    return {"tokens": tokens, "labels": labels, "positions": positions, "document_ids": document_ids}


def stack_rows(rows: Sequence[dict[str, np.ndarray]], key: str) -> torch.Tensor:
    return torch.from_numpy(np.stack([r[key] for r in rows]))
