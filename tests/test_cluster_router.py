"""The cluster router as plain logic: the pool's cache events, the chain index, the decisions."""

from __future__ import annotations

import random

import pytest

from kvcore.cache import KVCacheManager, chain_hashes
from kvcore.cluster.index import ChainIndex
from kvcore.cluster.policy import (
    FALLBACK_LOAD,
    FALLBACK_MISS,
    LEAST_LOADED,
    PREFIX,
    ROUND_ROBIN,
    ReplicaLoad,
    RoutingPolicy,
)

BS = 4


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def _events_of(kv: KVCacheManager) -> list[tuple[bool, bytes]]:
    return kv.pool.drain_events()


def test_chain_hashes_equal_the_pools_own_names() -> None:
    rng = random.Random(1)
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    kv.pool.enable_events()
    for salt in (None, "tenant-a"):
        prompt = _prompt(rng, 3 * BS + 2)
        seq_id = f"s-{salt}"
        kv.allocate_prefix(seq_id, prompt, salt=salt)
        assert kv.allocate_slots(seq_id, prompt, len(prompt)) == []
        stored = [h for is_stored, h in _events_of(kv) if is_stored]
        assert stored == chain_hashes(prompt, BS, salt)  # same function, same salt key
        assert len(stored) == 3
        assert chain_hashes(prompt, BS, salt, max_blocks=2) == stored[:2]


def test_salts_give_disjoint_chains() -> None:
    prompt = _prompt(random.Random(2), 4 * BS)
    chains = [chain_hashes(prompt, BS, s) for s in (None, "a", "b")]
    assert len({h for chain in chains for h in chain}) == 12


def test_events_report_evictions_and_uncaching_in_order() -> None:
    rng = random.Random(3)
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    kv.pool.enable_events()
    first = _prompt(rng, 2 * BS)
    kv.allocate_prefix("a", first)
    kv.allocate_slots("a", first, len(first))
    cached = chain_hashes(first, BS, None)
    assert _events_of(kv) == [(True, h) for h in cached]
    kv.free("a")  # freed blocks stay cached: no event
    assert _events_of(kv) == []
    second = _prompt(rng, 4 * BS)  # needs all 4 blocks: both cached ones are evicted
    kv.allocate_prefix("b", second)
    kv.allocate_slots("b", second, len(second))
    events = _events_of(kv)
    removed = [h for is_stored, h in events if not is_stored]
    assert sorted(removed) == sorted(cached)
    # tail block first: free() queued it last... the pool evicts in free-queue order
    assert [h for is_stored, h in events if is_stored] == chain_hashes(second, BS, None)
    kv.free("b", uncache=True)
    assert sorted(h for s, h in _events_of(kv) if not s) == sorted(chain_hashes(second, BS, None))
    assert kv.pool.cached == {}


def test_events_cost_nothing_until_enabled_and_start_from_the_current_cache() -> None:
    rng = random.Random(4)
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = _prompt(rng, 2 * BS + 1)
    kv.allocate_prefix("a", prompt)
    kv.allocate_slots("a", prompt, len(prompt))
    assert kv.pool.drain_events() == []
    kv.pool.enable_events()
    assert kv.pool.drain_events() == [(True, h) for h in chain_hashes(prompt, BS, None)]
    kv.pool.reset_prefix_cache()
    assert sorted(kv.pool.drain_events()) == sorted(
        (False, h) for h in chain_hashes(prompt, BS, None))


def test_index_matches_longest_leading_chain_per_replica() -> None:
    chain = chain_hashes(list(range(6 * BS)), BS, None)
    index = ChainIndex()
    index.apply("r1", [(True, h) for h in chain[:2]])
    index.apply("r2", [(True, h) for h in chain[:5]])
    index.apply("r3", [(True, h) for h in chain[1:6]])  # no first block: useless
    assert index.match(chain) == {"r1": 2, "r2": 5}
    index.apply("r2", [(False, chain[3])])  # a gap ends r2's usable chain
    assert index.match(chain) == {"r1": 2, "r2": 3}
    assert index.match(chain_hashes(list(range(6 * BS)), BS, "other")) == {}


