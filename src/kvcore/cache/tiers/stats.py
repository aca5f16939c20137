"""The tiers' counters and latency histograms (host data, read at scrape time), and the measured
bandwidth of each tier that decides whether a load beats recomputing."""

from __future__ import annotations

from dataclasses import dataclass, field

SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)
# a tier's bandwidth before any load measured it (bytes/s): the page cache and memory move
# gigabytes per second, a cold disk hundreds of megabytes
INITIAL_BANDWIDTH = {"host": 2e9, "disk": 4e8}
EMA_WEIGHT = 0.3  # of the newest measurement


class SecondsHistogram:
    """Counts per bucket (upper edges; one more above all) and the sum, as Prometheus wants."""

    def __init__(self, buckets: tuple[float, ...] = SECONDS_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        i = next((i for i, edge in enumerate(self.buckets) if seconds <= edge), len(self.buckets))
        self.counts[i] += 1
        self.total += seconds

    def snapshot(self) -> tuple[tuple[float, ...], tuple[int, ...], float]:
        return self.buckets, tuple(self.counts), self.total


@dataclass(slots=True)
class TierCounters:
    """Per tier name: pages restored (hits), pages written, pages whose write was dropped (a
    full queue), pages that failed to load; and the load / store latency histograms."""

    hits: dict[str, int] = field(default_factory=dict)
    stores: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    load_failures: int = 0
    load_seconds: SecondsHistogram = field(default_factory=SecondsHistogram)
    store_seconds: SecondsHistogram = field(default_factory=SecondsHistogram)
    # measured bytes per second of loads from each tier (an exponential moving average)
    bandwidth: dict[str, float] = field(default_factory=lambda: dict(INITIAL_BANDWIDTH))

    def add(self, counts: dict[str, int], tier: str, num: int) -> None:
        counts[tier] = counts.get(tier, 0) + num

    def measured(self, tier: str, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            return
        rate = num_bytes / seconds
        old = self.bandwidth.get(tier)
        self.bandwidth[tier] = rate if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * rate


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot for EngineStats (/metrics): per tier, restored tokens, bytes held, pages
    written and dropped; loads that failed; the seconds histograms."""

    hit_tokens: dict[str, int]
    bytes: dict[str, int]
    capacity_bytes: dict[str, int]
    stores: dict[str, int]
    dropped_writes: dict[str, int]
    load_failures: int
    load_seconds: tuple[tuple[float, ...], tuple[int, ...], float]
    store_seconds: tuple[tuple[float, ...], tuple[int, ...], float]
