"""Replica autoscaling from kvcore's capacity signals: KV usage, waiting sequences, preemptions.

Cache pressure comes before latency: a replica whose pool is nearly full preempts (recomputes)
and queues, so the policy scales up on those signals rather than on request counts alone. The
decision is a pure function (`desired_replicas`) tested against recorded series; the Ray Serve
policy (`kvcore_autoscaling_policy`, run by the Serve controller) only reads the replicas'
`record_autoscaling_stats` out of its context and keeps the state between calls. Imports no ray.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# names of the custom metrics each replica records (KVCoreReplica.record_autoscaling_stats)
KV_USAGE, NUM_WAITING, NUM_PREEMPTIONS = "kv_cache_usage", "num_waiting", "num_preemptions"
log = logging.getLogger("ray.serve")  # the policy runs in the Serve controller: its log file


@dataclass(frozen=True, slots=True)
class ScalingSignals:
    kv_cache_usage: float  # mean over replicas, 0-1
    num_waiting: float  # sequences waiting, summed over replicas
    preemptions_per_min: float  # summed over replicas


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    high_kv_usage: float = 0.8  # above: the pools are nearly full
    max_waiting_per_replica: float = 2.0  # above: requests queue for blocks or batch slots
    max_preemptions_per_min: float = 1.0  # above: the pools thrash
    low_kv_usage: float = 0.3  # below (and nothing waiting or preempted): room to spare
    downscale_after_s: float = 120.0  # low for this long before one replica goes

    def __post_init__(self) -> None:
        if not 0.0 < self.low_kv_usage < self.high_kv_usage <= 1.0:
            raise ValueError(f"need 0 < low_kv_usage < high_kv_usage <= 1, got "
                             f"{self.low_kv_usage!r} and {self.high_kv_usage!r}")
        for name in ("max_waiting_per_replica", "max_preemptions_per_min", "downscale_after_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")


def desired_replicas(signals: ScalingSignals, current: int, min_replicas: int, max_replicas: int,
                     policy: ScalingPolicy, low_since: float | None,
                     now: float) -> tuple[int, float | None]:
    """(replicas wanted, the new `low_since`). Scale up at once, in proportion to the worst
    overload; scale down one replica at a time after `downscale_after_s` of spare room."""
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {min_replicas} and "
                         f"{max_replicas}")
    current = max(current, 1)
    pressure = max(signals.kv_cache_usage / policy.high_kv_usage,
                   signals.num_waiting / current / max(policy.max_waiting_per_replica, 1e-9),
                   signals.preemptions_per_min / max(policy.max_preemptions_per_min, 1e-9))
    if pressure > 1.0:
        # at least one more; more when the overload is larger (ceil of the ratio)
        wanted = max(current + 1, math.ceil(current * pressure))
        return _clamp(wanted, min_replicas, max_replicas), None
    low = (signals.kv_cache_usage < policy.low_kv_usage and signals.num_waiting == 0
           and signals.preemptions_per_min == 0)
    if not low:
        return _clamp(current, min_replicas, max_replicas), None
    if low_since is None:
        return _clamp(current, min_replicas, max_replicas), now
    if now - low_since >= policy.downscale_after_s and current > min_replicas:
        return _clamp(current - 1, min_replicas, max_replicas), now  # the clock starts again
    return _clamp(current, min_replicas, max_replicas), low_since


def _clamp(n: int, low: int, high: int) -> int:
    return min(max(n, low), high)


def signals_from_metrics(metrics: Mapping[str, Mapping[Any, float]], previous: Mapping[str, Any],
                         now: float) -> tuple[ScalingSignals, dict[str, Any]]:
    """Signals from per-replica metrics {name: {replica: value}}; preemptions are the replicas'
    counters, so their rate needs the previous call's total (kept in the returned state). A
    restarted replica's counter starts again: a drop counts as no preemption."""
    usage = list(metrics.get(KV_USAGE, {}).values())
    waiting = sum(metrics.get(NUM_WAITING, {}).values())
    total = sum(metrics.get(NUM_PREEMPTIONS, {}).values())
    rate = 0.0
    if "preemptions" in previous and now > previous["time"]:
        rate = max(0.0, total - previous["preemptions"]) * 60.0 / (now - previous["time"])
    signals = ScalingSignals(sum(usage) / len(usage) if usage else 0.0, waiting, rate)
    return signals, {"preemptions": total, "time": now}


def kvcore_autoscaling_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Ray Serve's custom autoscaling policy (AutoscalingConfig.policy.policy_function):
    ctx is its AutoscalingContext."""
    now = ctx.current_time if ctx.current_time is not None else time.time()
    state = dict(ctx.policy_state or {})
    kwargs = dict(getattr(getattr(ctx.config, "policy", None), "policy_kwargs", None) or {})
    policy = ScalingPolicy(**kwargs)
    signals, rate_state = signals_from_metrics(ctx.aggregated_metrics or {}, state, now)
    low = max(1, ctx.capacity_adjusted_min_replicas)
    wanted, low_since = desired_replicas(
        signals, ctx.current_num_replicas, low, max(low, ctx.capacity_adjusted_max_replicas),
        policy, state.get("low_since"), now)
    if wanted != ctx.current_num_replicas and wanted != state.get("wanted"):
        log.info("kvcore autoscaling: %d -> %d replicas (%s)", ctx.current_num_replicas, wanted,
                 signals)
    return wanted, {**rate_state, "low_since": low_since, "wanted": wanted}
