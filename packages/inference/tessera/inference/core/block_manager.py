"""The paged KV cache's bookkeeping: a fixed pool of blocks, the block table of every request
(kept here, by request id, not on the sequences), and a prefix cache of full blocks shared
between sequences.

A block is free when no sequence references it (refcount 0). Free blocks sit in an LRU list;
a free block that still holds a full, hashed block of some earlier prompt stays findable in the
prefix cache until the pool has to reuse it (it is evicted oldest-first). A full block's key is
hash(parent block's key, its token ids), so equal keys mean equal whole prefixes. The hash is
Python's 64-bit `hash` by default; a collision (which someone who can send prompts can search
for) would let one request attend over another's cached keys/values, so a server shared by
tenants sets `prefix_cache_hash="sha256"` (`--prefix-cache-hash sha256`): 32-byte SHA-256 keys
over the parent key and the tokens as little-endian int64. A block holding image tokens (a
vision-language request) adds the SHA-256 of each of its images' pixels to its key.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from tessera.inference.core.image_inputs import image_keys
from tessera.inference.core.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 prefix_cache_hash: str = "builtin"):
        if prefix_cache_hash not in ("builtin", "sha256"):
            raise ValueError(f"prefix_cache_hash must be builtin or sha256, not {prefix_cache_hash!r}")
        self.sha256 = prefix_cache_hash == "sha256"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refcount = [0] * num_blocks
        self.block_hash: list[int | bytes | None] = [None] * num_blocks
        self.cached: dict[int | bytes, int] = {}  # block key -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.tables: dict[str, list[int]] = {}  # request id -> its blocks, in position order
        self.num_hashed: dict[str, int] = {}  # request id -> leading full blocks offered to the prefix cache
        # Prefix-cache statistics (tokens), for the hit-rate metric.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- accounting ------------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq: Sequence) -> list[int]:
        """seq's block table (empty when it holds no blocks)."""
        return self.tables.get(seq.request_id, [])

    def state_slot(self, seq: Sequence) -> int:
        """seq's slot in a per-sequence state pool (hybrid models: state_manager.py); -1: none."""
        return -1

    def first_chunk(self, seq: Sequence) -> int:
        """Fewest tokens a sequence's first step may compute (an encoder-decoder: its whole prompt)."""
        return 1

    @classmethod
    def engine_kwargs(cls, cfg) -> dict:
        """Constructor arguments beyond the pool's, from the engine's config (EngineConfig)."""
        return {}

    # ---- prefix cache ----------------------------------------------------------------------
    def _block_key(self, seq: Sequence, index: int) -> int | bytes:
        """Key of the seq's full block `index`, computed once and remembered on the sequence."""
        while len(seq.block_hashes) <= index:
            i = len(seq.block_hashes)
            bs = self.block_size
            tokens = seq.tokens(i * bs, (i + 1) * bs)
            # The images whose tokens the block holds: same text, another image, another key.
            images = image_keys(seq.params.images, i * bs, (i + 1) * bs)
            if self.sha256:
                parent = seq.block_hashes[i - 1] if i else b""
                extra = "".join(images).encode()
                seq.block_hashes.append(hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens) + extra).digest())
            else:
                parent = seq.block_hashes[i - 1] if i else 0
                seq.block_hashes.append(hash((parent, tuple(tokens), *images)))
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
        hashed = self.num_hashed.get(seq.request_id, 0)
        if seq.num_computed // self.block_size <= hashed:
            return  # no block filled since the last offer: most decode steps
        table = self.table(seq)
        full = min(seq.num_computed // self.block_size, len(table))
        for i in range(hashed, full):
            key = self._block_key(seq, i)
            block = table[i]
            if key not in self.cached and self.block_hash[block] is None:
                self.cached[key] = block
                self.block_hash[block] = key
        if table:
            self.num_hashed[seq.request_id] = max(hashed, full)

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, prefix_hits: list[int] | None = None) -> bool:
        """Grow seq's block table to hold `num_tokens`, first adopting `prefix_hits` (an empty
        table only). All or nothing: returns False and changes nothing when the pool is short."""
        if not prefix_hits:
            table = self.tables.get(seq.request_id)
            if table is not None and len(table) * self.block_size >= num_tokens:
                return True  # its blocks hold them already: most decode steps
        hits = prefix_hits or []
        table = self.tables.setdefault(seq.request_id, [])
        have = len(table) + len(hits)
        need = max(0, self.blocks_needed(num_tokens) - have)
        reclaim = sum(1 for b in hits if self.refcount[b] == 0)  # hits sitting in the free list
        if need > len(self.free) - reclaim:
            if not table:
                del self.tables[seq.request_id]
            return False
        for b in hits:
            if self.refcount[b] == 0:
                del self.free[b]
            self.refcount[b] += 1
        table.extend(hits)
        for _ in range(need):
            b, _ = self.free.popitem(last=False)  # least recently used first
            key = self.block_hash[b]
            if key is not None:  # evict its cached content
                if self.cached.get(key) == b:
                    del self.cached[key]
                self.block_hash[b] = None
            self.refcount[b] = 1
            table.append(b)
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Return the blocks of seq's table past those holding `num_tokens` (speculative decoding:
        blocks allocated for drafts that were rejected). Such tail blocks are never shared or
        cached: only full blocks of computed tokens are."""
        table = self.tables.get(seq.request_id)
        keep = self.blocks_needed(num_tokens)
        while table and len(table) > keep:
            b = table.pop()
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)

    def free_seq(self, seq: Sequence) -> None:
        """Drop seq's references; blocks nobody else uses return to the free list."""
        # Tail blocks are released first so that they are evicted before the shared heads.
        for b in reversed(self.tables.pop(seq.request_id, [])):
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)  # nothing worth keeping: reuse first
        self.num_hashed.pop(seq.request_id, None)