def test_index_forgets_a_dropped_replica() -> None:
    chain = chain_hashes(list(range(3 * BS)), BS, None)
    index = ChainIndex()
    index.apply("r1", [(True, h) for h in chain])
    index.apply("r2", [(True, h) for h in chain[:1]])
    assert index.drop_replica("r1") == 3
    assert index.match(chain) == {"r2": 1}
    assert len(index) == 1 and index.replicas() == {"r2"}


def test_index_lru_bound_drops_least_recently_used() -> None:
    index = ChainIndex(max_entries=3)
    hashes = [bytes([i]) * 32 for i in range(5)]
    index.apply("r", [(True, h) for h in hashes[:3]])
    assert index.match(hashes[:1]) == {"r": 1}  # hashes[0] becomes most recent
    index.apply("r", [(True, hashes[3]), (True, hashes[4])])
    assert len(index) == 3 and index.num_evicted == 2
    assert index.match([hashes[0]]) == {"r": 1}
    assert index.match([hashes[1]]) == {} and index.match([hashes[2]]) == {}
    with pytest.raises(ValueError, match="max_entries"):
        ChainIndex(max_entries=0)


def _loads(*spec: tuple[str, int, float]) -> list[ReplicaLoad]:
    return [ReplicaLoad(r, n, kv) for r, n, kv in spec]


def test_prefix_policy_prefers_the_longest_chain() -> None:
    policy = RoutingPolicy("prefix", load_margin=4, kv_margin=0.25, rng=random.Random(0))
    loads = _loads(("a", 3, 0.3), ("b", 0, 0.1), ("c", 1, 0.2))
    decision = policy.choose(loads, {"a": 7, "c": 2})
    assert (decision.replica_id, decision.reason, decision.predicted_cached_blocks) == (
        "a", PREFIX, 7)
    # equal chains: the less loaded one
    assert policy.choose(loads, {"a": 2, "c": 2}).replica_id == "c"


def test_prefix_policy_falls_back_when_the_holder_is_overloaded() -> None:
    policy = RoutingPolicy("prefix", load_margin=2, kv_margin=0.25, rng=random.Random(0))
    busy = _loads(("a", 5, 0.3), ("b", 2, 0.2))  # 3 more outstanding than b: over the margin
    decision = policy.choose(busy, {"a": 9})
    assert (decision.replica_id, decision.reason) == ("b", FALLBACK_LOAD)
    assert decision.predicted_cached_blocks == 0
    full = _loads(("a", 1, 0.9), ("b", 1, 0.5))  # KV usage 0.4 above b's
    assert policy.choose(full, {"a": 9}).reason == FALLBACK_LOAD
    within = _loads(("a", 4, 0.4), ("b", 2, 0.2))
    assert policy.choose(within, {"a": 9}).reason == PREFIX


def test_prefix_policy_without_a_match_uses_power_of_two() -> None:
    policy = RoutingPolicy("prefix", rng=random.Random(0))
    loads = _loads(("a", 9, 0.1), ("b", 0, 0.1))
    decision = policy.choose(loads, {"gone": 5})  # a replica not routable any more is ignored
    assert (decision.replica_id, decision.reason) == ("b", FALLBACK_MISS)


def test_tenant_chains_never_attract_another_tenants_request() -> None:
    prompt = list(range(8 * BS))
    index = ChainIndex()
    index.apply("a-home", [(True, h) for h in chain_hashes(prompt, BS, "salt-a")])
    policy = RoutingPolicy("prefix", rng=random.Random(0))
    loads = _loads(("a-home", 0, 0.0), ("other", 0, 0.0))
    same = policy.choose(loads, index.match(chain_hashes(prompt, BS, "salt-a")))
    assert (same.replica_id, same.reason, same.predicted_cached_blocks) == ("a-home", PREFIX, 8)
    for salt in ("salt-b", None):
        other = policy.choose(loads, index.match(chain_hashes(prompt, BS, salt)))
        assert other.reason == FALLBACK_MISS and other.predicted_cached_blocks == 0


