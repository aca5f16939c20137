"""Token-budget continuous batching: chunked prefill, priorities, preemption by recompute."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import structlog

from kvcore.cache import Admission, CopyOp, KVCacheManager
from kvcore.config import ParamError
from kvcore.request import Request, RequestStatus

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What one step computes; plain data for the runner (it looks requests up by id)."""

    # (request_id, num_scheduled_tokens) in batch order; a request's tokens are
    # all_token_ids[num_computed_tokens : num_computed_tokens + num_scheduled_tokens]
    scheduled: tuple[tuple[str, int], ...]
    copy_ops: tuple[CopyOp, ...]  # copy-on-write block copies, run before the forward pass
    preempted_ids: tuple[str, ...]  # sent back to waiting this step (their K/V is gone)
    finished_ids: tuple[str, ...]  # finished (or aborted) since the previous schedule()
    num_batched_tokens: int


class Scheduler:
    """Every request's `num_computed_tokens` catches up with its tokens, under a token budget.

    Order within a step: running requests with one token to compute (decodes) in least recently
    served order, then running requests still prefilling (their chunk is what budget remains),
    then waiting requests FCFS within priority (lower number first). When the pool runs out of
    blocks the running request with the largest (priority, arrival) is preempted: its blocks are
    freed, its num_computed_tokens reset, and it goes back to the front of its priority level
    in the waiting queue (its earlier arrival puts it ahead of the later ones).
    """

    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int) -> None:
        for name, value in (("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.running: list[Request] = []
        self.waiting: list[Request] = []  # sorted by (priority, arrival_seq)
        self.num_preemptions = 0
        # forks still to come of running requests (n > 1 before its fork, a beam search's first
        # beam): they count toward max_num_seqs from admission on, so forks never exceed it
        self.num_pending_forks = 0
        self._finished_ids: list[str] = []
        self._arrivals = 0
        self._step = 0

    # --- requests in and out ---

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError when it can never run (it is then not queued)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        worst = request.num_tokens + request.max_tokens - request.num_output_tokens
        if worst > self.max_model_len:
            raise ParamError("max_tokens", f"request {request.request_id!r} needs {worst} tokens "
                             f"(prompt + max_tokens), more than max_model_len={self.max_model_len}")
        if request.num_seqs > self.max_num_seqs:
            raise ParamError("n", f"request {request.request_id!r} runs {request.num_seqs} "
                             f"sequences at once, more than max_num_seqs={self.max_num_seqs}")
        if self.kv.admission(worst) is Admission.NEVER:
            raise ParamError("max_tokens", f"request {request.request_id!r} needs {worst} tokens "
                             f"of KV cache, "
                             f"more than the whole pool ({self.kv.num_blocks} blocks of "
                             f"{self.kv.block_size})")
        self._arrivals += 1
        request.arrival_seq = self._arrivals
        self._enqueue(request)
        self.requests[request.request_id] = request

    def add_running(self, request: Request, parent: Request) -> None:
        """A fork of a running request (n > 1, beams): shares every block of `parent`."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.kv.fork(parent.request_id, request.request_id)
        if parent.num_pending_forks > 0:
            parent.num_pending_forks -= 1
            self.num_pending_forks -= 1
        request.arrival_seq = parent.arrival_seq
        request.num_computed_tokens = parent.num_computed_tokens
        request.status = RequestStatus.RUNNING
        request.last_scheduled_step = parent.last_scheduled_step
        self.running.append(request)
        self.requests[request.request_id] = request

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request as aborted and free its blocks now; unknown id: None."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request: Request, status: RequestStatus, uncache: bool = False) -> None:
        """End a request and free its blocks (`uncache`: see KVCacheManager.free)."""
        assert status.finished
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.num_pending_forks -= request.num_pending_forks
            self.kv.free(request.request_id, uncache)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = status
        request.metrics.finished_time = time.monotonic()
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- one step ---

    def schedule(self, budget: int | None = None) -> SchedulerOutput:
        """Pick this step's tokens; `budget` overrides max_num_batched_tokens for one step."""
        self._step += 1
        step = self._step
        budget = self.max_num_batched_tokens if budget is None else budget
        kv = self.kv
        scheduled: dict[str, int] = {}
        ops: dict[str, list[CopyOp]] = {}
        preempted: list[str] = []
        prefilling: list[Request] = []
        running_status = RequestStatus.RUNNING
        allocate = kv.allocate_slots
        # pass 1: decodes (one token to compute), least recently served first
        for request in list(self.running):
            if request.status is not running_status:
                continue  # preempted earlier in this step
            num_new = len(request.all_token_ids) - request.num_computed_tokens
            if num_new != 1:
                if num_new > 1:
                    prefilling.append(request)
                continue  # 0: a beam waiting for its siblings' rows
            if budget <= 0:
                continue
            copies = allocate(request.request_id, request.all_token_ids, 1)
            if copies is None:
                copies, refund = self._make_room(request, 1, scheduled, ops, preempted)
                budget += refund
                if copies is None:
                    continue
            scheduled[request.request_id] = 1
            if copies:
                ops[request.request_id] = copies
            request.last_scheduled_step = step
            budget -= 1
        # pass 2: running prompts (chunked prefill, or recompute) get what budget is left
        for request in prefilling:
            if request.status is not running_status or budget <= 0:
                continue
            num_new = min(len(request.all_token_ids) - request.num_computed_tokens, budget)
            copies = allocate(request.request_id, request.all_token_ids, num_new)
            if copies is None:
                copies, refund = self._make_room(request, num_new, scheduled, ops, preempted)
                budget += refund
                if copies is None:
                    continue
            scheduled[request.request_id] = num_new
            if copies:
                ops[request.request_id] = copies
            request.last_scheduled_step = step
            budget -= num_new
        if len(scheduled) < len(self.running):
            # least recently served first next time, so a small budget rotates over everyone
            self.running.sort(key=_served_key)
        if not preempted:
            self._admit(scheduled, ops, budget, step)
        while not scheduled and self.waiting and self.running:
            # nothing could run: the running sequences wait for siblings (beams) that wait for
            # blocks. Free the least important one if it ranks below the head of the queue.
            victim = max(self.running, key=_victim_key)
            if _queue_key(victim) < _queue_key(self.waiting[0]):
                break
            self._preempt(victim)
            preempted.append(victim.request_id)
            self._admit(scheduled, ops, budget, step)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=tuple(scheduled.items()),
            copy_ops=tuple(op for copies in ops.values() for op in copies),
            preempted_ids=tuple(preempted),
            finished_ids=tuple(finished),
            num_batched_tokens=sum(scheduled.values()),
        )

    def _make_room(self, request: Request, num_new: int, scheduled: dict[str, int],
                   ops: dict[str, list[CopyOp]], preempted: list[str]
                   ) -> tuple[list[CopyOp] | None, int]:
        """Preempt victims (largest (priority, arrival) first) until `request` gets its slots;
        returns (its copy ops, or None if it was the victim itself; budget given back)."""
        refund = 0
        while True:
            victim = max(self.running, key=_victim_key)
            refund += scheduled.pop(victim.request_id, 0)
            ops.pop(victim.request_id, None)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return None, refund
            copies = self.kv.allocate_slots(request.request_id, request.all_token_ids, num_new)
            if copies is not None:
                return copies, refund

    def _admit(self, scheduled: dict[str, int], ops: dict[str, list[CopyOp]], budget: int,
               step: int) -> None:
        kv = self.kv
        waiting = self.waiting
        while waiting and budget > 0:
            request = waiting[0]
            if (len(self.running) + self.num_pending_forks + 1 + request.num_pending_forks
                    > self.max_num_seqs):
                break
            num_cached = kv.allocate_prefix(request.request_id, request.all_token_ids,
                                            request.cache_salt)
            assert num_cached < request.num_tokens, "the last token is always recomputed"
            num_new = min(request.num_tokens - num_cached, budget)
            copies = kv.allocate_slots(request.request_id, request.all_token_ids, num_new)
            if copies is None:
                kv.free(request.request_id)  # FCFS: nobody overtakes the head of the queue
                break
            del waiting[0]
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.monotonic()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            request.last_scheduled_step = step
            self.running.append(request)
            self.num_pending_forks += request.num_pending_forks
            scheduled[request.request_id] = num_new
            if copies:
                ops[request.request_id] = copies
            budget -= num_new

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.num_pending_forks -= request.num_pending_forks
        self.kv.free(request.request_id)
        num_computed = request.num_computed_tokens
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)
        log.info("preempted", request_id=request.request_id, priority=request.priority,
                 num_computed_tokens=num_computed, num_tokens=request.num_tokens,
                 num_free_blocks=self.kv.num_free_blocks)

    def _enqueue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=_queue_key)

    def update(self, output: SchedulerOutput,
               sampled: Mapping[str, int | Iterable[int]] | None = None) -> list[Request]:
        """After the forward pass: advance() then append_tokens(sampled)."""
        self.advance(output)
        return self.append_tokens(sampled or {})

    def advance(self, output: SchedulerOutput) -> None:
        """The scheduled tokens now have K/V in the cache: num_computed_tokens catches up."""
        requests = self.requests
        kv = self.kv
        window = kv.sliding_window is not None
        for request_id, num_tokens in output.scheduled:
            request = requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += num_tokens
            if window:
                kv.release_outside_window(request_id, request.num_computed_tokens)

    def append_tokens(self, sampled: Mapping[str, int | Iterable[int]]) -> list[Request]:
        """Append sampled tokens (request_id -> token id(s)), run the stop checks and free the
        requests that finished. Returns the requests that got a token, finished ones included."""
        requests = self.requests
        progressed: list[Request] = []
        now = time.monotonic()
        running_status = RequestStatus.RUNNING
        for request_id, token_ids in sampled.items():
            request = requests.get(request_id)
            if request is None or request.status is not running_status:
                continue
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            if type(token_ids) is int:
                status = request.append_token(token_ids)
                if status is not None:
                    self.finish(request, status)
            else:
                for token_id in token_ids:  # type: ignore[union-attr]
                    status = request.append_token(token_id)
                    if status is not None:
                        self.finish(request, status)
                        break
            progressed.append(request)
        return progressed


def _victim_key(request: Request) -> tuple[int, int, int]:
    # forks (n > 1, beams) share their parent's arrival: the later choice goes first
    return request.priority, request.arrival_seq, request.index


_queue_key = _victim_key  # the waiting queue's order is the reverse of the victims'


def _served_key(request: Request) -> int:
    return request.last_scheduled_step
