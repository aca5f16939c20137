"""The public API: `from kvcore import LLM, SamplingParams, ...` works and stays lazy."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_public_names_import_lazily() -> None:
    code = (
        "import sys, kvcore\n"
        "assert 'numpy' not in sys.modules, 'import kvcore must stay light'\n"
        "from kvcore import (LLM, AsyncEngine, BeamSearchParams, EngineConfig, SamplingParams,\n"
        "                    ParamError, RequestFailed)\n"
        "from kvcore.engine import LLM as L2\n"
        "assert LLM is L2 and SamplingParams(n=2).n == 2\n"
        "assert issubclass(ParamError, ValueError) and issubclass(RequestFailed, RuntimeError)\n"
        "assert 'LLM' in dir(kvcore)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_names_are_attribute_errors() -> None:
    import kvcore

    with pytest.raises(AttributeError, match="NoSuchThing"):
        kvcore.NoSuchThing  # noqa: B018
