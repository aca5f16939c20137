"""The ingress's routing metrics, added to the service's /metrics registry."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcore.cluster.policy import (
    FALLBACK_LOAD,
    FALLBACK_MISS,
    LEAST_LOADED,
    PREFIX,
    ROUND_ROBIN,
)
from kvcore.cluster.state import RouterState

REASONS = (PREFIX, FALLBACK_LOAD, FALLBACK_MISS, LEAST_LOADED, ROUND_ROBIN)


class RouterCollector(Collector):
    """Read at scrape time: per-replica routed requests, loads and cached tokens (the index's
    prediction next to what the replica reported), decisions by reason, the index's size."""

    def __init__(self, state: RouterState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state
        replicas = state.snapshot()
        per_replica = {
            "cluster_routed_requests": (CounterMetricFamily, "Requests routed to the replica.",
                                        lambda r: r.routed),
            "cluster_outstanding_requests": (GaugeMetricFamily,
                                             "Requests routed to the replica, not finished.",
                                             lambda r: r.num_outstanding),
            "cluster_predicted_cached_tokens": (
                CounterMetricFamily, "Prompt tokens the router's index predicted the replica "
                "held, over requests whose stream reported back.", lambda r: r.predicted_tokens),
            "cluster_reported_cached_tokens": (
                CounterMetricFamily, "Prompt tokens the replica served from its prefix cache, "
                "over the same requests.", lambda r: r.cached_tokens),
            "cluster_replica_kv_cache_usage_perc": (
                GaugeMetricFamily, "The replica's KV usage as last reported (0-1).",
                lambda r: r.stats.kv_cache_usage if r.stats else 0.0),
            "cluster_replica_num_requests_waiting": (
                GaugeMetricFamily, "The replica's waiting sequences as last reported.",
                lambda r: r.stats.num_waiting if r.stats else 0),
        }
        for name, (kind, doc, value) in per_replica.items():
            family = kind(f"kvcore:{name}", doc, labels=["replica"])
            for replica_id, replica in sorted(replicas.items()):
                family.add_metric([replica_id], value(replica))
            yield family
        decisions = CounterMetricFamily("kvcore:cluster_routing_decisions",
                                        "Routing decisions by reason: prefix (cache affinity), "
                                        "fallback-load, fallback-miss, least-loaded, "
                                        "round-robin.", labels=["reason"])
        for reason in REASONS:
            decisions.add_metric([reason], state.decisions.get(reason, 0))
        yield decisions
        yield GaugeMetricFamily("kvcore:cluster_index_entries",
                                "Chain hashes in the router's index.", value=len(state.index))
        yield CounterMetricFamily("kvcore:cluster_index_evictions",
                                  "Index entries dropped by its LRU bound.",
                                  value=state.index.num_evicted)
        yield CounterMetricFamily("kvcore:cluster_lost_event_batches",
                                  "Cache-event batches that never arrived (the replica's index "
                                  "entries were reset).", value=state.num_lost_batches)
