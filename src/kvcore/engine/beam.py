"""Beam search over the engine core's generic operations (fork, append, finish): the core hands
each step's beam rows to `BeamSearches.decide` (its `decide_host` seam) and keeps no beam code."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from kvcore.device import array_module
from kvcore.engine.constrain import append_beam_token
from kvcore.engine.core import EngineCore
from kvcore.engine.records import StepOutput
from kvcore.request import Sequence, SequenceStatus
from kvcore.sampling import BeamHypothesis, BeamSearch, BeamSearchParams
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
    """One request's beam search: which beams continue, which fork, which end.

    It waits until every live beam has its logits row of this step, then scores them with
    BeamSearch (= transformers' beam search)."""

    def __init__(self, search: BeamSearch, live: list[Sequence] | None = None) -> None:
        self.search = search
        self.live: list[Sequence] = live or []  # the live beams, in the search's order
        self.rows: dict[str, Any] = {}  # live beam seq id -> its (V,) logits row (NumPy or CuPy)
        self.num_forks = 0

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


class BeamSearches:
    """The engine's running beam searches: the core's host rows come here after their step."""

    def __init__(self, core: EngineCore, eos_token_ids: Collection[int]) -> None:
        self.core = core
        self.eos_token_ids = tuple(eos_token_ids)
        self._policies: dict[str, BeamPolicy] = {}
        core.decide_host = self.decide

    def add(self, seq: Sequence) -> None:
        """A beam search's first sequence (before the core queues it)."""
        assert isinstance(seq.params, BeamSearchParams)
        search = BeamSearch(seq.params, self.eos_token_ids, seq.max_tokens)
        self._policies[seq.request_id] = BeamPolicy(search, [seq])

    def forget(self, request_id: str) -> list[list[int]] | None:
        """Drop a request's search; its live beams' output token ids, in the search's order
        (None: no beam search of that id)."""
        policy = self._policies.pop(request_id, None)
        return None if policy is None else [seq.output_token_ids for seq in policy.live]

    def decide(self, seqs: list[Sequence], logits: Any, result: StepOutput) -> None:
        """A step's beam rows, (H, V) `logits`: each search decides once all its beams have
        theirs."""
        # the policy ranks a constrained beam's allowed tokens only
        self.core.constrainer.mask_logits(seqs, logits, list(range(len(seqs))))
        touched: dict[str, BeamPolicy] = {}
        for i, seq in enumerate(seqs):
            policy = touched[seq.request_id] = self._policies[seq.request_id]
            policy.rows[seq.seq_id] = logits[i]
        for request_id, policy in touched.items():
            if policy.ready(policy.live):
                self._step(request_id, policy, result)

    def _step(self, request_id: str, policy: BeamPolicy, result: StepOutput) -> None:
        core = self.core
        live = policy.live
        try:
            decision = policy.decide([seq.seq_id for seq in live])
        except Exception as e:
            del self._policies[request_id]
            core.fail(request_id, "beam search", e, result)
            return
        if decision.results is not None:
            for seq in live:
                core.finish(seq, SequenceStatus.FINISHED_STOPPED)
            del self._policies[request_id]
            result.beams[request_id] = decision.results
            return
        # fork before any token is appended, so a child copies its parent's tokens as they were
        next_live: list[tuple[Sequence, int]] = []
        for move in decision.moves:
            parent = live[move.parent]
            if move.fork:
                policy.num_forks += 1
                parent = core.fork(parent, f"{request_id}#b{policy.num_forks}",
                                   policy.num_forks)
            next_live.append((parent, move.token_id))
        for i in decision.dropped:
            core.finish(live[i], SequenceStatus.FINISHED_STOPPED)  # dropped: blocks freed
        for seq, token_id in next_live:
            append_beam_token(seq, token_id)  # the policy decides when beams end
        policy.live = [seq for seq, _ in next_live]
