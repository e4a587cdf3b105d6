"""The block manager's pool, tables and prefix cache, by hand."""

from __future__ import annotations

import pytest
from core_helpers import seq

from tessera.inference.core.block_manager import BlockManager


def computed(blocks: BlockManager, rid: str, prompt: list[int]):
    """A sequence whose prompt is allocated and computed, its full blocks offered to the prefix cache."""
    s = seq(rid, prompt)
    assert blocks.allocate(s, len(prompt))
    s.num_computed = len(prompt)
    blocks.commit_full_blocks(s)
    return s


def test_an_allocation_the_pool_cannot_hold_changes_nothing():
    blocks = BlockManager(3, 4)
    a, b = seq("a", [1] * 8), seq("b", [2] * 8)
    assert blocks.allocate(a, 8) and blocks.table(a) == [0, 1]
    assert not blocks.allocate(b, 8)  # two blocks asked, one free
    assert blocks.table(b) == [] and "b" not in blocks.tables and blocks.num_used == 2
    assert not blocks.allocate(a, 13)  # growing a: two more, one free
    assert blocks.table(a) == [0, 1]


def test_freed_blocks_holding_nothing_cached_are_reused_before_cached_ones():
    blocks = BlockManager(4, 4)
    a = computed(blocks, "a", [1] * 6)  # block 0 full and cached, block 1 half full
    blocks.free_seq(a)
    b = seq("b", [2] * 3)
    blocks.allocate(b, 3)
    assert blocks.table(b) == [1]  # the half-full block first; the cached one stays findable
    assert blocks.lookup_prefix(seq("again", [1] * 5)) == [0]


def test_a_cached_block_is_evicted_when_the_pool_reuses_it():
    blocks = BlockManager(2, 4)
    blocks.free_seq(computed(blocks, "a", [1] * 8))
    blocks.allocate(seq("b", [2] * 5), 5)  # needs both blocks: both cached ones go
    assert blocks.cached == {} and blocks.lookup_prefix(seq("again", [1] * 9)) == []


def test_shared_prefix_blocks_are_counted_once_per_holder_and_freed_when_the_last_goes():
    blocks = BlockManager(4, 4)
    a = computed(blocks, "a", [1] * 8)
    b = seq("b", [1] * 8 + [3])
    hits = blocks.lookup_prefix(b)
    assert hits == [0, 1] and blocks.allocate(b, 9, prefix_hits=hits)
    assert blocks.table(b) == [0, 1, 2] and blocks.refcount[:3] == [2, 2, 1]
    blocks.free_seq(a)
    assert blocks.num_used == 3
    blocks.free_seq(b)
    assert blocks.num_used == 0


def test_trim_gives_back_the_blocks_past_the_tokens_kept():
    blocks = BlockManager(8, 4)
    a = seq("a", [1] * 5)
    blocks.allocate(a, 12)
    blocks.trim(a, 6)
    assert blocks.table(a) == [0, 1] and blocks.num_used == 2


@pytest.mark.parametrize("hash_name", ["builtin", "sha256"])
def test_block_keys_are_equal_for_equal_prefixes_only(hash_name):
    blocks = BlockManager(8, 4, prefix_cache_hash=hash_name)
    a, b, c = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]), seq("b", [1, 2, 3, 4, 5, 6, 7, 8]), seq("c", [9, 2, 3, 4, 5, 6, 7, 8])
    keys = {s.request_id: [blocks._block_key(s, i) for i in range(2)] for s in (a, b, c)}
    assert keys["a"] == keys["b"]
    assert keys["c"][0] != keys["a"][0] and keys["c"][1] != keys["a"][1]  # the second block's parent differs
    assert all(isinstance(k, bytes if hash_name == "sha256" else int) for k in keys["a"])
    with pytest.raises(ValueError, match="builtin or sha256"):
        BlockManager(8, 4, prefix_cache_hash="md5")
