"""The engine: schedule -> copy blocks -> forward -> sample -> update, one step at a time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import structlog

from kvcore.cache import KVCacheManager
from kvcore.cache.kv_cache import KVCache
from kvcore.config import EngineConfig, ModelConfig
from kvcore.device import resolve_device
from kvcore.engine.beam import beam_step
from kvcore.engine.group import RequestGroup
from kvcore.engine.runner import ModelRunner
from kvcore.engine.setup import (
    EngineModel,
    check_prompt,
    engine_cache_dtype,
    engine_max_model_len,
    load_engine_model,
    pool_size,
)
from kvcore.model.half_llama import HalfLlamaModel
from kvcore.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvcore.request import Request, RequestOutput
from kvcore.sampling import (
    BeamSearch,
    BeamSearchParams,
    Sampler,
    SamplingParams,
    SamplingRow,
    make_generator,
)
from kvcore.scheduler import Scheduler

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int  # sequences holding blocks
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks referenced, 0-1
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of those, served from the cache
    num_preemptions: int
    block_size: int
    cache_dtype: str


class Engine:
    """Continuous batching over one model and one paged KV cache; see DESIGN.md."""

    def __init__(self, config: EngineConfig, model: EngineModel | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        """Loads the model and tokenizer from config.model unless given (tests pass their own);
        the model and cache dtype follow the device (engine.setup.load_engine_model)."""
        device = resolve_device(config.device)
        self.config = config
        if model is None:
            model, self.cache_dtype = load_engine_model(config, device)
        else:
            self.cache_dtype = engine_cache_dtype(config.cache.cache_dtype,
                                                  isinstance(model, HalfLlamaModel))
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(config.model)
        self.model_config: ModelConfig = self.model.config
        mc = self.model_config
        self.max_model_len = engine_max_model_len(config, mc)
        num_blocks = pool_size(config, mc, self.cache_dtype, self.max_model_len, device)
        block_size = config.cache.block_size
        self.kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching,
                                 mc.sliding_window)
        kv_heads, kv_width, shared_kv = mc.kv_layout  # MLA: one latent K/V "head"
        self.kv_cache = KVCache(mc.num_layers, num_blocks, block_size, kv_heads, kv_width,
                                self.cache_dtype, device, shared_kv=shared_kv)
        self.scheduler = Scheduler(self.kv, config.scheduler.max_num_batched_tokens,
                                   config.scheduler.max_num_seqs, self.max_model_len)
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv)
        eos = mc.eos_token_ids or ((self.tokenizer.eos_token_id,)
                                   if self.tokenizer.eos_token_id is not None else ())
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.sampler = Sampler(self.eos_token_ids)
        self._seeds = np.random.SeedSequence(config.seed)
        self._groups: dict[str, RequestGroup] = {}
        log.info("kv cache pool", device=device, num_blocks=num_blocks, block_size=block_size,
                 cache_dtype=self.cache_dtype, bytes=self.kv_cache.num_bytes,
                 max_model_len=self.max_model_len,
                 max_concurrency=round(num_blocks * block_size / self.max_model_len, 2))

    # --- requests ---

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | BeamSearchParams, *, priority: int = 0,
                    cache_salt: str | None = None, prompt_text: str | None = None) -> None:
        """Queue a request. ValueError (nothing left allocated) for an empty prompt, one longer
        than max_model_len, prompt + max_tokens > max_model_len, more blocks than the pool holds,
        or a duplicate request_id. `prompt_text`: the text of a pre-tokenized `prompt`."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {cache_salt!r}")
        if request_id in self._groups or request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else prompt_text
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = check_prompt(prompt_ids, params, self.max_model_len,
                                  self.model_config.vocab_size, self.kv)
        first = self._new_request(request_id, text, prompt_ids, params, max_tokens, priority,
                                  cache_salt, request_id, 0)
        self.scheduler.add_request(first)  # admission control: ValueError, nothing allocated
        self._groups[request_id] = RequestGroup(
            first, BeamSearch(params, self.eos_token_ids)
            if isinstance(params, BeamSearchParams) else None)

    def _new_request(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                     params: SamplingParams | BeamSearchParams, max_tokens: int, priority: int,
                     cache_salt: str | None, group_id: str, index: int) -> Request:
        if isinstance(params, BeamSearchParams):
            return Request(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_ids,
                           params=params, max_tokens=max_tokens, priority=priority,
                           cache_salt=cache_salt, group_id=group_id, index=index,
                           eos_token_ids=self.eos_token_ids)
        seed = None if params.seed is None else params.seed + index
        return Request(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_ids, params=params,
            max_tokens=max_tokens, priority=priority, cache_salt=cache_salt,
            group_id=group_id, index=index, eos_token_ids=self.eos_token_ids,
            generator=None if params.greedy else make_generator(seed, self._seeds),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            logprobs=[] if params.logprobs is not None else None)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request now (its blocks return to the pool); unknown id: None. Returns its
        final output (finish_reason "abort") for callers that stream it."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for member in group.members:
            self.scheduler.abort_request(member.request_id)
        group.aborted = True
        return group.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # --- one step ---

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that progressed or finished."""
        out = self.scheduler.schedule()
        for request_id in out.preempted_ids:
            group = self._groups.get(self.scheduler.requests[request_id].group_id or "")
            if group is not None:
                group.pending.pop(request_id, None)  # a preempted beam recomputes its row
        if out.scheduled:
            logits, sampling = self.runner.execute(out, self.scheduler.requests)
        else:
            logits, sampling = np.zeros((0, self.model_config.vocab_size), np.float32), []
        self.scheduler.advance(out)
        sampled, touched = self._sample(logits, sampling)
        self.scheduler.append_tokens(sampled)
        outputs = [group.output() for group in touched.values()]
        for group in touched.values():
            if group.finished:
                del self._groups[group.request_id]
        return outputs

    def _sample(self, logits: np.ndarray, sampling: list[Request]
                ) -> tuple[dict[str, int], dict[str, RequestGroup]]:
        """Sample the rows of plain requests (forking n > 1 choices after their prefill) and
        collect the rows of beams, stepping each search whose live beams are all in."""
        touched: dict[str, RequestGroup] = {}
        rows: list[Request] = []
        row_logits: list[int] = []
        for i, request in enumerate(sampling):
            group = self._groups[request.group_id or request.request_id]
            touched[group.request_id] = group
            if group.beam is not None:
                group.pending[request.request_id] = logits[i]
                continue
            if not group.forked:
                self._fork_choices(group, request)
                rows.extend(group.members)
                row_logits.extend([i] * group.num_choices)
            else:
                rows.append(request)
                row_logits.append(i)
        sampled: dict[str, int] = {}
        if rows:
            batch = logits[row_logits]  # (B, V) a copy: the processors write in place
            result = self.sampler(batch, [_sampling_row(r) for r in rows])
            for request, token_id, logprob in zip(rows, result.token_ids.tolist(),
                                                  result.logprobs, strict=True):
                sampled[request.request_id] = token_id
                if logprob is not None and request.logprobs is not None:
                    request.logprobs.append(logprob)
                    request.cumulative_logprob += logprob.logprob
        for group in touched.values():
            if group.beam is not None:
                beam_step(group, self.scheduler, self.tokenizer.decode)
        return sampled, {k: g for k, g in touched.items()
                         if g.beam is None or g.beam_outputs is not None}

    def _fork_choices(self, group: RequestGroup, parent: Request) -> None:
        """n > 1: the prompt was prefilled once; n - 1 more sequences share its blocks."""
        for index in range(1, group.num_choices):
            child = self._new_request(f"{group.request_id}#n{index}", parent.prompt,
                                      parent.prompt_token_ids, parent.params, parent.max_tokens,
                                      parent.priority, parent.cache_salt, group.request_id, index)
            self.scheduler.add_running(child, parent)
            group.members.append(child)
        group.forked = True

    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage(), num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks, prefix_cache_queries=kv.num_prefix_queries,
            prefix_cache_hits=kv.num_prefix_hits, num_preemptions=self.scheduler.num_preemptions,
            block_size=kv.block_size, cache_dtype=self.cache_dtype)


def _sampling_row(request: Request) -> SamplingRow:
    assert isinstance(request.params, SamplingParams)
    return SamplingRow(request.params, request.generator, request.prompt_token_ids,
                       request.output_token_ids)
