"""The hybrid kind's cache bookkeeping: the paged KV blocks of its attention layers (BlockManager)
and, beside them, one slot of the state pool per running sequence, holding every Mamba layer's
convolution window and scan state (worker/state/pool.py holds the tensors).

A slot is taken with the sequence's first blocks and given back with them: when it finishes, is
aborted or is preempted (recompute: the sequence later re-prefills from position 0 with a fresh
state, so nothing of the old slot is kept). As in vLLM's hybrid cache, a sequence has exactly one
state whatever its length, and the pool is sized for the most sequences that can run at once
(`max_num_seqs`), so the state never limits admission before the sequence slots do.

Prefix caching is off: a cached prefix would let a sequence start past position 0, and the Mamba
layers would need their state at that block boundary, which is not kept. Said once at start.
"""

from __future__ import annotations

import logging

from tessera.inference.core.block_manager import BlockManager
from tessera.inference.core.sequence import Sequence

log = logging.getLogger("tessera.inference")


class StateBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 prefix_cache_hash: str = "builtin", state_slots: int = 1):
        if enable_prefix_caching:
            log.warning("prefix caching: off for this hybrid model (its Mamba layers' states are not kept at block "
                     "boundaries, so a cached prefix could not be resumed); --no-prefix-caching silences this")
        super().__init__(num_blocks, block_size, False, prefix_cache_hash)
        if state_slots < 1:
            raise ValueError(f"state_slots must be at least 1, not {state_slots}")
        self.num_state_slots = state_slots
        self.free_slots: list[int] = list(range(state_slots - 1, -1, -1))  # a stack: lowest slot first
        self.slots: dict[str, int] = {}  # request id -> its state slot

    @classmethod
    def engine_kwargs(cls, cfg) -> dict:
        return {"state_slots": cfg.max_num_seqs}

    def state_slot(self, seq: Sequence) -> int:
        return self.slots.get(seq.request_id, -1)

    def allocate(self, seq: Sequence, num_tokens: int, prefix_hits: list[int] | None = None) -> bool:
        """BlockManager.allocate, plus a state slot for a sequence that has none; all or nothing."""
        new = seq.request_id not in self.slots
        if new and not self.free_slots:
            return False
        if not super().allocate(seq, num_tokens, prefix_hits):
            return False
        if new:
            self.slots[seq.request_id] = self.free_slots.pop()
        return True

    def free_seq(self, seq: Sequence) -> None:
        super().free_seq(seq)
        slot = self.slots.pop(seq.request_id, None)
        if slot is not None:
            self.free_slots.append(slot)
