"""Shared pytest fixtures: the tiny random-weight model checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests import tiny_model as a plain module

from tiny_model import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint (GQA 4/2 heads, vocab 259), written once per test session."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"))
