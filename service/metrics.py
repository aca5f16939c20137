"""Prometheus metrics under vLLM's names (`kvcore:` prefix), one CollectorRegistry per app."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

# vLLM's bucket edges, so dashboards built for it read the same
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Reads the engine's counters and gauges at scrape time (nothing while the model loads)."""

    def __init__(self, model_name: str, stats: Callable[[], Any | None]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        name = [self._model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"kvcore:{metric}", doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"kvcore:{metric}", doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks referenced (0-1).",
                    stats.kv_cache_usage)
        yield gauge("num_free_blocks", "KV blocks not referenced by any sequence.",
                    stats.num_free_blocks)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      stats.prefix_cache_hits)
        yield counter("num_preemptions", "Preemptions (recompute) of running requests.",
                      stats.num_preemptions)
        spec = getattr(stats, "spec_decode", None)  # None: speculative decoding is off
        if spec is not None:
            yield counter("spec_decode_num_drafts", "Sequence-steps that verified drafts.",
                          spec.num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.",
                          spec.num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          spec.num_accepted_tokens)
            per_pos = CounterMetricFamily("kvcore:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the draft.",
                                          labels=["model_name", "position"])
            for pos, value in enumerate(spec.accepted_per_pos):
                per_pos.add_metric([self._model_name, str(pos)], value)
            yield per_pos
        mask = getattr(stats, "mask_seconds", None)
        if mask is not None:
            yield _histogram("structured_output_mask_seconds",
                             "Seconds per step computing structured-output token masks.",
                             name, *mask)
        tiers = getattr(stats, "tiers", None)  # None: no KV tier
        if tiers is not None:
            yield from _tier_metrics(self._model_name, tiers)
        yield gauge("kv_cache_bytes", "Bytes held by the KV cache pool (the planner's figure).",
                    getattr(stats, "kv_cache_bytes", 0))
        info = GaugeMetricFamily("kvcore:cache_config_info", "KV cache configuration.",
                                 labels=["block_size", "cache_dtype", "num_blocks"])
        info.add_metric([str(stats.block_size), str(stats.cache_dtype), str(stats.num_blocks)], 1)
        yield info


def _tier_metrics(model: str, tiers: Any) -> Iterator[Metric]:
    """The KV tiers: restored tokens, bytes held, pages written and dropped, per tier; failed
    page loads; seconds per load (a chain of pages) and per write batch."""
    per_tier = (
        (CounterMetricFamily, "kv_tier_hits", "Prompt tokens restored from a KV tier.",
         tiers.hit_tokens),
        (GaugeMetricFamily, "kv_tier_bytes", "Bytes of KV pages a tier holds.", tiers.bytes),
        (GaugeMetricFamily, "kv_tier_capacity_bytes", "Bytes a KV tier may hold.",
         tiers.capacity_bytes),
        (CounterMetricFamily, "kv_tier_stores", "KV pages written to a tier.", tiers.stores),
        (CounterMetricFamily, "kv_tier_dropped_writes",
         "KV pages not written to a tier: its write queue was full.", tiers.dropped_writes))
    for kind, metric, doc, values in per_tier:
        family = kind(f"kvcore:{metric}", doc, labels=["model_name", "tier"])
        for tier in tiers.capacity_bytes:  # every tier, 0 before its first event
            family.add_metric([model, tier], values.get(tier, 0))
        yield family
    failures = CounterMetricFamily("kvcore:kv_tier_load_failures",
                                   "KV pages that could not be loaded (recomputed).",
                                   labels=["model_name"])
    failures.add_metric([model], tiers.load_failures)
    yield failures
    yield _histogram("kv_tier_load_seconds", "Seconds per KV tier load (a chain of pages).",
                     [model], *tiers.load_seconds)
    yield _histogram("kv_tier_store_seconds", "Seconds per batch of KV pages written to a tier.",
                     [model], *tiers.store_seconds)


def _histogram(metric: str, doc: str, name: list[str], edges: tuple[float, ...],
               counts: tuple[int, ...], total: float) -> HistogramMetricFamily:
    family = HistogramMetricFamily(f"kvcore:{metric}", doc, labels=["model_name"])
    cumulative, buckets = 0, []
    for edge, count in zip((*[str(e) for e in edges], "+Inf"), counts, strict=True):
        cumulative += count
        buckets.append((edge, cumulative))
    family.add_metric(name, buckets, sum_value=total)
    return family


class ServiceMetrics:
    """Per-request counters and latency histograms, plus the engine's state at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], Any | None]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter("kvcore:prompt_tokens", "Prefill tokens processed.",
                                     labels, registry=reg)
        self.generation_tokens = Counter("kvcore:generation_tokens", "Tokens generated.",
                                         labels, registry=reg)
        self.request_success = Counter("kvcore:request_success", "Finished requests.",
                                       ["model_name", "finished_reason"], registry=reg)
        self.ttft = Histogram("kvcore:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("kvcore:inter_token_latency_seconds", "Time between tokens.",
                             labels, buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("kvcore:e2e_request_latency_seconds", "Arrival to finish.",
                             labels, buckets=REQUEST_BUCKETS, registry=reg)
        self.queue_time = Histogram("kvcore:request_queue_time_seconds",
                                    "Arrival to first scheduling.", labels,
                                    buckets=REQUEST_BUCKETS, registry=reg)
        self.structured = Counter("kvcore:structured_output_requests",
                                  "Requests with a constrained output, by kind.",
                                  ["model_name", "kind"], registry=reg)
        self.unenforced = Counter(
            "kvcore:structured_output_unenforced_violations",
            "Answers breaking a schema keyword that is checked only after generation.",
            ["model_name"], registry=reg)
        reg.register(_EngineCollector(model_name, stats))

    def observe_structured(self, kind: str) -> None:
        self.structured.labels(self.model_name, kind).inc()

    def observe_token_gap(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def observe_request(self, num_prompt_tokens: int, num_generated_tokens: int,
                        finish_reasons: list[str], timings: Any) -> None:
        """A finished (or aborted) request; timings: a RequestMetrics (time.monotonic() stamps)."""
        model = self.model_name
        self.prompt_tokens.labels(model).inc(num_prompt_tokens)
        self.generation_tokens.labels(model).inc(num_generated_tokens)
        for reason in finish_reasons:  # one per choice, as vLLM counts parallel samples
            self.request_success.labels(model, reason).inc()
        arrival = getattr(timings, "arrival_time", None)
        if arrival is None:
            return
        for histogram, stamp in ((self.queue_time, "first_scheduled_time"),
                                 (self.ttft, "first_token_time"), (self.e2e, "finished_time")):
            value = getattr(timings, stamp, None)
            if value is not None:
                histogram.labels(model).observe(max(0.0, value - arrival))

    def render(self) -> bytes:
        return generate_latest(self.registry)
