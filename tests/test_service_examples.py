"""The README's embedding examples run as written (on the tiny model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("name", ["embed_subapp.py", "embed_async_engine.py"])
def test_example_runs(tiny_model_dir: Path, name: str) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / name), str(tiny_model_dir)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    if name == "embed_subapp.py":
        assert "my application" in lines
        assert "'prompt_tokens_details': {'cached_tokens': 0}" in done.stdout
    else:
        assert sum(" -> " in line for line in lines) == 3
