"""BlockPool: allocation order, the LRU free queue, the prefix-hash map and eviction, exact ids."""

from __future__ import annotations

import pytest

from kvcore.cache import Block, BlockPool
from kvcore.cache.block_pool import hash_block


def ids(blocks: list[Block] | None) -> list[int]:
    assert blocks is not None
    return [b.block_id for b in blocks]


def check_links(pool: BlockPool) -> None:
    """The free queue read forwards equals it read backwards, and holds exactly the free blocks."""
    forward = pool.free_queue()
    backward = []
    block = pool._tail.prev_free
    while block is not pool._head:
        assert block is not None
        backward.append(block.block_id)
        block = block.prev_free
    assert forward == backward[::-1]
    assert sorted(forward) == [b.block_id for b in pool.blocks if b.ref_count == 0]
    assert len(forward) == pool.num_free_blocks


def test_allocation_takes_the_head_in_id_order() -> None:
    pool = BlockPool(6, 4)
    assert ids(pool.allocate(2)) == [0, 1]
    assert ids(pool.allocate(3)) == [2, 3, 4]
    assert pool.num_free_blocks == 1
    assert all(b.ref_count == 1 for b in pool.blocks[:5])
    check_links(pool)


def test_allocation_is_all_or_nothing() -> None:
    pool = BlockPool(4, 4)
    pool.allocate(3)
    before = pool.free_queue()
    assert pool.allocate(2) is None
    assert pool.free_queue() == before == [3]
    assert pool.num_free_blocks == 1
    assert ids(pool.allocate(1)) == [3]
    assert pool.allocate(1) is None


def test_freed_blocks_join_the_tail_and_are_reused_in_lru_order() -> None:
    pool = BlockPool(5, 4)
    blocks = pool.allocate(5)
    assert blocks is not None
    for i in (3, 0, 4):
        pool.free(blocks[i])
    assert pool.free_queue() == [3, 0, 4]
    assert ids(pool.allocate(2)) == [3, 0]
    check_links(pool)


def test_touch_takes_a_free_block_out_of_the_middle() -> None:
    pool = BlockPool(5, 4)
    blocks = pool.allocate(5)
    assert blocks is not None
    for i in (1, 3, 4):
        pool.free(blocks[i])
    pool.touch(blocks[3])
    assert pool.free_queue() == [1, 4]
    assert blocks[3].ref_count == 1
    assert pool.num_free_blocks == 2
    pool.touch(blocks[3])  # a block in use just gains a reference
    assert blocks[3].ref_count == 2
    assert pool.free_queue() == [1, 4]
    check_links(pool)


def test_refcounted_block_returns_only_at_zero() -> None:
    pool = BlockPool(3, 4)
    (block,) = pool.allocate(1) or []
    pool.touch(block)
    pool.free(block)
    assert pool.free_queue() == [1, 2]
    pool.free(block)
    assert pool.free_queue() == [1, 2, 0]
    with pytest.raises(AssertionError, match="double free"):
        pool.free(block)


def _find(pool: BlockPool, token_ids: list[int]) -> Block | None:
    """The cached block holding these tokens as a sequence's first block (no salt)."""
    blocks, _ = pool.match_prefix(token_ids, 1, b"")
    return blocks[0] if blocks else None


def test_cached_block_stays_findable_after_free_until_evicted() -> None:
    pool = BlockPool(3, 2)
    a, b, c = pool.allocate(3) or []
    pool.cache_full_blocks([b], [], [7, 8], 1, b"")
    h = hash_block(None, pool.pack_tokens([7, 8]))
    assert _find(pool, [7, 8]) is b and b.block_hash == h
    pool.free(b)
    pool.free(a)
    assert _find(pool, [7, 8]) is b  # free, but still findable
    assert pool.free_queue() == [1, 0]
    (reused,) = pool.allocate(1) or []
    assert reused is b  # the least recently freed block is evicted first
    assert _find(pool, [7, 8]) is None
    assert b.block_hash is None and b.token_bytes is None
    assert h not in pool.cached


def test_a_hit_is_confirmed_by_token_ids() -> None:
    pool = BlockPool(2, 2)
    (block,) = pool.allocate(1) or []
    pool.cache_full_blocks([block], [], [1, 2], 1, b"")
    # the same hash with other token ids (a collision) is a miss
    block.token_bytes = pool.pack_tokens([2, 1])
    assert _find(pool, [1, 2]) is None
    block.token_bytes = pool.pack_tokens([1, 2])
    assert _find(pool, [1, 2]) is block


def test_duplicate_content_keeps_the_first_block_canonical() -> None:
    pool = BlockPool(2, 2)
    a, b = pool.allocate(2) or []
    hashes_a: list[bytes] = []
    hashes_b: list[bytes] = []
    pool.cache_full_blocks([a], hashes_a, [5, 5], 1, b"")
    pool.cache_full_blocks([b], hashes_b, [5, 5], 1, b"")
    assert hashes_a == hashes_b and pool.cached == {hashes_a[0]: a}
    assert b.block_hash is None


def test_chain_hash_depends_on_parent_tokens_and_extra_keys() -> None:
    pool = BlockPool(1, 3)
    t = pool.pack_tokens([1, 2, 3])
    h0 = hash_block(None, t)
    assert h0 == hash_block(None, pool.pack_tokens([1, 2, 3]))
    assert len(h0) == 32
    assert hash_block(h0, t) != h0
    assert hash_block(None, t, b"\x01salt") != h0
    assert hash_block(None, t, b"\x01a") != hash_block(None, t, b"\x01b")
    assert hash_block(None, pool.pack_tokens([1, 2, 4])) != h0


def test_reset_prefix_cache_forgets_every_hash() -> None:
    pool = BlockPool(2, 2)
    (block,) = pool.allocate(1) or []
    pool.cache_full_blocks([block], [], [3, 4], 1, b"")
    assert _find(pool, [3, 4]) is block
    pool.reset_prefix_cache()
    assert _find(pool, [3, 4]) is None and not pool.cached
    assert block.block_hash is None
    assert block.ref_count == 1


@pytest.mark.parametrize(("num_blocks", "block_size", "name"),
                         [(0, 16, "num_blocks"), (-3, 16, "num_blocks"), (4, 0, "block_size"),
                          (2.5, 16, "num_blocks")])
def test_bad_sizes_are_rejected(num_blocks: int, block_size: int, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        BlockPool(num_blocks, block_size)
