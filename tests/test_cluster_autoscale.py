"""The autoscaling policy's decisions over recorded metric series (no Ray)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcore.cluster.autoscale import (
    KV_USAGE,
    NUM_PREEMPTIONS,
    NUM_WAITING,
    ScalingPolicy,
    ScalingSignals,
    desired_replicas,
    kvcore_autoscaling_policy,
    signals_from_metrics,
)

POLICY = ScalingPolicy(high_kv_usage=0.8, max_waiting_per_replica=2.0,
                       max_preemptions_per_min=1.0, low_kv_usage=0.3, downscale_after_s=60.0)


def _run(series: list[tuple[float, float, float, float]], start: int, low: int,
         high: int) -> list[int]:
    """Feed (t, kv usage, waiting, preemptions/min) samples; the replica count follows each
    decision at once (as Serve applies it); returns the decisions."""
    current, low_since, out = start, None, []
    for t, kv, waiting, preempt in series:
        current, low_since = desired_replicas(ScalingSignals(kv, waiting, preempt), current,
                                              low, high, POLICY, low_since, t)
        out.append(current)
    return out


def test_cache_pressure_scales_up_before_requests_pile_up() -> None:
    # a morning ramp recorded every 10 s: KV usage climbs while nothing waits yet
    series = [(0, 0.40, 0, 0), (10, 0.70, 0, 0), (20, 0.85, 0, 0), (30, 0.60, 0, 0),
              (40, 0.65, 1, 0), (50, 0.95, 9, 3.0), (60, 0.70, 0, 0)]
    assert _run(series, start=1, low=1, high=8) == [1, 1, 2, 2, 2, 6, 6]


def test_preemptions_alone_scale_up() -> None:
    assert _run([(0, 0.5, 0, 4.0)], start=2, low=1, high=8) == [8]
    assert _run([(0, 0.5, 0, 1.5)], start=2, low=1, high=8) == [3]


def test_scale_down_waits_for_sustained_room_and_goes_one_at_a_time() -> None:
    # quiet night: low usage for 3 minutes with one blip that resets the clock
    series = [(0, 0.1, 0, 0), (30, 0.1, 0, 0), (50, 0.5, 0, 0), (60, 0.1, 0, 0),
              (100, 0.1, 0, 0), (120, 0.2, 0, 0), (130, 0.1, 0, 0), (180, 0.1, 0, 0),
              (190, 0.1, 0, 0), (250, 0.1, 0, 0)]
    assert _run(series, start=3, low=1, high=8) == [3, 3, 3, 3, 3, 2, 2, 1, 1, 1]


def test_bounds_hold() -> None:
    assert _run([(0, 1.0, 100, 50.0)], start=2, low=1, high=3) == [3]
    assert _run([(0, 0.5, 0, 0)], start=1, low=2, high=4) == [2]
    with pytest.raises(ValueError, match="min_replicas"):
        desired_replicas(ScalingSignals(0, 0, 0), 1, 3, 2, POLICY, None, 0.0)
    with pytest.raises(ValueError, match="low_kv_usage"):
        ScalingPolicy(low_kv_usage=0.9, high_kv_usage=0.8)


def test_preemption_rate_from_counters_survives_a_restart() -> None:
    metrics = {KV_USAGE: {"a": 0.2, "b": 0.4}, NUM_WAITING: {"a": 1.0, "b": 2.0},
               NUM_PREEMPTIONS: {"a": 10.0, "b": 5.0}}
    signals, state = signals_from_metrics(metrics, {}, now=100.0)
    assert signals == ScalingSignals(pytest.approx(0.3), 3.0, 0.0)
    metrics[NUM_PREEMPTIONS] = {"a": 13.0, "b": 5.0}
    signals, state = signals_from_metrics(metrics, state, now=130.0)
    assert signals.preemptions_per_min == pytest.approx(6.0)
    metrics[NUM_PREEMPTIONS] = {"a": 13.0, "c": 0.0}  # b restarted as c: its count is gone
    signals, _ = signals_from_metrics(metrics, state, now=160.0)
    assert signals.preemptions_per_min == 0.0


def test_ray_policy_reads_the_context_and_keeps_its_state() -> None:
    def ctx(t: float, usage: float, preemptions: float, state: dict) -> SimpleNamespace:
        return SimpleNamespace(
            current_time=t, policy_state=state, config=None, current_num_replicas=2,
            capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
            aggregated_metrics={KV_USAGE: {"a": usage, "b": usage}, NUM_WAITING: {"a": 0.0},
                                NUM_PREEMPTIONS: {"a": preemptions}})
    wanted, state = kvcore_autoscaling_policy(ctx(0.0, 0.5, 0.0, {}))
    assert wanted == 2
    wanted, state = kvcore_autoscaling_policy(ctx(60.0, 0.5, 3.0, state))  # 3 per minute
    assert wanted == 4
    wanted, state = kvcore_autoscaling_policy(ctx(70.0, 0.1, 3.0, state))
    assert (wanted, state["low_since"]) == (2, 70.0)
