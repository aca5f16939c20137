"""The engine core's speculation seam: drafts before a step is scheduled, acceptance after it ran.

A draft token is accepted exactly when it equals the token the sampler draws at its position
from the target model's logits there (the argmax of the processed logits, plus the
counter-based Gumbel noise of (seed, position, token) for a seeded row); the first mismatch
emits the drawn token itself, and a fully accepted draft emits the token drawn after it. So a
sequence's tokens (and their logprobs) are the ones it gets without speculation, greedy or
seeded: speculation changes how many forward passes they take, never what they are.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvcore.cache import PENDING_TOKEN_ID
from kvcore.config_speculative import SpeculativeConfig
from kvcore.request import Sequence as Seq
from kvcore.request import SequenceStatus
from kvcore.sampling import SamplingParams, SamplingRow, TokenLogprob
from kvcore.speculation.ngram import NgramProposer
from kvcore.speculation.suffix import SuffixProposer

EMA_WEIGHT = 0.5  # of the latest step in a sequence's accepted-tokens average
FIRST_EMA = 1.0  # a sequence's first drafts are 2 tokens long; they grow as they get accepted
MISSES_BEFORE_BACKOFF = 1  # steps in a row with no draft token accepted
FIRST_BACKOFF_STEPS = 4  # then no drafts for this many steps, doubled at every further miss
MAX_BACKOFF_STEPS = 64


class Proposer(Protocol):
    def propose(self, seq_id: str, token_ids: Sequence[int], salt: str | None,
                num_tokens: int) -> list[int]: ...

    def finish(self, seq_id: str, output_token_ids: Sequence[int] | None,
               salt: str | None) -> None: ...


@dataclass(slots=True)
class SpecDecodeStats:
    """vLLM's spec_decode counters (kvcore:spec_decode_*), over the engine's life."""

    num_drafts: int = 0  # sequence-steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # (k,) accepted at position i


class _State:
    """A sequence's adaptation: its accepted-tokens average and its backoff."""

    __slots__ = ("seq", "ema", "misses", "backoff", "resume_step")

    def __init__(self, seq: Seq) -> None:
        self.seq = seq
        self.ema = FIRST_EMA  # accepted draft tokens per verifying step, averaged
        self.misses = 0
        self.backoff = FIRST_BACKOFF_STEPS
        self.resume_step = 0  # no drafts before this step

    def num_draft(self, k: int) -> int:
        """One more than it has been accepting: a run of full acceptances grows it to k."""
        return max(1, min(k, math.ceil(self.ema) + 1))

    def update(self, num_accepted: int, step: int) -> None:
        self.ema = EMA_WEIGHT * num_accepted + (1 - EMA_WEIGHT) * self.ema
        if num_accepted:
            self.misses = 0
            self.backoff = FIRST_BACKOFF_STEPS
            return
        self.misses += 1
        if self.misses >= MISSES_BEFORE_BACKOFF:
            self.resume_step = step + self.backoff + 1
            self.backoff = min(2 * self.backoff, MAX_BACKOFF_STEPS)
            self.misses = 0
            self.ema = 0.0  # back with one draft token


