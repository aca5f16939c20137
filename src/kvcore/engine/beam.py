"""In-engine beam search over copy-on-write blocks: each beam is a sequence in the KV manager."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvcore.engine.group import RequestGroup
from kvcore.request import CompletionOutput, Request, RequestStatus
from kvcore.sampling import BeamSearchParams
from kvcore.sampling.logits import log_softmax
from kvcore.scheduler import Scheduler


def beam_step(group: RequestGroup, scheduler: Scheduler,
              decode: Callable[[list[int]], str]) -> bool:
    """Advance the search once every live beam has its logits row; returns True if it stepped.

    Surviving candidates that extend the same beam fork it (the child shares every block by
    refcount; only a shared, partially filled last block is copied when written); beams no
    candidate extends are freed. A beam that was preempted recomputes first: the others wait
    with their rows in `group.pending`.
    """
    beam = group.beam
    assert beam is not None
    live = group.members
    if any(m.request_id not in group.pending for m in live):
        return False
    rows = np.stack([group.pending.pop(m.request_id) for m in live])  # (L, V)
    step = beam.step(log_softmax(rows))
    if step.done:
        for member in live:
            scheduler.finish(member, RequestStatus.FINISHED_STOPPED)
        params = beam.params
        assert isinstance(params, BeamSearchParams)
        group.beam_outputs = [
            CompletionOutput(index=i, text=decode(list(hyp.token_ids)),
                             token_ids=list(hyp.token_ids), delta_text="", delta_token_ids=[],
                             logprobs=None, delta_logprobs=None,
                             cumulative_logprob=hyp.cum_logprob,
                             finish_reason=("stop" if hyp.token_ids[-1] in beam.stop_ids
                                            else "length"),
                             stop_reason=(hyp.token_ids[-1] if hyp.token_ids[-1] in
                                          params.stop_token_ids else None))
            for i, hyp in enumerate(beam.results())]
        return True
    extended: set[int] = set()
    next_live: list[tuple[Request, int]] = []
    # fork before any token is appended, so a child copies its parent's tokens as they were
    for cand in step.survivors:
        parent = live[cand.parent]
        if cand.parent in extended:
            group.num_forks += 1
            child = Request(
                request_id=f"{group.request_id}#b{group.num_forks}", prompt=parent.prompt,
                prompt_token_ids=parent.prompt_token_ids, params=parent.params,
                max_tokens=parent.max_tokens, priority=parent.priority,
                cache_salt=parent.cache_salt, arrival_time=parent.arrival_time,
                group_id=group.request_id, index=group.num_forks,
                output_token_ids=list(parent.output_token_ids),
                all_token_ids=list(parent.all_token_ids))
            scheduler.add_running(child, parent)
            next_live.append((child, cand.token_id))
        else:
            extended.add(cand.parent)
            next_live.append((parent, cand.token_id))
    for i, member in enumerate(live):
        if i not in extended:
            scheduler.finish(member, RequestStatus.FINISHED_STOPPED)  # dropped: blocks freed
    for member, token_id in next_live:
        member.append_token(token_id)
    group.members = [member for member, _ in next_live]
    return True
