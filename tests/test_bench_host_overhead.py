"""tools/bench_host_overhead.py on the tiny model: its report's keys, and its oracle and window."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
import bench_host_overhead  # noqa: E402


def test_reports_both_modes_direct_and_flatness(tiny_model_dir: Path) -> None:
    """Each run validates every stream's tokens and text against the stub's rule before it
    reports, so a report at all means the engine produced exactly the oracle's output."""
    report = bench_host_overhead.main(["--model", str(tiny_model_dir), "--n", "3", "--steps", "2",
                                       "--flatness", "5", "--json"])
    assert report["n"] == 3 and report["steps"] == 2 and report["flatness_n"] == 5
    assert report["path"] == "direct"
    for mode in ("logits", "ids"):
        for suffix in ("", "_cpu", "_at_flatness_n", "_cpu_at_flatness_n"):
            value = report[f"us_per_request_step_{mode}{suffix}"]
            assert 0 < value < 1e6, (mode, suffix, value)
        ratio = (report[f"us_per_request_step_{mode}_at_flatness_n"]
                 / report[f"us_per_request_step_{mode}"])
        assert report[f"flatness_{mode}"] == pytest.approx(ratio, rel=0.01)
        assert report[f"flatness_{mode}_cpu"] > 0


def test_http_path_reports_suffixed_keys(tiny_model_dir: Path) -> None:
    report = bench_host_overhead.main(["--model", str(tiny_model_dir), "--n", "3", "--steps", "2",
                                       "--mode", "ids", "--http", "--json"])
    assert report["path"] == "http"
    assert report["us_per_request_step_ids_http"] > 0
    assert report["us_per_request_step_ids_http_cpu"] > 0
    assert "us_per_request_step_ids" not in report
    assert "us_per_request_step_logits_http" not in report


def test_rule_oracle_follows_previous_token_and_position() -> None:
    rule = bench_host_overhead.TokenRule(vocab_size=50, num_rows=7, with_logits=True, seed=1)
    assert np.array_equal(rule.row_token, rule.logits.argmax(axis=1))
    tokens = rule.expected([5, 9], 4)
    seq = [5, 9, *tokens]
    for i in range(2, 6):
        assert seq[i] == rule.row_token[(seq[i - 1] * 1_000_003 + i - 1) % 7]


def test_window_counts_whole_steps_and_subtracts_forward() -> None:
    # (wall end, process CPU end, wall inside, CPU inside, rows): 2 streams, 1 partial step first
    calls = [(float(i), 10.0 * i, 0.25, 0.5, 1 if i == 0 else 2) for i in range(8)]
    wall, cpu, forward = bench_host_overhead.timed_window(calls, n=2, steps=3)
    # warm-up: calls 1..4; timed: calls 5..7, each 1 s apart of which 0.25 s in the stub
    assert (wall, cpu, forward) == (3 - 0.75, 30 - 1.5, 0.75)
    with pytest.raises(RuntimeError, match="no 4 steps of all 2 streams"):
        bench_host_overhead.timed_window(calls, n=2, steps=4)


@pytest.mark.parametrize("device", ["timeline", "thread"])
def test_gpu_shaped_mode_reports_busy_fractions_on_and_off(tiny_model_dir: Path,
                                                           device: str) -> None:
    """The fake device takes a fixed step; both runs still produce the oracle's tokens
    (pending tokens filled on the device), and report a busy fraction."""
    report = bench_host_overhead.main(["--model", str(tiny_model_dir), "--n", "3", "--steps", "2",
                                       "--mode", "gpu", "--gpu-step-ms", "1,2", "--gpu-device",
                                       device, "--json"])
    assert report["gpu_step_ms"] == [1.0, 2.0] and report["gpu_device"] == device
    for ms in ("1", "2"):
        for name in ("off", "on"):
            key = f"{ms}ms_async_{name}"
            assert 0 < report[f"gpu_busy_{key}"] <= 1
            assert report[f"gpu_host_cpu_us_per_request_step_{key}"] > 0
            assert report[f"gpu_step_wall_ms_{key}"] >= float(ms) * 0.99
    assert "us_per_request_step_ids" not in report
    with pytest.raises(ValueError, match="gpu_step_ms"):
        bench_host_overhead.main(["--model", str(tiny_model_dir), "--mode", "gpu",
                                  "--gpu-step-ms", "0"])


def test_timeline_stream_orders_steps_and_waits_only_on_the_host() -> None:
    sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
    from sim_device import TimelineStream

    stream = TimelineStream(0.01)
    first = stream.submit(lambda: 1)
    second = stream.submit(lambda: first.result() + 1)  # device work: no wait for `first`
    (s0, e0), (s1, e1) = stream.spans
    assert s1 == e0 and e1 - s1 == pytest.approx(0.01) and e0 - s0 == pytest.approx(0.01)
    assert second.result() == 2  # the host waits until the second step's end
    import time
    assert time.perf_counter() >= e1
    with pytest.raises(ValueError, match="step_s"):
        TimelineStream(0.0)
