"""tools/bench_serving.py against a live tiny server: counts, disconnects, no leaked blocks."""

from __future__ import annotations

import sys
from pathlib import Path

from service_fixtures import tiny_app
from service_live import live_server

sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
import bench_serving  # noqa: E402


def test_bench_serving_reports_and_frees(tiny_model_dir) -> None:
    engine = {"max_model_len": 256, "num_blocks": 400}
    with live_server(lambda: tiny_app(tiny_model_dir, engine_kwargs=engine)) as server:
        common = ["--base-url", server.url, "--vocab-size", "259", "--token-id-min", "3",
                  "--num-prompts", "12", "--output-len", "12", "--input-len", "8"]
        report = bench_serving.main([*common, "--dataset", "shared-prefix", "--prefix-len", "16",
                                     "--num-groups", "2", "--max-concurrency", "4",
                                     "--disconnect-fraction", "0.25"])
        assert report["errors"] == 0 and report["disconnected"] == 3
        assert report["completed"] == 9 and report["total_output_tokens"] == 9 * 12
        assert report["leaked_blocks"] == 0 and report["kv_cache_usage_after"] == 0
        assert report["cached_prompt_tokens"] > 0  # later prompts of a group hit the prefix
        assert report["median_ttft_ms"] > 0 and report["mean_tpot_ms"] > 0
        mixed = bench_serving.main([*common, "--dataset", "mixed", "--request-rate", "50"])
        assert mixed["errors"] == 0 and mixed["completed"] == 12
        assert mixed["leaked_blocks"] == 0
