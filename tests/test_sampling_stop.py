"""Stop conditions: token stops, lengths, stop strings across token boundaries, stream hold-back."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore.sampling import SamplingParams, StopChecker, find_stop_string, num_holdback_chars

EOS = (2,)


def stream(pieces: list[str], stops: tuple[str, ...], include: bool = False
           ) -> tuple[list[str], str, str | None]:
    """Feed `pieces` (one per token) through a StopChecker as an engine would; returns what was
    streamed at each step, the final text and the stop string."""
    checker = StopChecker(SamplingParams(stop=stops, include_stop_str_in_output=include,
                                         max_tokens=None), EOS)
    text, streamed = "", []
    for i, piece in enumerate(pieces):
        text += piece
        result = checker.check(100 + i, i + 1, i + 11, text, len(piece))
        if result is not None:
            streamed.append(result.text)
            assert isinstance(result.stop_reason, str)
            return streamed, result.text, result.stop_reason
        streamed.append(text[:len(text) - checker.holdback(text)])
    return streamed, text, None


def test_stop_string_across_token_boundaries() -> None:
    streamed, text, stop = stream(["Hel", "lo w", "orld", "!"], ("o wor",))
    assert (text, stop) == ("Hell", "o wor")
    assert streamed == ["Hel", "Hell", "Hell"]  # "o w" was held back, never streamed
    _, text, _ = stream(["Hel", "lo w", "orld", "!"], ("o wor",), include=True)
    assert text == "Hello wor"  # cut right after the stop string, "ld" dropped
    _, text, stop = stream(["a", "b", "c", "d"], ("abc",))
    assert (text, stop) == ("", "abc")


def test_earliest_match_wins_and_old_text_is_not_rematched() -> None:
    assert find_stop_string("xxabcd", 4, ("cd", "ab"), False) == ("ab", "xx")
    assert find_stop_string("xxabcd", 4, ("b", "ab"), False) == ("ab", "xx")
    # "ab" lies wholly in old text: a previous check already saw it, so it is not found again
    assert find_stop_string("abxyz", 3, ("ab",), False) is None
    assert find_stop_string("abxyz", 4, ("ab",), False) == ("ab", "")
    assert find_stop_string("abc", 0, ("c",), False) is None


def test_holdback_is_the_longest_partial_match() -> None:
    assert num_holdback_chars("Hello wo", ("world",), False) == 2
    assert num_holdback_chars("Hello w", ("world", "lo wx"), False) == 4
    assert num_holdback_chars("Hello", ("xyz",), False) == 0
    assert num_holdback_chars("Hello w", ("world",), True) == 0
    assert num_holdback_chars("ab", ("abcdef",), False) == 2
    assert num_holdback_chars("aaa", ("aab",), False) == 2
    assert num_holdback_chars("anything", (), False) == 0


@pytest.mark.parametrize("seed", range(40))
def test_random_streams_against_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    alphabet = list("abc d")
    text = "".join(rng.choice(alphabet, size=60))
    stops = tuple("".join(rng.choice(alphabet, size=int(rng.integers(1, 5))))
                  for _ in range(int(rng.integers(1, 4))))
    cuts = np.sort(rng.choice(np.arange(1, len(text)), size=20, replace=False))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    include = bool(rng.integers(0, 2))

    # reference: the first token after which some stop occurs in the text; cut at the earliest
    # occurrence (ties: the first stop listed)
    want_text, want_stop, cumulative = text, None, ""
    for piece in pieces:
        cumulative += piece
        found = [(cumulative.find(s), i, s) for i, s in enumerate(stops) if s in cumulative]
        if found:
            index, _, want_stop = min(found)
            want_text = cumulative[:index + (len(want_stop) if include else 0)]
            break
    streamed, got_text, got_stop = stream(pieces, stops, include)
    assert (got_text, got_stop) == (want_text, want_stop)
    for chunk in streamed:  # a partial match was never streamed: all are prefixes of the end
        assert want_text.startswith(chunk)
    assert all(len(a) <= len(b) for a, b in zip(streamed, streamed[1:], strict=False))


def test_token_stops_and_lengths() -> None:
    check = StopChecker(SamplingParams(max_tokens=5, stop_token_ids=(9,)), EOS, max_model_len=20)
    assert check.check(4, 1, 11, "x", 1) is None
    eos = check.check(2, 2, 12, "x", 0)
    assert eos is not None and (eos.finish_reason, eos.stop_reason) == ("stop", None)
    stop_id = check.check(9, 2, 12, "x", 0)
    assert stop_id is not None and (stop_id.finish_reason, stop_id.stop_reason) == ("stop", 9)
    length = check.check(4, 5, 15, "xxxxx", 1)
    assert length is not None and (length.finish_reason, length.stop_reason) == ("length", None)
    model_len = check.check(4, 3, 20, "xxx", 1)
    assert model_len is not None and model_len.finish_reason == "length"
    assert check.check(2, 5, 15, "x", 0).finish_reason == "stop"  # type: ignore[union-attr]


def test_ignore_eos_min_tokens_and_stop_string_over_length() -> None:
    ignore = StopChecker(SamplingParams(ignore_eos=True, max_tokens=None), EOS)
    assert ignore.check(2, 1, 5, "", 0) is None
    gated = StopChecker(SamplingParams(min_tokens=3, stop=("z",), stop_token_ids=(9,)), EOS)
    assert gated.check(2, 2, 5, "z", 1) is None
    assert gated.check(9, 2, 5, "z", 1) is None
    assert gated.check(9, 3, 5, "z", 0).stop_reason == 9  # type: ignore[union-attr]
    both = StopChecker(SamplingParams(max_tokens=2, stop=("end",)), EOS)
    result = both.check(7, 2, 9, "the end.", 5)
    assert result is not None and (result.finish_reason, result.stop_reason,
                                   result.text) == ("stop", "end", "the ")
