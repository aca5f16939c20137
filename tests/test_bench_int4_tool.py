"""Without a GPU, tools/bench_int4_kernels.py says so and exits 2 at once (nothing measured)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.device import cuda_available

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(cuda_available(), reason="this machine has a GPU")
def test_bench_int4_refuses_without_gpu() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_int4_kernels.py")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "no CUDA GPU available" in result.stderr
