"""tools/gpu_e2e.py runs end to end on the CPU (the GPU machine runs it through gpu_check.sh)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import gpu_e2e  # noqa: E402


def test_gpu_e2e_on_the_cpu_with_random_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    assert gpu_e2e.main(["--like", str(tiny_model_dir), "--device", "cpu", "--batches", "1,3",
                         "--new-tokens", "5", "--greedy-tokens", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not result["real_weights"]
    runs = result["runs"]
    assert [r["batch"] for r in runs][:2] == [1, 3]
    assert all(r["tokens_per_s"] > 0 and r["busy"] is None for r in runs)
    assert all(r["steps"] >= 5 for r in runs)  # a prefill step, then one decode step per token
    # the CPU engine against itself: every greedy token agrees
    assert result["greedy_agreement"] == [4, 4, 4, 4]
