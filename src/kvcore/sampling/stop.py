"""Stop strings on the streamed text: where one completes, and what to hold back meanwhile."""

from __future__ import annotations

from collections.abc import Sequence


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
