"""Stop conditions: EOS and stop token ids, max_tokens / max_model_len, stop strings on the text."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvcore.sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class StopResult:
    finish_reason: str  # "stop" or "length"
    stop_reason: int | str | None  # the stop token id or stop string; None for EOS and length
    text: str  # the output text to keep: cut before the stop string (or after it, if included)


def find_stop_string(text: str, num_new_chars: int, stops: Sequence[str],
                     include_stop_str_in_output: bool) -> tuple[str, str] | None:
    """The stop string completed by the last `num_new_chars` characters of `text`, if any.

    Only windows that end in the new characters are searched, so a stop string split across
    token boundaries is found exactly once. With several matches the one starting first wins
    (ties: the first in `stops`). Returns (stop string, text truncated before it, or right after
    it when include_stop_str_in_output), else None.
    """
    if not stops or num_new_chars <= 0:
        return None
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None
    index, stop = best
    end = index + len(stop) if include_stop_str_in_output else index
    return stop, text[:end]


def num_holdback_chars(text: str, stops: Sequence[str], include_stop_str_in_output: bool) -> int:
    """How many trailing characters of `text` must not be streamed yet: the longest suffix that
    is a proper prefix of a stop string (it may still grow into one). 0 when the stop string is
    included in the output anyway."""
    if include_stop_str_in_output:
        return 0
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class StopChecker:
    """Decides, after each generated token, whether a sequence is finished and why.

    Order per token: EOS (unless ignore_eos) and stop_token_ids, then stop strings, then length
    (max_tokens or max_model_len); none of the "stop" reasons fire before min_tokens tokens.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Collection[int],
                 max_model_len: int | None = None) -> None:
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.max_model_len = max_model_len

    def check(self, token_id: int, num_output_tokens: int, num_total_tokens: int, text: str,
              num_new_chars: int) -> StopResult | None:
        """`token_id`: the token just appended; `num_output_tokens` / `num_total_tokens`: counts
        including it; `text`: the cumulative output text including its `num_new_chars` chars."""
        p = self.params
        if num_output_tokens >= p.min_tokens:
            if token_id in self.eos_token_ids:
                return StopResult("stop", None, text)
            if token_id in self.stop_token_ids:
                return StopResult("stop", token_id, text)
            found = find_stop_string(text, num_new_chars, p.stop, p.include_stop_str_in_output)
            if found is not None:
                return StopResult("stop", found[0], found[1])
        if p.max_tokens is not None and num_output_tokens >= p.max_tokens:
            return StopResult("length", None, text)
        if self.max_model_len is not None and num_total_tokens >= self.max_model_len:
            return StopResult("length", None, text)
        return None

    def holdback(self, text: str) -> int:
        """Trailing characters of `text` to hold back from streaming (see num_holdback_chars)."""
        return num_holdback_chars(text, self.params.stop, self.params.include_stop_str_in_output)
