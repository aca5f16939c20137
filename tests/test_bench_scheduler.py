"""tools/bench_scheduler.py: sizes side by side, and it finishes where the running count exceeds
the per-step token budget (it used to spin forever in its warm-up there)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
import bench_scheduler  # noqa: E402


def test_reports_each_size() -> None:
    report = bench_scheduler.main(["--num-requests", "8", "40", "--steps", "20",
                                   "--prompt-len", "20", "--json"])
    assert [run["n"] for run in report["runs"]] == [8, 40]
    for run in report["runs"]:
        assert run["total"] > 0 and run["total_cpu"] > 0
        assert run["total"] >= run["schedule"]


def test_warm_up_admits_everyone_at_once_when_n_exceeds_the_budget() -> None:
    """2,048 running at a 2,048-token budget: the decode-first order used to leave almost no
    budget for the last prompts, the first requests reached max_tokens during the warm-up, and
    the warm-up loop never ended (measured: millions of empty steps)."""
    scheduler = bench_scheduler.warm_scheduler(2048, steps=2, prompt_len=64, block_size=16)
    assert len(scheduler.running) == 2048 and not scheduler.waiting
    assert all(r.num_output_tokens == 1 for r in scheduler.running)
    assert scheduler.max_num_batched_tokens == 2048
