"""The encoder-decoder's cache bookkeeping: one block table per sequence that holds, in one run of
slots, the cross-attention keys/values of its P encoder tokens (slots 0..P-1, every decoder layer's,
computed once when the encoder runs) and then its decoder's self-attention keys/values (decoder
position d at slot P + d; position 0 is `decoder_start_token_id`).

The scheduler counts a sequence as its prompt (the encoder input) then its output tokens: position
p >= P - 1 is decoder position p - P + 1, so n scheduled tokens take n + 1 slots, never more than
max_model_len. Blocks are freed and preempted with the sequence (recompute reruns the encoder), as
any sequence's are.

Prefix caching is off: a block's keys/values depend on the whole encoder input (its attention is
bidirectional, and every decoder block attends over it), not on the tokens before it, so a
prefix-keyed block could hand one request another's keys. Said once at start.
"""

from __future__ import annotations

import logging

from tessera.inference.core.block_manager import BlockManager
from tessera.inference.core.sequence import Sequence

log = logging.getLogger("tessera.inference")


class CrossBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 prefix_cache_hash: str = "builtin"):
        if enable_prefix_caching:
            log.warning("prefix caching: off for this encoder-decoder (its cached keys/values depend on the whole "
                        "encoder input, not on a prefix); --no-prefix-caching silences this")
        super().__init__(num_blocks, block_size, False, prefix_cache_hash)

    def first_chunk(self, seq: Sequence) -> int:
        """The encoder runs over the whole prompt at once: a first chunk covers all of it."""
        return len(seq.prompt_ids)

    def allocate(self, seq: Sequence, num_tokens: int, prefix_hits: list[int] | None = None) -> bool:
        # P cross slots + (num_tokens - P + 1) decoder slots.
        return super().allocate(seq, num_tokens + 1, prefix_hits)
