"""The paged KV cache's bookkeeping: a fixed pool of blocks, per-sequence block tables, and a
prefix cache of full blocks shared between sequences.

A block is free when no sequence references it (refcount 0). Free blocks sit in an LRU list;
a free block that still holds a full, hashed block of some earlier prompt stays findable in the
prefix cache until the pool has to reuse it (it is evicted oldest-first). A full block's key is
hash(parent block's key, its token ids), so equal keys mean equal whole prefixes.
"""

from __future__ import annotations

from collections import OrderedDict

from tessera.inference.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refcount = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block key -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # Prefix-cache statistics (tokens), for the hit-rate metric.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- accounting ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------
    def _block_key(self, seq: Sequence, index: int) -> int:
        """Key of the seq's full block `index`, computed once and remembered on the sequence."""
        while len(seq.block_hashes) <= index:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[i - 1] if i else 0
            bs = self.block_size
            seq.block_hashes.append(hash((parent, tuple(seq.tokens(i * bs, (i + 1) * bs)))))
        return seq.block_hashes[index]

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of seq's tokens, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs:
            return []
        full = (seq.num_tokens - 1) // self.block_size
        hits = []
        for i in range(full):
            block = self.cached.get(self._block_key(seq, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries += query_tokens
        self.prefix_hits += hit_tokens

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Offer seq's newly completed full blocks (all tokens computed) to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        for i in range(seq.num_hashed_blocks, full):
            key = self._block_key(seq, i)
            block = seq.block_table[i]
            if key not in self.cached and self.block_hash[block] is None:
                self.cached[key] = block
                self.block_hash[block] = key
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, prefix_hits: list[int] | None = None) -> bool:
        """Grow seq's block table to hold `num_tokens`, first adopting `prefix_hits` (an empty
        table only). All or nothing: returns False and changes nothing when the pool is short."""
        hits = prefix_hits or []
        have = len(seq.block_table) + len(hits)
        need = max(0, self.blocks_needed(num_tokens) - have)
        reclaim = sum(1 for b in hits if self.refcount[b] == 0)  # hits sitting in the free list
        if need > len(self.free) - reclaim:
            return False
        for b in hits:
            if self.refcount[b] == 0:
                del self.free[b]
            self.refcount[b] += 1
        seq.block_table.extend(hits)
        for _ in range(need):
            b, _ = self.free.popitem(last=False)  # least recently used first
            key = self.block_hash[b]
            if key is not None:  # evict its cached content
                if self.cached.get(key) == b:
                    del self.cached[key]
                self.block_hash[b] = None
            self.refcount[b] = 1
            seq.block_table.append(b)
        return True

    def free_seq(self, seq: Sequence) -> None:
        """Drop seq's references; blocks nobody else uses return to the free list."""
        # Tail blocks are released first so that they are evicted before the shared heads.
        for b in reversed(seq.block_table):
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)  # nothing worth keeping: reuse first
        seq.block_table = []
        seq.num_hashed_blocks = 0
