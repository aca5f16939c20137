"""Suffix decoding (arXiv 2411.04975), bounded: a sequence drafts from the longest match of its
last tokens in its own prompt and output, or in the recent outputs of its tenant (requests with
the same cache salt: never another tenant's), whichever match is longer."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from kvcore.speculation.ngram import NgramIndex, continuation

MIN_SHARE = 0.3  # a tenant draft stops at a token that followed its context less often
# and at a token seen once after a context shorter than MIN_MATCH (a two-token context such as
# ", the" is followed by anything in open chat: measured 0.19 acceptance, docs/benchmarks.md)
MIN_MATCH = 3
MIN_COUNT = 2


class TenantIndex:
    """Counts of the tokens that followed every context (low..high tokens) in a tenant's most
    recent outputs; the oldest output leaves it once they hold more than max_tokens tokens."""

    def __init__(self, low: int, high: int, max_tokens: int) -> None:
        self.low = low
        self.high = high
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.outputs: deque[tuple[int, ...]] = deque()
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, token_ids: Sequence[int]) -> None:
        tokens = tuple(token_ids[-self.max_tokens:])
        self.outputs.append(tokens)
        self.num_tokens += len(tokens)
        self._count(tokens, 1)
        while self.num_tokens > self.max_tokens:
            old = self.outputs.popleft()
            self.num_tokens -= len(old)
            self._count(old, -1)

    def _count(self, tokens: tuple[int, ...], delta: int) -> None:
        counts = self.counts
        for end in range(self.low, len(tokens)):
            nxt = tokens[end]
            for n in range(self.low, min(self.high, end) + 1):
                key = tokens[end - n:end]
                followers = counts.setdefault(key, {})
                left = followers.get(nxt, 0) + delta
                if left:
                    followers[nxt] = left
                else:
                    del followers[nxt]
                    if not followers:
                        del counts[key]

    def draft(self, token_ids: Sequence[int], num_tokens: int) -> tuple[int, list[int]]:
        """(length of the first match, draft): each token the most frequent follower of the
        longest indexed context of (tokens + draft so far), while it is frequent enough (its
        share of the followers, and a long context or a repeated follower)."""
        context = list(token_ids[-self.high:])
        draft: list[int] = []
        first = 0
        while len(draft) < num_tokens:
            for n in range(min(self.high, len(context)), self.low - 1, -1):
                followers = self.counts.get(tuple(context[-n:]))
                if followers:
                    break
            else:
                break
            # most frequent, then the lowest id: the same draft on every run
            token, count = min(followers.items(), key=lambda kv: (-kv[1], kv[0]))
            if count < MIN_SHARE * sum(followers.values()) or (n < MIN_MATCH
                                                                and count < MIN_COUNT):
                break
            first = first or n
            draft.append(token)
            context.append(token)
        return first, draft


class SuffixProposer:
    """Per sequence an n-gram index of its own tokens; per tenant (cache salt) a TenantIndex of
    its finished outputs, at most max_tenants of them (the least recently used one goes)."""

    def __init__(self, low: int, high: int, max_tokens_per_tenant: int,
                 max_tenants: int) -> None:
        self.low = low
        self.high = high
        self.max_tokens_per_tenant = max_tokens_per_tenant
        self.max_tenants = max_tenants
        self._own: dict[str, NgramIndex] = {}
        self.tenants: OrderedDict[str | None, TenantIndex] = OrderedDict()

    def propose(self, seq_id: str, token_ids: Sequence[int], salt: str | None,
                num_tokens: int) -> list[int]:
        index = self._own.get(seq_id)
        if index is None:
            index = self._own[seq_id] = NgramIndex(self.low, self.high)
        n, p = index.match(token_ids)
        tenant = self.tenants.get(salt)
        if tenant is not None:
            self.tenants.move_to_end(salt)
            first, draft = tenant.draft(token_ids, num_tokens)
            if first > n:
                return draft
        return continuation(token_ids, p, num_tokens) if n else []

    def finish(self, seq_id: str, output_token_ids: Sequence[int] | None,
               salt: str | None) -> None:
        """The sequence ended; a complete output joins its tenant's index."""
        self._own.pop(seq_id, None)
        if not output_token_ids:
            return
        tenant = self.tenants.get(salt)
        if tenant is None:
            tenant = self.tenants[salt] = TenantIndex(self.low, self.high,
                                                      self.max_tokens_per_tenant)
            while len(self.tenants) > self.max_tenants:
                self.tenants.popitem(last=False)
        self.tenants.move_to_end(salt)
        tenant.add(output_token_ids)
