"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the sequence's
last n tokens in its own prompt and output (vLLM's "ngram" method)."""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """The latest occurrence of every n-gram (prompt_lookup_min <= n <= prompt_lookup_max) of
    one token list, indexed incrementally as the list grows (tokens are only ever appended)."""

    __slots__ = ("low", "high", "num_indexed", "tables")

    def __init__(self, low: int, high: int) -> None:
        self.low = low
        self.high = high
        self.num_indexed = 0  # n-grams ending before position num_indexed are indexed
        # n -> n-gram -> the position after its latest indexed occurrence (where it continued)
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(low, high + 1)}

    def match(self, token_ids: Sequence[int]) -> tuple[int, int]:
        """(n, p): the longest n whose last-n-token suffix occurred earlier, continuing at p
        (p < len(token_ids)); (0, 0) when none did."""
        num = len(token_ids)
        tables = self.tables
        # index every occurrence that has a continuation: those ending before the last token
        for end in range(max(self.num_indexed, self.low), num):
            for n in range(self.low, min(self.high, end) + 1):
                tables[n][tuple(token_ids[end - n:end])] = end
        self.num_indexed = max(self.num_indexed, num)
        for n in range(min(self.high, num - 1), self.low - 1, -1):
            p = tables[n].get(tuple(token_ids[num - n:]))
            if p is not None:
                return n, p
        return 0, 0


def continuation(token_ids: Sequence[int], p: int, num_tokens: int) -> list[int]:
    """The num_tokens tokens that follow the match continuing at p: what followed it, and past
    the end of the list the same period again (a loop continues as it went)."""
    period = len(token_ids) - p
    draft = list(token_ids[p:p + num_tokens])
    while len(draft) < num_tokens:
        draft.append(draft[len(draft) - period])
    return draft


class NgramProposer:
    """Drafts from each sequence's own tokens; its index lives while the sequence does."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.low = prompt_lookup_min
        self.high = prompt_lookup_max
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, seq_id: str, token_ids: Sequence[int], salt: str | None,
                num_tokens: int) -> list[int]:
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = NgramIndex(self.low, self.high)
        n, p = index.match(token_ids)
        return continuation(token_ids, p, num_tokens) if n else []

    def finish(self, seq_id: str, output_token_ids: Sequence[int] | None,
               salt: str | None) -> None:
        """The sequence ended (`output_token_ids` None: without a complete output)."""
        self._indexes.pop(seq_id, None)
