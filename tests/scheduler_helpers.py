"""Helpers for scheduler tests: sequences over token ids and a stub model that 'samples' tokens."""

from __future__ import annotations

from kvcore.cache import KVCacheManager
from kvcore.request import Sequence
from kvcore.sampling.params import SamplingParams
from kvcore.scheduler import Scheduler, SchedulerOutput

VOCAB = 50
EOS = 0


def make_request(request_id: str, prompt: list[int] | int, max_tokens: int = 4,
                 priority: int = 0, ignore_eos: bool = True, salt: str | None = None) -> Sequence:
    prompt_ids = prompt if isinstance(prompt, list) else [
        1 + (hash((request_id, i)) % (VOCAB - 1)) for i in range(prompt)]
    eos = frozenset() if ignore_eos else frozenset({EOS})
    return Sequence(seq_id=request_id, request_id=request_id, prompt_token_ids=prompt_ids,
                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                    max_tokens=max_tokens, priority=priority, cache_salt=salt,
                    stop_token_ids=eos, eos_token_ids=eos)


def stub_token(seq: Sequence) -> int:
    """A deterministic 'model': the next token depends only on the sequence's tokens."""
    return (sum(seq.token_ids) * 31 + seq.num_tokens) % VOCAB


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 16,
                   max_num_seqs: int = 8, prefix_caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(kv, budget, max_num_seqs)


def run_step(scheduler: Scheduler, budget: int | None = None) -> SchedulerOutput:
    """schedule -> (stub forward) -> update: requests whose tokens all got computed sample one.
    `budget`: this step's max_num_batched_tokens (the scheduler's own when None)."""
    if budget is not None:
        scheduler.max_num_batched_tokens = budget
    out = scheduler.schedule()
    scheduler.advance(out)
    for item in out.scheduled:
        seq = scheduler.seqs.get(item.seq_id)
        if seq is not None and item.sample:
            assert seq.num_computed_tokens == seq.num_tokens
            status = seq.append_token(stub_token(seq))
            if status is not None:
                scheduler.finish(seq, status)
    return out


def counts(out: SchedulerOutput) -> tuple[tuple[str, int], ...]:
    """(seq_id, num_scheduled_tokens) of each scheduled sequence, in batch order."""
    return tuple((item.seq_id, len(item.token_ids)) for item in out.scheduled)


def append(scheduler: Scheduler, seq_id: str, token_id: int) -> None:
    """What the engine core does with a sampled token: append it, finish on a stop."""
    seq = scheduler.seqs[seq_id]
    status = seq.append_token(token_id)
    if status is not None:
        scheduler.finish(seq, status)


def block_refcounts(kv: KVCacheManager) -> list[int]:
    return [block.ref_count for block in kv.pool.blocks]
