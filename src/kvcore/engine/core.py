"""The engine core: schedule -> run -> sample -> update, over sequences only.

Token ids and parameters go in; each step gives plain records out (the tokens each sequence got,
finish statuses). Forking is one generic operation: an n > 1 request forks its choices when its
prompt's last chunk is launched, so every choice draws its first token in that step. Rows whose
tokens the host decides (a beam search's) go to one seam, `decide_host`, after their step. Text
is not the core's business: the output processor detokenizes, finds stop strings and ends
sequences through `finish`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import structlog

from kvcore.cache import PENDING_TOKEN_ID
from kvcore.device import array_module
from kvcore.engine.constrain import Constrainer
from kvcore.engine.draw import draw_rows, sampling_row
from kvcore.engine.records import Drawn, Launched, StepOutput
from kvcore.engine.runner import ModelRunner
from kvcore.request import Sequence, SequenceStatus
from kvcore.sampling import RowSampler, SamplingRow, TokenLogprob, make_seed
from kvcore.scheduler import Scheduler, SchedulerOutput
from kvcore.speculation import Speculator, draft_rows

log = structlog.get_logger(__name__)
# decides a step's host rows: (their sequences, their (H, V) logits rows, the step's output)
HostDecider = Callable[[list[Sequence], Any, StepOutput], None]


class EngineCore:
    """Owns the scheduler, the runner and the sampler; one `step()` at a time (`step_sync` or
    `step_async`, picked at construction)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: RowSampler,
                 vocab_size: int, seed: int = 0, async_scheduling: bool = False,
                 speculator: Speculator | None = None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        # chosen once: schedule step N+1 while the device runs step N (step_async), or not
        self.async_scheduling = async_scheduling
        self.step = self.step_async if async_scheduling else self.step_sync
        self.speculator = speculator  # drafts verified in the step (None: no speculation)
        self.decide_host: HostDecider | None = None  # the engine's beam searches
        self._seeds = np.random.SeedSequence(seed)
        self._live: dict[str, list[Sequence]] = {}  # request id -> its unfinished sequences
        self._inflight: Launched | None = None  # launched, not collected yet
        self.constrainer = Constrainer(vocab_size)  # structured outputs' token masks

    # --- sequences in and out ---

    def add(self, seq: Sequence) -> None:
        """Queue a request's first sequence (checked by Engine.check_request)."""
        if seq.seed is None and not seq.params.greedy:
            seq.seed = make_seed(seq.params.seed, self._seeds)
        self.scheduler.add(seq)
        self._live[seq.request_id] = [seq]

    def abort(self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_ABORTED,
              uncache: bool = False) -> bool:
        """End every sequence of a request now (blocks freed); False: no such request."""
        live = self._live.pop(request_id, None)
        for seq in live or ():
            if not seq.finished:
                self.scheduler.finish(seq, status, uncache)
        return live is not None

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End one sequence (a stop string, a dropped beam); its request ends with its last."""
        if seq.finished:
            return
        self.scheduler.finish(seq, status)
        live = self._live.get(seq.request_id)
        if live is not None:
            live.remove(seq)
            if not live:
                del self._live[seq.request_id]

    def fork(self, parent: Sequence, seq_id: str, index: int) -> Sequence:
        """The generic fork: a new sequence with the parent's tokens, its place in a constraint
        and every one of its blocks (shared by refcount; a shared, partially filled last block
        is copied when written). The scheduler sets its scheduling state."""
        child = dataclasses.replace(
            parent, seq_id=seq_id, index=index, token_ids=list(parent.token_ids),
            num_pending_forks=0, num_preemptions=0,
            matcher=None if parent.matcher is None else parent.matcher.fork())
        self.scheduler.add_running(child, parent)
        self._live[parent.request_id].append(child)
        return child

    # --- one step ---

    def step_sync(self) -> StepOutput:
        """One step: schedule -> execute -> sample -> update."""
        result = StepOutput()
        out = self._schedule()
        if out.scheduled:
            launched = self._launch(out)  # execute and sample (the device half)
            self._collect(launched, result)  # update: append, stop checks, host rows
        return result

    def step_async(self) -> StepOutput:
        """Async scheduling: schedule and launch step N+1 while the device runs N, then collect
        N (the caller processes N's outputs while N+1 runs). A sequence whose token N samples
        goes into N+1 with a pending token (PENDING_TOKEN_ID) that the device fills from N's
        sampled ids; a step with rows that need the host between steps (beams, drafts,
        history-reading samplers) is collected before the next one is scheduled."""
        result = StepOutput()
        prev, self._inflight = self._inflight, None
        if prev is not None and prev.needs_host:
            self._collect(prev, result)
            prev = None
        if prev is not None:
            # its plain rows need nothing from the host before their next token: their count
            # is known, their id not yet (never past max_tokens: a token that ends it gets none)
            for seq in prev.plain:
                if seq.status is SequenceStatus.RUNNING and len(seq.token_ids) + 1 < (
                        seq.length_limit):
                    seq.token_ids.append(PENDING_TOKEN_ID)
        out = self._schedule()
        launched = self._launch(out, prev) if out.scheduled else None
        if prev is not None and not self._collect(prev, result, launched):
            launched = None  # rolled back: computed on a step that failed
        self._inflight = launched
        return result

    def _schedule(self) -> SchedulerOutput:
        scheduler = self.scheduler
        return scheduler.schedule(None if self.speculator is None else self.speculator.propose(
            scheduler.running, len(scheduler.waiting)))

    def _launch(self, out: SchedulerOutput, prev: Launched | None = None) -> Launched:
        """Host half of a step: its sampling rows, then the runner's launch. num_computed_tokens
        catches up now: the device computes the step's K/V before any later step reads it."""
        seqs = self.scheduler.seqs
        plain: list[Sequence] = []  # drawn on the device, in row order
        plain_logits: list[int] = []  # their logits rows
        rows: list[SamplingRow] = []  # built now: the histories as they are
        host: list[Sequence] = []  # decided on the host after the step (beams)
        host_logits: list[int] = []
        drafts: dict[str, list[int]] = {}  # the draft tokens each speculating row verifies
        i = 0
        for item in out.scheduled:
            if not item.sample:
                continue
            seq = seqs[item.seq_id]
            k = item.num_draft_tokens
            if seq.host_decides:
                host.append(seq)
                host_logits.append(i)
            elif k:  # a row after its last token and after each draft token
                drafts[seq.seq_id] = draft = item.token_ids[-k:]
                rows.extend(draft_rows(seq, draft, sampling_row(seq)))
                plain.extend([seq] * (1 + k))
                plain_logits.extend(range(i, i + 1 + k))
            elif seq.num_pending_forks:  # n > 1: every choice's first token, from one row
                for choice in self._fork_choices(seq, len(item.token_ids)):
                    rows.append(sampling_row(choice))
                    plain.append(choice)
                    plain_logits.append(i)
            else:
                rows.append(sampling_row(seq))
                plain.append(seq)
                plain_logits.append(i)
            i += 1 + k
        # computed while the forward pass runs (after the pending tokens' step, if any)
        masks = self.constrainer.start(plain, prev)
        # collected before the next step is scheduled: a step with rows that the host decides,
        # drafts to verify or a sampler reading the history, and one after which the next may
        # draft (a sequence's number of new tokens is known only then)
        needs_host = bool(host or drafts) or any(r.prompt_token_ids for r in rows) or (
            self.speculator is not None and self.speculator.active(len(self.scheduler.running)))

        def sample(logits: Any) -> Drawn:
            host_rows = None
            if host:  # before the draw: the sampler may process the logits in place
                index = np.asarray(host_logits, dtype=np.int64)  # (H,)
                host_rows = logits[array_module(logits).asarray(index)]  # (H, V) a copy
            token_ids, read, failed = draw_rows(self.sampler, logits, plain_logits, plain,
                                                rows if masks is None else masks.apply(rows))
            return Drawn(token_ids, read, failed, host_rows)
        launched = Launched(out, plain, host, needs_host, drafts,
                            self.runner.launch(out, sample, prev))
        self.scheduler.advance(out)
        return launched

    def _fork_choices(self, parent: Sequence, num_new: int) -> list[Sequence]:
        """n > 1: the prompt is prefilled once; its n - 1 forks share its blocks, with the K/V
        this step computes (`num_new` tokens of the parent) counted as theirs."""
        forks = [parent]
        params = parent.params
        for index in range(1, parent.num_pending_forks + 1):
            child = self.fork(parent, f"{parent.request_id}#n{index}", index)
            child.num_computed_tokens += num_new
            if not params.greedy:
                child.seed = make_seed(None if params.seed is None else params.seed + index,
                                       self._seeds)
            forks.append(child)
        return forks

    def _collect(self, launched: Launched, result: StepOutput,
                 after: Launched | None = None) -> bool:
        """Wait for a launched step and apply it: append tokens, stop checks, host rows.
        `after`: the step launched after it, still on the device, rolled back when this one
        failed. False: it failed."""
        try:
            drawn = launched.future.result()
            token_ids, logprobs = drawn.read()  # waits for the device
        except Exception as e:
            if after is not None:
                self._roll_back(after, launched)
            self._fail_step(launched.out, e, result)
            return False
        self._fail_rows(launched.plain, drawn.failed, result)
        if launched.drafts:
            assert self.speculator is not None
            self._append(self.speculator.accept(launched.plain, token_ids, logprobs,
                                                launched.drafts), result)
            self.scheduler.settle_drafts(launched.drafts)
        else:
            self._append(zip(launched.plain, token_ids, logprobs, strict=True), result)
        host = launched.host
        live = [i for i, seq in enumerate(host)
                if not seq.finished and seq.request_id not in result.failed]
        if live:  # (else aborted, or failed)
            assert self.decide_host is not None, "host rows and nobody to decide them"
            logits = drawn.host_logits
            self.decide_host([host[i] for i in live],
                             logits if len(live) == len(host) else logits[live], result)
        return True

    def _roll_back(self, launched: Launched, failed: Launched) -> None:
        """`failed` (the step before `launched`) failed on the device: `launched` was computed
        on K/V it never wrote, and on tokens it never sampled. Its sequences of other requests
        (and the forks it made) are recomputed: back to waiting, their new blocks uncached (a
        draw depends only on the sequence's seed and output position: the same tokens again)."""
        launched.future.exception()  # wait: it ran (or failed); its results are dropped
        seqs = self.scheduler.seqs
        failing = {seqs[item.seq_id].request_id
                   for item in failed.out.scheduled if item.seq_id in seqs}
        others = {seq.seq_id: seq for seq in launched.plain + launched.host}
        others.update((item.seq_id, seqs[item.seq_id]) for item in launched.out.scheduled
                      if item.seq_id in seqs)
        for seq in others.values():
            if seq.status is SequenceStatus.RUNNING and seq.request_id not in failing:
                assert seq.token_ids[-1] != PENDING_TOKEN_ID
                self.scheduler.preempt(seq, uncache=True)

    def _append(self, drawn: Iterable[tuple[Sequence, int, TokenLogprob | None]],
                result: StepOutput) -> None:
        """Append the drawn tokens; a sequence's pending token is replaced by its id. Tokens
        of sequences that ended (or failed) while their step ran are dropped: the device
        computed one token more than needed, never a wrong one."""
        kv = self.scheduler.kv
        block_size = kv.block_size
        emitted = result.tokens
        for seq, token_id, logprob in drawn:
            if seq.finished or seq.request_id in result.failed:
                continue
            token_ids = seq.token_ids
            pending = token_ids[-1] == PENDING_TOKEN_ID
            if pending:
                token_ids.pop()
            status = seq.append_token(token_id)
            if (pending and status is None and len(token_ids) % block_size == 0
                    and seq.status is SequenceStatus.RUNNING):
                kv.cache_blocks(seq.seq_id, token_ids)  # its last block waited for the token
            emitted.append((seq, token_id, logprob, status))
            if status is not None:
                # frees its blocks now, while the step launched after this one may still write
                # its pending row into them: device work runs in launch order (a CUDA stream,
                # the fake device's one FIFO thread), so a later step given these blocks
                # writes them only after that
                self.finish(seq, status)

    # --- failures ---

    def fail(self, request_id: str, stage: str, error: BaseException, result: StepOutput,
             uncache: bool = False) -> None:
        """One request failed at `stage`: it ends (its blocks freed), the others go on."""
        log.error("request failed", request_id=request_id, stage=stage,
                  error=f"{type(error).__name__}: {error}")
        result.failed[request_id] = f"{stage} failed: {type(error).__name__}: {error}"
        self.abort(request_id, SequenceStatus.FINISHED_ERROR, uncache)

    def _fail_rows(self, rows: list[Sequence], failed: dict[int, BaseException],
                   result: StepOutput) -> None:
        """Rows whose draw failed: their requests fail (the other rows' tokens stand)."""
        for i, error in failed.items():
            seq = rows[i]
            if not seq.finished and seq.request_id not in result.failed:
                self.fail(seq.request_id, "sampling", error, result)

    def _fail_step(self, out: SchedulerOutput, error: BaseException, result: StepOutput) -> None:
        """The forward pass failed: its requests fail; their blocks leave the prefix cache too,
        since blocks hashed for this step may never have been written."""
        log.exception("forward pass failed", num_seqs=len(out.scheduled))
        for item in out.scheduled:
            seq = self.scheduler.seqs.get(item.seq_id)
            if seq is not None and seq.request_id not in result.failed:
                self.fail(seq.request_id, "forward pass", error, result, uncache=True)
