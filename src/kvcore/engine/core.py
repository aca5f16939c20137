"""The engine core: schedule -> run -> sample -> update, over sequences only.

Token ids and parameters go in; each step gives plain records out (new token ids, logprobs,
finish reasons). Forking (n > 1 choices, beams) is one generic operation; beam search decides
what to fork, append and end through its policy object. Text is not the core's business: the
output processor detokenizes, finds stop strings and aborts sequences through `finish_seq`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from kvcore.device import array_module, to_numpy
from kvcore.engine.beam import BeamPolicy
from kvcore.engine.runner import ModelRunner
from kvcore.request import Sequence, SequenceStatus
from kvcore.sampling import (
    BeamHypothesis,
    RowSampler,
    SamplingParams,
    SamplingRow,
    TokenLogprob,
    make_seed,
)
from kvcore.scheduler import Scheduler, SchedulerOutput

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class SeqOutput:
    """What one sequence got in one step."""

    seq_id: str
    request_id: str
    index: int  # choice index within its request
    token_ids: list[int]  # new this step
    logprobs: list[TokenLogprob] | None  # of those tokens, when the request asked for them
    finish_reason: str | None  # set when the core ended the sequence (stop id, length)
    stop_reason: int | None
    num_cached_tokens: int  # prompt tokens its first admission found in the prefix cache
    first_scheduled_time: float | None


@dataclass(slots=True)
class StepOutput:
    seqs: list[SeqOutput] = field(default_factory=list)
    beams: dict[str, list[BeamHypothesis]] = field(default_factory=dict)  # done: best first
    failed: dict[str, str] = field(default_factory=dict)  # request_id -> why it failed


class _Group:
    """The live sequences of one user request, as the core knows them."""

    __slots__ = ("request_id", "seqs", "policy", "num_forks")

    def __init__(self, first: Sequence, policy: BeamPolicy | None) -> None:
        self.request_id = first.request_id
        self.seqs: list[Sequence] = [first]  # unfinished; beams in the policy's order
        self.policy = policy
        self.num_forks = 0


class EngineCore:
    """Owns the scheduler, the runner and the sampler; one `step()` at a time."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: RowSampler,
                 vocab_size: int, seed: int = 0) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.vocab_size = vocab_size
        self._seeds = np.random.SeedSequence(seed)
        self._groups: dict[str, _Group] = {}

    # --- sequences in and out ---

    def add(self, seq: Sequence, policy: BeamPolicy | None = None) -> None:
        """Queue a request's first sequence (ParamError from admission: nothing queued)."""
        if seq.seed is None and isinstance(seq.params, SamplingParams) and (
                not seq.params.greedy):
            seq.seed = make_seed(seq.params.seed, self._seeds)
        self.scheduler.add(seq)
        self._groups[seq.request_id] = _Group(seq, policy)

    def abort(self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_ABORTED,
              uncache: bool = False) -> list[list[int]] | None:
        """End every sequence of a request now (blocks freed). Returns the output token ids of
        the sequences it still had (a beam search's live beams, in order); None: unknown id."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for seq in group.seqs:
            if seq.seq_id in self.scheduler.seqs:
                self.scheduler.finish(seq, status, uncache)
        return [seq.output_token_ids for seq in group.seqs]

    def finish_seq(self, seq_id: str, status: SequenceStatus) -> None:
        """End one sequence (the output processor found its stop string)."""
        seq = self.scheduler.seqs.get(seq_id)
        if seq is None:
            return
        self.scheduler.finish(seq, status)
        group = self._groups.get(seq.request_id)
        if group is not None:
            group.seqs.remove(seq)
            if not group.seqs and group.policy is None:
                del self._groups[seq.request_id]

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    # --- one step ---

    def step(self) -> StepOutput:
        result = StepOutput()
        out = self.scheduler.schedule()
        for seq_id in out.preempted_ids:  # a preempted beam recomputes its row
            seq = self.scheduler.seqs[seq_id]
            group = self._groups.get(seq.request_id)
            if group is not None and group.policy is not None:
                group.policy.rows.pop(seq_id, None)
        if not out.scheduled:
            return result
        try:
            logits, sampling = self.runner.execute(out)
        except Exception as e:
            self._fail_step(out, e, result)
            return result
        self.scheduler.advance(out)
        seqs = self.scheduler.seqs
        rows: list[Sequence] = []
        row_logits: list[int] = []
        beams: dict[str, _Group] = {}
        for i, seq_id in enumerate(sampling):
            seq = seqs[seq_id]
            group = self._groups[seq.request_id]
            if group.policy is not None:
                group.policy.rows[seq_id] = logits[i]
                beams[group.request_id] = group
            elif seq.num_pending_forks:
                forks = self._fork_choices(group, seq)
                rows.extend(forks)
                row_logits.extend([i] * len(forks))
            else:
                rows.append(seq)
                row_logits.append(i)
        if rows:
            self._sample(logits, row_logits, rows, result)
        for group in beams.values():
            self._step_beams(group, result)
        return result

    def _fork_choices(self, group: _Group, parent: Sequence) -> list[Sequence]:
        """n > 1: the prompt was prefilled once; n - 1 forks share its blocks."""
        params = parent.params
        assert isinstance(params, SamplingParams)
        forks = [parent]
        for index in range(1, parent.num_pending_forks + 1):
            seed = None if params.seed is None else params.seed + index
            child = self._fork(parent, f"{parent.request_id}#n{index}", index)
            if not params.greedy:
                child.seed = make_seed(seed, self._seeds)
            group.seqs.append(child)
            forks.append(child)
        return forks

    def _fork(self, parent: Sequence, seq_id: str, index: int) -> Sequence:
        """The generic fork: a new sequence with the parent's tokens and every one of its blocks
        (shared by refcount; a shared, partially filled last block is copied when written)."""
        child = Sequence(seq_id=seq_id, request_id=parent.request_id,
                         prompt_token_ids=parent.prompt_token_ids, params=parent.params,
                         max_tokens=parent.max_tokens, index=index, priority=parent.priority,
                         cache_salt=parent.cache_salt, arrival_time=parent.arrival_time,
                         stop_token_ids=parent.stop_token_ids,
                         eos_token_ids=parent.eos_token_ids, token_ids=list(parent.token_ids))
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        self.scheduler.add_running(child, parent)
        return child

    def _sample(self, logits: Any, row_logits: list[int], rows: list[Sequence],
                result: StepOutput) -> None:
        """Draw every row's token and append it. A failure of one request (its processors, its
        draw, its stop check) fails that request alone: the batch is redrawn row by row (a
        row's draw depends only on its seed and output position: the same tokens)."""
        try:
            drawn = self._draw(logits, row_logits, rows)
        except Exception:
            drawn = []
            for i, seq in enumerate(rows):
                if seq.request_id in result.failed:
                    continue
                try:
                    drawn.extend(self._draw(logits, row_logits[i:i + 1], [seq]))
                except Exception as e:
                    self._fail(seq.request_id, "sampling", e, result)
        finish = self.scheduler.finish
        for seq, token_id, logprob in drawn:
            if seq.request_id in result.failed:
                continue
            status = seq.append_token(token_id)
            result.seqs.append(SeqOutput(
                seq.seq_id, seq.request_id, seq.index, [token_id],
                None if logprob is None else [logprob],
                None if status is None else status.finish_reason,
                None if status is None else seq.stop_reason,  # type: ignore[arg-type]
                seq.num_cached_tokens, seq.first_scheduled_time))
            if status is not None:
                finish(seq, status)
                group = self._groups[seq.request_id]
                group.seqs.remove(seq)
                if not group.seqs:
                    del self._groups[seq.request_id]

    def _draw(self, logits: Any, row_logits: list[int], rows: list[Sequence]
              ) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """`logits` (L, V) on the model's device (NumPy or CuPy): only token ids and the asked
        logprobs come back to the host."""
        if logits.ndim == 1:  # the model sampled on its own device: (L,) greedy token ids
            for seq in rows:
                params = seq.params
                assert isinstance(params, SamplingParams)
                if not params.greedy or params.logprobs is not None:
                    raise ValueError("this model returns token ids: only greedy sampling "
                                     "without logprobs")
            ids = to_numpy(logits).tolist()
            return [(seq, ids[i], None) for seq, i in zip(rows, row_logits, strict=True)]
        sampling_rows = [_sampling_row(seq) for seq in rows]
        if len(row_logits) == logits.shape[0] and row_logits == list(range(len(row_logits))) \
                and all(_reads_only(r) for r in sampling_rows):
            batch = logits  # argmax only: no processor writes to the logits, no copy
        else:
            index = np.asarray(row_logits, dtype=np.int64)  # (B,)
            # (B, V) a copy on the device: the processors write in place
            batch = logits[array_module(logits).asarray(index)]
        out = self.sampler(batch, sampling_rows)
        return list(zip(rows, out.token_ids.tolist(), out.logprobs, strict=True))

    def _step_beams(self, group: _Group, result: StepOutput) -> None:
        policy = group.policy
        assert policy is not None
        live = group.seqs
        if group.request_id in result.failed or not policy.ready([s.seq_id for s in live]):
            return
        try:
            decision = policy.decide([s.seq_id for s in live])
        except Exception as e:
            self._fail(group.request_id, "beam search", e, result)
            return
        finish = self.scheduler.finish
        if decision.results is not None:
            for seq in live:
                finish(seq, SequenceStatus.FINISHED_STOPPED)
            del self._groups[group.request_id]
            result.beams[group.request_id] = decision.results
            return
        # fork before any token is appended, so a child copies its parent's tokens as they were
        next_live: list[tuple[Sequence, int]] = []
        for move in decision.moves:
            parent = live[move.parent]
            if move.fork:
                group.num_forks += 1
                child = self._fork(parent, f"{group.request_id}#b{group.num_forks}",
                                   group.num_forks)
                next_live.append((child, move.token_id))
            else:
                next_live.append((parent, move.token_id))
        for i in decision.dropped:
            finish(live[i], SequenceStatus.FINISHED_STOPPED)  # dropped: blocks freed
        for seq, token_id in next_live:
            seq.token_ids.append(token_id)  # the policy decides when beams end
        group.seqs = [seq for seq, _ in next_live]

    # --- failures ---

    def _fail(self, request_id: str, stage: str, error: BaseException, result: StepOutput,
              uncache: bool = False) -> None:
        log.error("request failed", request_id=request_id, stage=stage,
                  error=f"{type(error).__name__}: {error}")
        result.failed[request_id] = f"{stage} failed: {type(error).__name__}: {error}"
        self.abort(request_id, SequenceStatus.FINISHED_ERROR, uncache)

    def _fail_step(self, out: SchedulerOutput, error: BaseException, result: StepOutput) -> None:
        """The forward pass failed: its requests fail; their blocks leave the prefix cache too,
        since blocks hashed for this step may never have been written."""
        log.exception("forward pass failed", num_seqs=len(out.scheduled))
        for item in out.scheduled:
            seq = self.scheduler.seqs.get(item.seq_id)
            if seq is not None and seq.request_id not in result.failed:
                self._fail(seq.request_id, "forward pass", error, result, uncache=True)


def _sampling_row(seq: Sequence) -> SamplingRow:
    params = seq.params
    assert isinstance(params, SamplingParams)
    if (params.min_tokens == 0 and params.repetition_penalty == 1.0
            and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0):
        # no processor reads the history: the draw needs only the output position
        return SamplingRow(params, None, (), (), seq.seed, seq.num_output_tokens)
    num_prompt = seq.num_prompt_tokens
    return SamplingRow(params, None, seq.token_ids[:num_prompt], seq.token_ids[num_prompt:],
                       seq.seed)


def _reads_only(row: SamplingRow) -> bool:
    """A greedy row with no processor: the sampler only takes its argmax (and raw logprobs)."""
    p = row.params
    return (p.greedy and not p.logit_bias and p.min_tokens == 0
            and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0)
