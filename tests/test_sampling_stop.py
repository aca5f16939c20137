"""Stop conditions: token stops and lengths (the core's Sequence), stop strings across token
boundaries and the stream hold-back (the output processor's choices)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore.engine.output import _Choice
from kvcore.request import Sequence, SequenceStatus
from kvcore.sampling import SamplingParams, find_stop_string, num_holdback_chars

EOS = frozenset({2})


class _NoTokenizer:
    """What a choice's detokenizer reads of its tokenizer before the test swaps in _Pieces."""

    byte_fallback_ids = frozenset({0})  # (the Python detokenizer: no native decode stream)


NO_TOKENIZER = _NoTokenizer()


class _Pieces:
    """A detokenizer stand-in: token 100 + i decodes to pieces[i]."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def add(self, token_id: int) -> str:
        return self.pieces[token_id - 100]

    def flush(self) -> str:
        return ""


def stream(pieces: list[str], stops: tuple[str, ...], include: bool = False
           ) -> tuple[list[str], str, str | None]:
    """Feed `pieces` (one per token) through a choice of the output processor as the engine
    would; returns what was streamed so far after each token, the final text and the stop."""
    choice = _Choice(0, SamplingParams(stop=stops, include_stop_str_in_output=include,
                                       max_tokens=None), NO_TOKENIZER)  # type: ignore[arg-type]
    choice.detokenizer = _Pieces(pieces)  # type: ignore[assignment]
    streamed, so_far = [], ""
    for i in range(len(pieces)):
        stopped = choice.add(100 + i, None, None, None)
        so_far += choice.delta(False).text
        streamed.append(so_far)
        if stopped:
            final = choice.delta(True)
            assert final.finish_reason == "stop" and final.text == ""  # all streamed already
            return streamed, so_far, choice.stop_reason  # type: ignore[return-value]
    return streamed, "".join(pieces), None


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


def _seq(params: SamplingParams, max_tokens: int) -> Sequence:
    eos = frozenset() if params.ignore_eos else EOS
    return Sequence(seq_id="s", request_id="s", prompt_token_ids=[5] * 10, params=params,
                    max_tokens=max_tokens, stop_token_ids=eos | frozenset(params.stop_token_ids),
                    eos_token_ids=eos)


def test_token_stops_and_lengths() -> None:
    params = SamplingParams(max_tokens=5, stop_token_ids=(9,))
    seq = _seq(params, 5)
    assert seq.append_token(4) is None
    assert seq.append_token(2) is SequenceStatus.FINISHED_STOPPED and seq.stop_reason is None
    seq = _seq(params, 5)
    assert seq.append_token(9) is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == 9
    seq = _seq(params, 5)
    assert [seq.append_token(4) for _ in range(5)][-1] is SequenceStatus.FINISHED_LENGTH
    seq = _seq(params, 3)  # max_model_len left room for 3 tokens: the resolved max_tokens
    assert [seq.append_token(4) for _ in range(3)][-1] is SequenceStatus.FINISHED_LENGTH
    seq = _seq(params, 5)
    for _ in range(4):
        seq.append_token(4)
    assert seq.append_token(2) is SequenceStatus.FINISHED_STOPPED  # a stop beats the length


def test_ignore_eos_min_tokens_and_stop_string_over_length() -> None:
    ignore = _seq(SamplingParams(ignore_eos=True, max_tokens=None), 50)
    assert ignore.append_token(2) is None
    gated = _seq(SamplingParams(min_tokens=3, stop=("z",), stop_token_ids=(9,)), 16)
    assert gated.append_token(2) is None and gated.append_token(9) is None
    assert gated.append_token(9) is SequenceStatus.FINISHED_STOPPED and gated.stop_reason == 9
    # a stop string completed by the last token wins over the length that token reached
    choice = _Choice(0, SamplingParams(max_tokens=2, stop=("end",)), NO_TOKENIZER)  # type: ignore
    choice.detokenizer = _Pieces(["the e", "nd."])  # type: ignore[assignment]
    assert not choice.add(100, None, None, None)
    assert choice.add(101, None, SequenceStatus.FINISHED_LENGTH, None)
    final = choice.delta(True)
    assert (final.finish_reason, final.stop_reason, final.text) == ("stop", "end", "the ")
    # min_tokens gates stop strings too
    gated_text = _Choice(0, SamplingParams(min_tokens=2, stop=("z",)),
                         NO_TOKENIZER)  # type: ignore[arg-type]
    gated_text.detokenizer = _Pieces(["z", "z"])  # type: ignore[assignment]
    assert not gated_text.add(100, None, None, None)
    assert gated_text.add(101, None, None, None)
