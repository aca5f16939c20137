"""Without a GPU, tools/gpu_check.sh and tools/bench_kernels.py say so and exit non-zero at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcore.device import cuda_available

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(cuda_available(), reason="this machine has a GPU")


def test_gpu_check_refuses_without_gpu() -> None:
    start = time.monotonic()
    result = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh")], capture_output=True,
                            text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    assert result.returncode == 2
    assert "no CUDA GPU available" in result.stderr
    assert "pytest" not in result.stdout  # it stopped before running anything
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("tool", ["bench_kernels.py", "bench_mla.py"])
def test_bench_refuses_without_gpu(tool: str) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "tools" / tool)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "no CUDA GPU available" in result.stderr


def test_gpu_check_fits_one_ten_minute_call() -> None:
    """The script's timeouts add up to at most 9 min 50 s (the device lends 10-minute calls),
    and it times int4 decode beside fp16 and prefill TFLOP/s."""
    import re

    script = (ROOT / "tools" / "gpu_check.sh").read_text()
    total = sum(int(t) for t in re.findall(r"\btimeout (\d+) ", script))
    assert 0 < total <= 590, total
    assert "tools/bench_int4_kernels.py" in script and "tools/bench_kernels.py" in script
