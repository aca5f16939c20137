"""The beam-search policy: which beams continue, which fork, which end (the core executes it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcore.device import array_module
from kvcore.request import Sequence
from kvcore.sampling import BeamHypothesis, BeamSearch
from kvcore.sampling.logits import log_softmax


@dataclass(frozen=True, slots=True)
class BeamMove:
    """One surviving beam of a step: extend live beam `parent` with `token_id`; `fork`: the
    parent already continues as an earlier move, so this one runs in a fork of it."""

    parent: int  # index into the live beams, in the order the policy knows them
    token_id: int
    fork: bool


@dataclass(frozen=True, slots=True)
class BeamDecision:
    moves: list[BeamMove]  # the next live beams, best first (empty when done)
    dropped: list[int]  # live beams no move extends: they end (their blocks are freed)
    results: list[BeamHypothesis] | None  # the finished hypotheses, best first, when done


class BeamPolicy:
    """One request's beam search over the core's generic operations (fork, append, finish).

    It waits until every live beam has its logits row of this step, then scores them with
    BeamSearch (= transformers' beam search)."""

    def __init__(self, search: BeamSearch) -> None:
        self.search = search
        self.rows: dict[str, Any] = {}  # live beam seq id -> its (V,) logits row (NumPy or CuPy)

    def ready(self, live: list[Sequence]) -> bool:
        """Every live beam has its row, and the K/V of every token (a preempted beam's row is
        stale until its recompute gives it again)."""
        return all(seq.seq_id in self.rows and seq.num_computed_tokens == seq.num_tokens
                   for seq in live)

    def decide(self, live_ids: list[str]) -> BeamDecision:
        # (L, V) on the logits' device: scored there, only the chosen candidates cross
        picked = [self.rows.pop(seq_id) for seq_id in live_ids]
        rows = array_module(picked[0]).stack(picked)
        step = self.search.step(log_softmax(rows))
        if step.done:
            return BeamDecision([], list(range(len(live_ids))), self.search.results())
        extended: set[int] = set()
        moves = []
        for cand in step.survivors:
            moves.append(BeamMove(cand.parent, cand.token_id, cand.parent in extended))
            extended.add(cand.parent)
        dropped = [i for i in range(len(live_ids)) if i not in extended]
        return BeamDecision(moves, dropped, None)
