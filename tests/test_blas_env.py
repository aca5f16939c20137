"""Importing kvcore before NumPy shortens OpenBLAS's spin (see kvcore/__init__.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_SHOW = "import os; print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"


@pytest.mark.parametrize("preset,first,expected", [
    (None, "import kvcore", "18"),
    ("9", "import kvcore", "9"),  # a value the user set wins
    (None, "import numpy, kvcore", "None"),  # too late: OpenBLAS has read its environment
])
def test_openblas_thread_timeout(preset: str | None, first: str, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if preset is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = preset
    out = subprocess.run([sys.executable, "-c", f"{first}; {_SHOW}"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == expected
