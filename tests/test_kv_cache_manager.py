"""KVCacheManager: exact block ids for allocation, prefix hits, eviction, copy-on-write, windows."""

from __future__ import annotations

import pytest

from kvcore.cache import Admission, KVCacheManager

BS = 4


def snapshot(m: KVCacheManager) -> tuple:
    """Everything an allocation could change."""
    return (
        {s: (m.block_table(s), m.num_tokens(s)) for s in m.seq_ids()},
        [(b.ref_count, b.block_hash) for b in m.pool.blocks],
        m.pool.free_queue(),
        dict(m.pool.cached),
        m.num_free_blocks,
    )


def start(m: KVCacheManager, seq_id: str, tokens: list[int], salt: str | None = None) -> int:
    cached = m.allocate_prefix(seq_id, tokens, salt)
    assert m.allocate_slots(seq_id, tokens, len(tokens) - cached) == []
    return cached


def test_blocks_in_order_and_a_new_block_only_when_the_last_is_full() -> None:
    m = KVCacheManager(8, BS)
    tokens = list(range(100, 110))
    assert start(m, "a", tokens) == 0
    assert m.block_table("a") == [0, 1, 2]
    assert m.num_tokens("a") == 10
    assert [m.slot("a", p) for p in (0, 3, 4, 9)] == [0, 3, 4, 9]
    for _ in range(2):
        tokens.append(7)
        assert m.allocate_slots("a", tokens, 1) == []
    assert m.block_table("a") == [0, 1, 2]
    tokens.append(7)
    assert m.allocate_slots("a", tokens, 1) == []
    assert m.block_table("a") == [0, 1, 2, 3]
    assert m.slot("a", 12) == 12
    assert start(m, "b", [1, 2, 3]) == 0
    assert m.block_table("b") == [4]
    assert m.slot("b", 2) == 4 * BS + 2
    assert m.num_free_blocks == 3
    assert m.usage() == pytest.approx(5 / 8)


