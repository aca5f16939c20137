"""The engine core's speculation seam: drafts before a step is scheduled, acceptance after it ran.

A draft token is accepted exactly when it equals the token the sampler draws at its position
from the target model's logits there (the argmax of the processed logits, plus the
counter-based Gumbel noise of (seed, position, token) for a seeded row); the first mismatch
emits the drawn token itself, and a fully accepted draft emits the token drawn after it. So a
sequence's tokens (and their logprobs) are the ones it gets without speculation, greedy or
seeded: speculation changes how many forward passes they take, never what they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvcore.cache import PENDING_TOKEN_ID
from kvcore.config_speculative import SpeculativeConfig
from kvcore.request import Sequence as Seq
from kvcore.request import SequenceStatus
from kvcore.sampling import SamplingRow, TokenLogprob
from kvcore.speculation.adapt import SeqState, StepCost
from kvcore.speculation.ngram import NgramProposer
from kvcore.speculation.suffix import SuffixProposer


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


class Speculator:
    """Proposes drafts for the sequences that may speculate and accepts them after the step."""

    def __init__(self, config: SpeculativeConfig,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.clock = clock
        self.cost = StepCost()
        self.k = config.num_speculative_tokens
        self.proposer: Proposer = (
            NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            if config.method == "ngram" else
            SuffixProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                           config.suffix_max_tokens_per_tenant, config.suffix_max_tenants))
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self._states: dict[str, SeqState] = {}
        self._step = 0

    def active(self, num_running: int) -> bool:
        """A batch of this many running sequences speculates."""
        return num_running <= self.config.max_batch_for_speculation

    def propose(self, running: Sequence[Seq], num_waiting: int = 0) -> dict[str, list[int]]:
        """Drafts by sequence id for this step's decodes (`num_waiting`: requests waiting for
        admission). Forks (n > 1), beams, constrained rows, sequences with a pending token,
        prefills, backed-off sequences and those whose drafts are not worth their rows (adapt.py)
        get none."""
        self._step += 1
        self._forget_finished()
        decoding = [seq for seq in running if len(seq.token_ids) - seq.num_computed_tokens == 1]
        clean = num_waiting == 0 and len(decoding) == len(running)
        if not running or not self.active(len(running)):
            self.cost.observe(self.clock(), len(running), 0, False)
            return {}
        threshold = self.cost.threshold(len(running))
        drafts: dict[str, list[int]] = {}
        for seq in decoding:
            params = seq.params
            token_ids = seq.token_ids
            if (seq.host_decides or params.num_seqs > 1
                    or params.constraint is not None  # its mask follows accepted tokens only
                    or token_ids[-1] == PENDING_TOKEN_ID):
                continue
            state = self._states.get(seq.seq_id)
            if state is None:
                state = self._states[seq.seq_id] = SeqState(seq)
            # every draft token is followed by one more drawn token: never past the limit
            room = seq.length_limit - len(token_ids) - 1
            if room < 1:
                continue
            num = min(state.num_draft(self.k, threshold, self._step), room)
            if num < 1:
                continue
            draft = self.proposer.propose(seq.seq_id, token_ids, seq.cache_salt, num)
            if draft:
                drafts[seq.seq_id] = draft
        self.cost.observe(self.clock(), len(running), sum(map(len, drafts.values())), clean)
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
            state.update(num_draft, num_accepted, self._step)


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

