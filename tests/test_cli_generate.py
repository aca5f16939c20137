"""`kvcore generate`: streams the same text as the engine; bad input is a one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_helpers import make_engine, run_all
from kvcore.cli import main
from kvcore.sampling import SamplingParams


def test_generate_streams_the_engine_output(tiny_model_dir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    want = run_all(make_engine(tiny_model_dir), ["Hello there"],
                   SamplingParams(max_tokens=9, temperature=0.0))[0].outputs[0].text
    capsys.readouterr()
    assert main(["generate", str(tiny_model_dir), "Hello there", "--max-tokens", "9"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_generate_chat_and_seeded_sampling_repeat(tiny_model_dir: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", str(tiny_model_dir), "hi", "--chat", "--temperature", "0.8", "--seed",
            "7", "--max-tokens", "6", "--device", "cpu"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


@pytest.mark.parametrize(("argv", "message"), [
    (["/no/such/model", "hi"], "not a model directory"),
    (["a", "b", "c"], "expected [MODEL] PROMPT"),
])
def test_generate_errors_are_one_line(argv: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_generate_rejects_bad_sampling_values(tiny_model_dir: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tiny_model_dir), "hi", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
