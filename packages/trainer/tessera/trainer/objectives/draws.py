"""Random draws that belong to one sample, not to a process: a generator seeded by (seed, sample
number, stream), so the same sample gets the same masks on resume, on any data-parallel rank and
in any micro-batch order (Megatron seeds a RandomState with seed + sample index for the same
reason). Shared by every objective that corrupts its samples at load time (mlm/'s masking,
span/'s corruption).

numpy's SeedSequence mixes the words, so neighbouring seeds and samples give unrelated streams
(seed + index would make sample 1 of seed 0 equal sample 0 of seed 1).
"""

from __future__ import annotations

import numpy as np

_WORD = (1 << 64) - 1


def sample_rng(seed: int, sample: int, *stream: int) -> np.random.Generator:
    """The generator of global sample `sample` under `seed`; `stream` keeps separate purposes
    (e.g. dataset, split, masking vs sentence order) apart."""
    words = [seed & _WORD, sample & _WORD, *(s & _WORD for s in stream)]
    return np.random.default_rng(np.random.SeedSequence(words))