def test_prefix_hit_attaches_cached_full_blocks_and_counts_tokens() -> None:
    m = KVCacheManager(10, BS)
    a = list(range(10))
    start(m, "a", a)  # blocks 0, 1 full and cached; 2 partial
    b = a[:8] + [50, 51, 52]
    assert start(m, "b", b) == 8
    assert m.block_table("b") == [0, 1, 3]
    assert [m.pool.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert (m.num_prefix_queries, m.num_prefix_hits) == (21, 8)


def test_prefix_hit_always_leaves_the_last_prompt_token_to_recompute() -> None:
    m = KVCacheManager(10, BS)
    a = list(range(12))
    start(m, "a", a)  # three full cached blocks
    # an identical 12-token prompt may reuse at most (12 - 1) // 4 = 2 blocks
    assert start(m, "b", a) == 8
    assert m.block_table("b") == [0, 1, 3]
    # an 8-token prompt equal to the first two blocks: 1 block, so token 7 gets its logits
    assert start(m, "c", a[:8]) == 4
    assert m.block_table("c") == [0, 4]
    assert start(m, "d", a[:9]) == 8
    assert start(m, "e", a[:1]) == 0


def test_freed_cached_blocks_are_hit_and_leave_the_free_queue() -> None:
    m = KVCacheManager(6, BS)
    a = list(range(9))
    start(m, "a", a)
    m.free("a")
    assert m.pool.free_queue() == [3, 4, 5, 2, 1, 0]
    assert m.num_free_blocks == 6
    assert start(m, "b", a) == 8
    assert m.block_table("b") == [0, 1, 3]
    assert m.pool.free_queue() == [4, 5, 2]
    assert m.usage() == pytest.approx(0.5)


def test_free_evicts_the_tail_block_first_then_lru() -> None:
    m = KVCacheManager(6, BS)
    a = list(range(12))
    start(m, "a", a)  # blocks 0, 1, 2, all full and cached
    m.free("a")
    assert m.pool.free_queue() == [3, 4, 5, 2, 1, 0]
    start(m, "x", list(range(500, 516)))  # 4 blocks: the 3 never used, then a's tail block 2
    assert m.block_table("x") == [3, 4, 5, 2]
    # up to 3 blocks of a 13-token prompt may hit: 0 and 1 survived, block 2 was evicted
    assert m.allocate_prefix("a2", a + [99]) == 8
    assert m.block_table("a2") == [0, 1]
    assert m.num_free_blocks == 0


def test_least_recently_freed_sequence_is_evicted_first() -> None:
    m = KVCacheManager(4, BS)
    a, b = [1] * 8, [2] * 8
    start(m, "a", a)  # blocks 0, 1
    start(m, "b", b)  # blocks 2, 3
    m.free("a")
    m.free("b")
    assert m.pool.free_queue() == [1, 0, 3, 2]
    start(m, "c", [3] * 4)  # evicts a's tail block 1
    assert m.block_table("c") == [1]
    assert m.allocate_prefix("a2", a) == 4  # a's head block 0 is still cached
    assert m.allocate_prefix("b2", b) == 4
    assert (m.block_table("a2"), m.block_table("b2")) == ([0], [2])
    assert m.pool.free_queue() == [3]  # the hits left the queue from its middle


def test_salt_isolates_tenants() -> None:
    m = KVCacheManager(16, BS)
    p = list(range(9))
    start(m, "t1", p, salt="tenant-1")
    assert start(m, "t2", p, salt="tenant-2") == 0
    assert start(m, "anon", p) == 0
    assert start(m, "t1b", p, salt="tenant-1") == 8
    assert start(m, "anon2", p) == 8
    owners = {tuple(m.block_table(s)[:2]) for s in ("t1", "t2", "anon")}
    assert len(owners) == 3  # no block shared across salts
    assert m.block_table("t1b")[:2] == m.block_table("t1")[:2]


def test_hit_requires_equal_token_ids() -> None:
    m = KVCacheManager(8, BS)
    p = list(range(9))
    start(m, "a", p)
    m.pool.blocks[0].token_bytes = m.pool.pack_tokens([0, 1, 2, 4])  # what a collision looks like
    assert start(m, "b", p) == 0


def test_reset_prefix_cache() -> None:
    m = KVCacheManager(8, BS)
    p = list(range(9))
    start(m, "a", p)
    m.reset_prefix_cache()
    assert start(m, "b", p) == 0
    assert m.block_table("a") == [0, 1, 2]


def test_fork_shares_and_copy_on_write_copies_the_partial_last_block() -> None:
    m = KVCacheManager(8, BS)
    t = list(range(6))
    start(m, "a", t)  # blocks 0 (full), 1 (2 of 4)
    m.fork("a", "b")
    assert m.block_table("b") == [0, 1]
    assert [m.pool.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    tb = t + [40]
    assert m.allocate_slots("b", tb, 1) == [(1, 2)]
    assert m.block_table("b") == [0, 2]
    assert m.block_table("a") == [0, 1]
    assert [m.pool.blocks[i].ref_count for i in (0, 1, 2)] == [2, 1, 1]
    ta = t + [41]
    assert m.allocate_slots("a", ta, 1) == []  # block 1 is a's alone now: written in place
    assert m.block_table("a") == [0, 1]
    m.free("a")
    m.free("b")
    assert m.usage() == 0.0


def test_copy_on_write_and_new_blocks_together_are_all_or_nothing() -> None:
    m = KVCacheManager(4, BS)
    t = list(range(6))
    start(m, "a", t)  # blocks 0, 1
    m.fork("a", "b")
    start(m, "c", [9])  # block 2; one block left
    before = snapshot(m)
    tb = t + [1, 2, 3]  # fills the copy and spills into a new block: 2 blocks, 1 free
    assert m.allocate_slots("b", tb, 3) is None
    assert snapshot(m) == before
    m.free("c")
    assert m.allocate_slots("b", tb, 3) == [(1, 3)]
    assert m.block_table("b") == [0, 3, 2]


def test_fork_of_a_full_last_block_needs_no_copy() -> None:
    m = KVCacheManager(8, BS)
    t = list(range(8))
    start(m, "a", t)
    m.fork("a", "b")
    assert m.allocate_slots("b", t + [1], 1) == []
    assert m.block_table("b") == [0, 1, 2]
    assert m.block_table("a") == [0, 1]


def test_failed_allocation_has_no_side_effect() -> None:
    m = KVCacheManager(3, BS)
    t = list(range(7))
    start(m, "a", t)
    start(m, "b", [5])
    before = snapshot(m)
    long = t + list(range(10))
    assert m.allocate_slots("a", long, 10) is None
    assert snapshot(m) == before
    assert m.allocate_slots("a", long, 1) == []  # room left in block 1
    assert m.block_table("a") == [0, 1]


def test_admission_tells_not_now_from_never() -> None:
    m = KVCacheManager(4, BS)
    assert m.admission(16) is Admission.OK
    assert m.admission(17) is Admission.NEVER
    start(m, "a", list(range(9)))  # 3 blocks
    assert m.admission(4) is Admission.OK
    assert m.admission(5) is Admission.NOT_NOW
    assert m.admission(16) is Admission.NOT_NOW
    assert m.admission(100) is Admission.NEVER
    m.free("a")
    assert m.admission(16) is Admission.OK


def test_sliding_window_releases_blocks_never_attended_again() -> None:
    m = KVCacheManager(8, BS, sliding_window=8)
    t = list(range(20))
    start(m, "a", t)
    assert m.block_table("a") == [0, 1, 2, 3, 4]
    m.release_outside_window("a", 11)  # limit 3: block 0 (positions 0-3) is out
    assert m.block_table("a") == [None, 1, 2, 3, 4]
    assert m.num_free_blocks == 4
    m.release_outside_window("a", 12)  # limit 4: block 1 still holds position 7 > 4
    assert m.block_table("a") == [None, 1, 2, 3, 4]
    m.release_outside_window("a", 20)  # limit 12: blocks 1 (4-7) and 2 (8-11) are out
    assert m.block_table("a") == [None, None, None, 3, 4]
    m.release_outside_window("a", 20)
    assert m.num_free_blocks == 6
    assert m.slot("a", 12) == 12
    with pytest.raises(ValueError, match="released"):
        m.slot("a", 11)
    m.fork("a", "b")
    m.free("a")
    m.free("b")
    assert m.usage() == 0.0


def test_sliding_window_disables_prefix_caching() -> None:
    m = KVCacheManager(8, BS, sliding_window=16)
    assert not m.enable_prefix_caching
    t = list(range(9))
    start(m, "a", t)
    assert start(m, "b", t) == 0
    assert (m.num_prefix_queries, m.num_prefix_hits) == (0, 0)
    assert m.pool.cached == {}


def test_without_window_release_is_a_no_op() -> None:
    m = KVCacheManager(8, BS)
    start(m, "a", list(range(20)))
    m.release_outside_window("a", 20)
    assert m.block_table("a") == [0, 1, 2, 3, 4]


def test_prefix_caching_off() -> None:
    m = KVCacheManager(8, BS, enable_prefix_caching=False)
    t = list(range(9))
    start(m, "a", t)
    assert start(m, "b", t) == 0
    assert m.block_table("b") == [3, 4, 5]


def test_bad_calls_raise_clear_errors() -> None:
    m = KVCacheManager(8, BS)
    t = list(range(5))
    start(m, "a", t)
    with pytest.raises(KeyError):
        m.free("nope")
    with pytest.raises(KeyError):
        m.allocate_slots("nope", t, 1)
    with pytest.raises(ValueError, match="already allocated"):
        m.allocate_prefix("a", t)
    with pytest.raises(ValueError, match="token_ids"):
        m.allocate_prefix("e", [])
    with pytest.raises(ValueError, match="token_ids"):
        m.allocate_slots("a", t, 1)  # 5 allocated + 1 new need 6 token ids
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots("a", t, -1)
    assert m.allocate_slots("a", t, 0) == []
    with pytest.raises(ValueError, match="child_id"):
        m.fork("a", "a")
    with pytest.raises(ValueError, match="position"):
        m.slot("a", 5)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        m.release_outside_window("a", 6)
    with pytest.raises(ValueError, match="num_tokens"):
        m.admission(-1)
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(8, BS, sliding_window=0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, BS)
