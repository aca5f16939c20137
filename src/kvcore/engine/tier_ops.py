"""The tier driver's two small parts: a step's tier operations in schedule order, and the
fitted cost of recomputing a prompt token (what a load must beat)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcore.cache import BlockHash
from kvcore.cache.tiers import PageKey

SAVE, LOAD = 0, 1
COST_WEIGHT = 0.05  # of the newest step in the step-cost fit (exponential forgetting)


@dataclass(slots=True)
class StepOps:
    """The step's tier operations in schedule order: (SAVE, block ids, keys), consecutive
    saves merged into one gather, and (LOAD, block ids, pages), one scatter each."""

    items: list[tuple[int, list[int], Any]] = field(default_factory=list)
    saved: set[BlockHash] = field(default_factory=set)  # a page is saved once a step

    def save(self, block_id: int, key: PageKey) -> None:
        if key[0] in self.saved:
            return
        self.saved.add(key[0])
        if not self.items or self.items[-1][0] != SAVE:
            self.items.append((SAVE, [], []))
        self.items[-1][1].append(block_id)
        self.items[-1][2].append(key)

    def load(self, block_ids: list[int], pages: Any) -> None:
        self.items.append((LOAD, block_ids, pages))


class PrefillCost:
    """Seconds per step = fixed + per_token x tokens, fitted by least squares over recent steps
    (exponentially weighted): per_token is what recomputing one more prompt token costs, the
    fixed part (sampling, scheduling, launch) being paid by the step anyway."""

    def __init__(self, weight: float = COST_WEIGHT) -> None:
        self.weight = weight
        self._sums = [0.0] * 5  # weight, x, y, x * x, x * y

    def observe(self, tokens: int, seconds: float) -> None:
        keep, w = 1.0 - self.weight, self.weight
        x, y = float(tokens), seconds
        self._sums = [keep * a + w * b for a, b in zip(self._sums, (1.0, x, y, x * x, x * y),
                                                      strict=True)]

    @property
    def per_token(self) -> float | None:
        """Seconds per token, None until steps of different sizes were seen."""
        n, x, y, xx, xy = self._sums
        if n <= 0:
            return None
        var = xx / n - (x / n) ** 2
        if var < 1.0:  # every step the same size: no slope to see
            return None
        slope = (xy / n - (x / n) * (y / n)) / var
        return slope if slope > 0 else None