class Speculator:
    """Proposes drafts for the sequences that may speculate and accepts them after the step."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer: Proposer = (
            NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            if config.method == "ngram" else
            SuffixProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                           config.suffix_max_tokens_per_tenant, config.suffix_max_tenants))
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self._states: dict[str, _State] = {}
        self._step = 0

    def active(self, num_running: int) -> bool:
        """A batch of this many running sequences speculates."""
        return num_running <= self.config.max_batch_for_speculation

    def propose(self, running: Sequence[Seq]) -> dict[str, list[int]]:
        """Drafts by sequence id for this step's decodes. Forks (n > 1), beams, constrained
        rows, sequences with a pending token, prefills and backed-off sequences get none."""
        self._step += 1
        self._forget_finished()
        if not running or not self.active(len(running)):
            return {}
        drafts: dict[str, list[int]] = {}
        for seq in running:
            params = seq.params
            token_ids = seq.token_ids
            if (not isinstance(params, SamplingParams) or params.n > 1
                    or params.constraint is not None  # its mask follows accepted tokens only
                    or len(token_ids) - seq.num_computed_tokens != 1
                    or token_ids[-1] == PENDING_TOKEN_ID):
                continue
            state = self._states.get(seq.seq_id)
            if state is None:
                state = self._states[seq.seq_id] = _State(seq)
            if state.resume_step > self._step:
                continue
            # every draft token is followed by one more drawn token: never past the limit
            room = seq.length_limit - len(token_ids) - 1
            num = min(state.num_draft(self.k), room)
            if num < 1:
                continue
            draft = self.proposer.propose(seq.seq_id, token_ids, seq.cache_salt, num)
            if draft:
                drafts[seq.seq_id] = draft
        return drafts

    def _forget_finished(self) -> None:
        done = [state for state in self._states.values() if state.seq.finished]
        for state in done:
            seq = state.seq
            complete = seq.status in (SequenceStatus.FINISHED_STOPPED,
                                      SequenceStatus.FINISHED_LENGTH)
            self.proposer.finish(seq.seq_id, seq.output_token_ids if complete else None,
                                 seq.cache_salt)
            del self._states[seq.seq_id]

    def accept(self, rows: Sequence[Seq], token_ids: Sequence[int],
               logprobs: Sequence[TokenLogprob | None], drafts: dict[str, list[int]]
               ) -> Iterator[tuple[Seq, int, TokenLogprob | None]]:
        """A step's drawn rows -> the tokens to append, in order. A sequence with a draft of k
        tokens has k + 1 consecutive rows (drawn after its last token, then after each draft
        token): it emits the drawn tokens up to and including the first that differs from its
        draft (all k + 1 when none does)."""
        i = 0
        num_rows = len(rows)
        while i < num_rows:
            seq = rows[i]
            draft = drafts.get(seq.seq_id)
            if draft is None:
                yield seq, token_ids[i], logprobs[i]
                i += 1
                continue
            k = len(draft)
            num_accepted = 0
            while num_accepted < k and token_ids[i + num_accepted] == draft[num_accepted]:
                num_accepted += 1
            self._record(seq, k, num_accepted)  # first: its outputs carry the counts
            for j in range(i, i + num_accepted + 1):
                yield seq, token_ids[j], logprobs[j]
            i += k + 1

    def _record(self, seq: Seq, num_draft: int, num_accepted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_draft
        stats.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            stats.accepted_per_pos[pos] += 1
        seq.num_draft_tokens += num_draft
        seq.num_accepted_tokens += num_accepted
        state = self._states.get(seq.seq_id)
        if state is not None:
            state.update(num_accepted, self._step)


def draft_rows(seq: Seq, draft: list[int], row: SamplingRow) -> list[SamplingRow]:
    """The sampling rows of a sequence verifying `draft`: `row` (its row after its last
    token), then one after each draft token, each with the history it has there (the output
    position, and the tokens when a processor reads them)."""
    rows = [row]
    if row.prompt_token_ids:  # a processor reads the history: the drafts join it
        output = list(row.output_token_ids)
        for j in range(len(draft)):
            rows.append(SamplingRow(row.params, row.prompt_token_ids,
                                    output + draft[:j + 1], row.seed))
    else:
        position = seq.num_output_tokens if row.position is None else row.position
        rows.extend(SamplingRow(row.params, (), (), row.seed, position + j + 1)
                    for j in range(len(draft)))
    return rows


def scheduled_drafts(out: Any) -> dict[str, list[int]]:
    """The drafts a SchedulerOutput kept (its budget and the pool may have cut or dropped
    some): by sequence id, the draft tokens each scheduled sequence verifies."""
    kept: dict[str, list[int]] = {}
    for item in out.scheduled:
        if item.num_draft_tokens:
            kept[item.seq_id] = list(item.token_ids[-item.num_draft_tokens:])
    return kept
