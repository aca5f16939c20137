"""Routing decisions as plain logic: prefix affinity with a load guard, least loaded, in turn."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("prefix", "least-loaded", "round-robin")
# why a replica was chosen (a label of the ingress's decision counter)
PREFIX, FALLBACK_LOAD, FALLBACK_MISS = "prefix", "fallback-load", "fallback-miss"
LEAST_LOADED, ROUND_ROBIN = "least-loaded", "round-robin"
DEFAULT_LOAD_MARGIN = 4  # outstanding requests
DEFAULT_KV_MARGIN = 0.25  # fraction of the KV pool


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    replica_id: str
    # requests routed to the replica and not finished: the ingress's own count, exact and
    # current (a replica's reported queue lags by a stream item), so it is the waiting signal
    num_outstanding: int
    kv_cache_usage: float  # fraction of KV blocks referenced, as last reported (0-1)
    # cached blocks the index knows of: the tie-break between equally loaded replicas, so new
    # prefixes spread over the replicas' caches instead of piling onto one
    num_cached_blocks: int = 0


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica_id: str
    reason: str  # PREFIX, FALLBACK_LOAD, FALLBACK_MISS, LEAST_LOADED or ROUND_ROBIN
    predicted_cached_blocks: int  # leading prompt blocks the index says the replica holds


class RoutingPolicy:
    """Chooses one replica per request.

    "prefix": the replica holding the longest cached chain of the request's blocks (ties: the
    less loaded), unless its load exceeds the least-loaded replica's by more than `load_margin`
    outstanding requests or `kv_margin` of KV usage; then, and when no replica holds the first
    block, power-of-two choices by load. "least-loaded": the lowest load. "round-robin": in turn.
    """

    def __init__(self, policy: str = "prefix", load_margin: int = DEFAULT_LOAD_MARGIN,
                 kv_margin: float = DEFAULT_KV_MARGIN, rng: random.Random | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not isinstance(load_margin, int) or load_margin < 0:
            raise ValueError(f"load_margin must be an integer >= 0, got {load_margin!r}")
        if not 0.0 <= kv_margin <= 1.0:
            raise ValueError(f"kv_margin must be in [0, 1], got {kv_margin!r}")
        self.policy = policy
        self.load_margin = load_margin
        self.kv_margin = kv_margin
        self._rng = rng or random.Random()
        self._next = 0  # round-robin position

    def choose(self, loads: Sequence[ReplicaLoad], matches: dict[str, int]) -> RouteDecision:
        """`loads`: the routable replicas; `matches`: replica -> leading blocks it holds
        (ChainIndex.match); replicas not in `loads` are ignored."""
        if not loads:
            raise ValueError("loads must name at least one replica")
        if self.policy == "round-robin":
            ordered = sorted(loads, key=lambda r: r.replica_id)
            chosen = ordered[self._next % len(ordered)]
            self._next += 1
            return RouteDecision(chosen.replica_id, ROUND_ROBIN, matches.get(chosen.replica_id, 0))
        least = min(loads, key=_load_key)
        if self.policy == "least-loaded":
            ties = [r for r in loads if _load_key(r) == _load_key(least)]
            chosen = self._rng.choice(ties)
            return RouteDecision(chosen.replica_id, LEAST_LOADED, matches.get(chosen.replica_id, 0))
        held = [r for r in loads if matches.get(r.replica_id, 0) > 0]
        if held:
            best = min(held, key=lambda r: (-matches[r.replica_id], _load_key(r)))
            if (best.num_outstanding - least.num_outstanding <= self.load_margin
                    and best.kv_cache_usage - least.kv_cache_usage <= self.kv_margin):
                return RouteDecision(best.replica_id, PREFIX, matches[best.replica_id])
            reason = FALLBACK_LOAD
        else:
            reason = FALLBACK_MISS
        chosen = self._power_of_two(loads)
        return RouteDecision(chosen.replica_id, reason, matches.get(chosen.replica_id, 0))

    def _power_of_two(self, loads: Sequence[ReplicaLoad]) -> ReplicaLoad:
        if len(loads) == 1:
            return loads[0]
        a, b = self._rng.sample(list(loads), 2)
        return a if _load_key(a) <= _load_key(b) else b


def _load_key(load: ReplicaLoad) -> tuple[int, float, int]:
    return load.num_outstanding, load.kv_cache_usage, load.num_cached_blocks
