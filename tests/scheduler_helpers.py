"""Helpers for scheduler tests: requests over token ids and a stub model that 'samples' tokens."""

from __future__ import annotations

from kvcore.cache import KVCacheManager
from kvcore.request import Request
from kvcore.sampling.params import SamplingParams
from kvcore.scheduler import Scheduler, SchedulerOutput

VOCAB = 50
EOS = 0


def make_request(request_id: str, prompt: list[int] | int, max_tokens: int = 4,
                 priority: int = 0, ignore_eos: bool = True, salt: str | None = None) -> Request:
    prompt_ids = prompt if isinstance(prompt, list) else [
        1 + (hash((request_id, i)) % (VOCAB - 1)) for i in range(prompt)]
    return Request(request_id=request_id, prompt_token_ids=prompt_ids,
                   params=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                   max_tokens=max_tokens, priority=priority, cache_salt=salt,
                   eos_token_ids=(EOS,))


def stub_token(request: Request) -> int:
    """A deterministic 'model': the next token depends only on the sequence's tokens."""
    return (sum(request.all_token_ids) * 31 + request.num_tokens) % VOCAB


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 16,
                   max_num_seqs: int = 8, max_model_len: int = 256,
                   prefix_caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(kv, budget, max_num_seqs, max_model_len)


def run_step(scheduler: Scheduler, budget: int | None = None) -> SchedulerOutput:
    """schedule -> (stub forward) -> update: requests whose tokens all got computed sample one."""
    out = scheduler.schedule(budget)
    scheduler.advance(out)
    sampled = {}
    for request_id, _ in out.scheduled:
        request = scheduler.requests.get(request_id)
        if request is not None and request.num_computed_tokens == request.num_tokens:
            sampled[request_id] = stub_token(request)
    scheduler.append_tokens(sampled)
    return out


def block_refcounts(kv: KVCacheManager) -> list[int]:
    return [block.ref_count for block in kv.pool.blocks]