def test_round_robin_and_least_loaded() -> None:
    loads = _loads(("b", 5, 0.0), ("a", 0, 0.0), ("c", 1, 0.0))
    rr = RoutingPolicy("round-robin")
    picks = [rr.choose(loads, {}) for _ in range(4)]
    assert [d.replica_id for d in picks] == ["a", "b", "c", "a"]
    assert {d.reason for d in picks} == {ROUND_ROBIN}
    ll = RoutingPolicy("least-loaded", rng=random.Random(0))
    decision = ll.choose(loads, {"b": 3})
    assert (decision.replica_id, decision.reason) == ("a", LEAST_LOADED)


def test_policy_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="router"):
        RoutingPolicy("random")
    with pytest.raises(ValueError, match="load_margin"):
        RoutingPolicy(load_margin=-1)
    with pytest.raises(ValueError, match="kv_margin"):
        RoutingPolicy(kv_margin=1.5)
    with pytest.raises(ValueError, match="loads"):
        RoutingPolicy().choose([], {})


def test_index_counts_blocks_per_replica_and_ties_go_to_the_emptier_cache() -> None:
    chain = chain_hashes(list(range(4 * BS)), BS, None)
    index = ChainIndex(max_entries=3)
    index.apply("a", [(True, h) for h in chain[:2]] + [(True, chain[0])])  # a repeat counts once
    index.apply("b", [(True, chain[0])])
    assert (index.num_blocks("a"), index.num_blocks("b")) == (2, 1)
    index.apply("a", [(False, chain[1]), (False, chain[3])])  # an unknown removal is ignored
    assert index.num_blocks("a") == 1
    index.apply("b", [(True, h) for h in chain[1:]])  # 4 entries: the LRU one (chain[0]) goes
    assert (index.num_blocks("a"), index.num_blocks("b")) == (0, 3)
    policy = RoutingPolicy("prefix", rng=random.Random(0))
    loads = [ReplicaLoad("a", 0, 0.0, 9), ReplicaLoad("b", 0, 0.0, 2)]
    assert policy.choose(loads, {}).replica_id == "b"


def test_state_applies_event_batches_in_order_and_resets_after_a_lost_one() -> None:
    from kvcore.cluster.state import MAX_PENDING, ReplicaReport, RouterState
    from kvcore.engine import EngineStats

    stats = EngineStats(0, 0, 0.0, 8, 8, 0, 0, 0, BS, "fp32")
    chain = chain_hashes(list(range(40 * BS)), BS, None)
    state = RouterState(RoutingPolicy("prefix"))

    def report(seq: int, *events: tuple[bool, bytes]) -> None:
        state.apply(ReplicaReport("r", seq, tuple(events), stats))

    report(2, (False, chain[0]))  # overtook batch 1: held back
    assert state.index.match(chain[:1]) == {}
    report(1, (True, chain[0]), (True, chain[1]))
    # batch 1 then batch 2: chain[0] is gone again, so nothing leads the chain
    assert state.index.match(chain[:2]) == {} and state.index.num_blocks("r") == 1
    report(3, (True, chain[0]))
    assert state.index.match(chain[:2]) == {"r": 2}
    for seq in range(5, 6 + MAX_PENDING):  # batch 4 never arrives
        report(seq, (True, chain[seq]))
    assert state.num_lost_batches == 1
    assert state.index.match(chain[:2]) == {}  # the replica's old entries were reset
    assert state.index.num_blocks("r") == MAX_PENDING + 1
    report(4, (False, chain[5]))  # too late: ignored
    assert state.index.match(chain[5:6]) == {"r": 1}
