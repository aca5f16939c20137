"""The ingress's routing state, shared by the Ray Serve request router and the engine proxy."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import structlog

from kvcore.cache import BlockHash, CacheEvent
from kvcore.cluster.index import DEFAULT_MAX_ENTRIES, ChainIndex
from kvcore.cluster.policy import ReplicaLoad, RouteDecision, RoutingPolicy
from kvcore.engine import EngineStats

log = structlog.get_logger("kvcore.cluster")


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """Rides on every item a replica streams back: its cache changes since its last report and
    its current stats. `seq` numbers the batches with events, per replica, so the ingress can
    notice one lost with a cancelled stream."""

    replica_id: str
    seq: int  # of the last batch with events (0: none yet)
    events: tuple[CacheEvent, ...]
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class Route:
    """What the request router needs of a call (a keyword argument of the replica's generate)."""

    request_id: str
    block_hashes: tuple[BlockHash, ...]  # the prompt's full blocks that a replica could serve
    block_size: int
    num_seqs: int = 1  # n choices or beams: what it adds to the replica's queue


MAX_PENDING = 16  # event batches held back waiting for an earlier one, per replica


@dataclass(slots=True)
class _Replica:
    num_outstanding: int = 0
    num_seqs: int = 0  # sequences of the requests routed here whose streams have not ended
    stats: EngineStats | None = None
    seq: int = 0  # last event batch applied
    # batches that overtook an earlier one (streams of one replica arrive in any order): seq ->
    # events, applied once the gap fills
    pending: dict[int, tuple[CacheEvent, ...]] = field(default_factory=dict)
    routed: int = 0  # requests routed to it
    cached_tokens: int = 0  # reported by the replica, over the requests routed to it
    predicted_tokens: int = 0  # the index's prediction for those same requests


@dataclass(slots=True)
class RouterState:
    """Index + loads + decisions. Ray Serve runs the request router on its own thread, the ingress
    applies reports on its event loop: every method takes the lock."""

    policy: RoutingPolicy
    index: ChainIndex = field(default_factory=lambda: ChainIndex(DEFAULT_MAX_ENTRIES))
    replicas: dict[str, _Replica] = field(default_factory=dict)
    decisions: Counter[str] = field(default_factory=Counter)  # reason -> count
    num_lost_batches: int = 0  # event batches that never arrived (the replica's entries reset)
    # request id -> (replica, predicted cached tokens, sequences)
    _routes: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def route(self, route: Route, replica_ids: Sequence[str]) -> RouteDecision:
        """Choose a replica among the live ones for a request, and count it as outstanding there.
        The chain is recorded for the chosen replica at once (it will cache those blocks as it
        prefills), so the rest of a burst sharing the prefix follows it before its events return."""
        matches = self.index.match(route.block_hashes)
        cached = {r: self.index.num_blocks(r) for r in replica_ids}
        with self._lock:
            loads = [ReplicaLoad(r, self._replica(r).num_outstanding,
                                 _kv_usage(self._replica(r).stats), cached[r])
                     for r in replica_ids]
            decision = self.policy.choose(loads, matches)
            previous = self._routes.get(route.request_id)
            if previous is not None:  # a retry after a rejection: move the request's counts
                moved = self._replica(previous[0])
                moved.num_outstanding -= 1
                moved.num_seqs -= previous[2]
                moved.routed -= 1
            else:
                self.decisions[decision.reason] += 1
            chosen = self._replica(decision.replica_id)
            chosen.num_outstanding += 1
            chosen.num_seqs += route.num_seqs
            chosen.routed += 1
            self._routes[route.request_id] = (decision.replica_id,
                                              decision.predicted_cached_blocks * route.block_size,
                                              route.num_seqs)
        self.index.apply(decision.replica_id, ((True, h) for h in route.block_hashes))
        return decision

    def finish(self, request_id: str, num_cached_tokens: int | None) -> None:
        """The request's stream ended; `num_cached_tokens` as the replica reported (None: it
        never reported, e.g. it died first)."""
        with self._lock:
            routed = self._routes.pop(request_id, None)
            if routed is None:
                return
            replica = self._replica(routed[0])
            replica.num_outstanding -= 1
            replica.num_seqs -= routed[2]
            if num_cached_tokens is not None:
                replica.cached_tokens += num_cached_tokens
                replica.predicted_tokens += routed[1]

    def apply(self, report: ReplicaReport) -> None:
        """Apply a replica's report. Its event batches are applied in their order: one that
        overtook an earlier batch waits for it; when MAX_PENDING wait, the earlier one is taken
        as lost (its stream was cancelled) and the replica's entries are reset (better to forget
        than to believe a block is still there)."""
        ready: list[tuple[CacheEvent, ...]] = []
        with self._lock:
            replica = self._replica(report.replica_id)
            replica.stats = report.stats
            if not report.events or report.seq <= replica.seq:
                return  # nothing new, or a duplicate
            replica.pending[report.seq] = report.events
            lost = len(replica.pending) > MAX_PENDING
            if lost:
                self.num_lost_batches += 1
                replica.seq = min(replica.pending) - 1
            while replica.seq + 1 in replica.pending:
                replica.seq += 1
                ready.append(replica.pending.pop(replica.seq))
        if lost:
            self.index.drop_replica(report.replica_id)
        for events in ready:
            self.index.apply(report.replica_id, events)

    def num_waiting(self) -> int:
        """Sequences waiting on all replicas: on each, the sequences routed there and not yet
        finished that its last report does not show running, or the waiting it reports,
        whichever is larger (a report lags a burst; the ingress's own count does not)."""
        with self._lock:
            return sum(max(r.stats.num_waiting if r.stats else 0,
                           r.num_seqs - (r.stats.num_running if r.stats else 0))
                       for r in self.replicas.values())

    def sync_replicas(self, live: Iterable[str]) -> list[str]:
        """Know the replicas Ray routes to, and forget those it no longer does (dead, or
        replaced by a restart with a fresh cache and a new id); returns the forgotten ids."""
        live = set(live)
        with self._lock:
            gone = [r for r in self.replicas if r not in live]
            for replica_id in gone:
                del self.replicas[replica_id]
            for replica_id in live:
                self._replica(replica_id)
        for replica_id in gone:
            num = self.index.drop_replica(replica_id)
            log.info("replica gone: its index entries dropped", replica=replica_id, entries=num)
        return gone

    def snapshot(self) -> dict[str, _Replica]:
        with self._lock:
            return {r: _Replica(v.num_outstanding, v.num_seqs, v.stats, v.seq, dict(v.pending),
                                v.routed, v.cached_tokens, v.predicted_tokens)
                    for r, v in self.replicas.items()}

    def _replica(self, replica_id: str) -> _Replica:
        replica = self.replicas.get(replica_id)
        if replica is None:
            replica = self.replicas[replica_id] = _Replica()
        return replica


def _kv_usage(stats: EngineStats | None) -> float:
    return stats.kv_cache_usage if stats is not None else 0.0


_STATES: dict[str, RouterState] = {}  # router key -> state, for routers Ray builds in-process
_STATES_LOCK = threading.Lock()


def register_state(key: str, state: RouterState) -> None:
    """Make a RouterState findable by the request router Ray Serve constructs in this process."""
    with _STATES_LOCK:
        _STATES[key] = state


def lookup_state(key: str) -> RouterState | None:
    with _STATES_LOCK:
        return _STATES.get(key)
