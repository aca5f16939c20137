"""The engine: requests in (validated once), one step at a time, RequestOutputs out."""

from __future__ import annotations

import gc
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import structlog

from kvcore.cache import KVCacheManager
from kvcore.cache.kv_cache import KVCache
from kvcore.config import EngineConfig, ModelConfig, ParamError
from kvcore.device import resolve_device
from kvcore.engine.beam import BeamPolicy
from kvcore.engine.core import EngineCore
from kvcore.engine.output import OutputProcessor
from kvcore.engine.runner import ModelRunner
from kvcore.engine.setup import (
    EngineModel,
    check_prompt,
    engine_cache_dtype,
    engine_max_model_len,
    load_engine_model,
    make_kv_cache,
    pool_size,
)
from kvcore.model.half_llama import HalfLlamaModel
from kvcore.model.tokenizer import Tokenizer
from kvcore.request import RequestOutput, Sequence, SequenceStatus
from kvcore.sampling import BeamSearch, BeamSearchParams, RowSampler, SamplingParams
from kvcore.sampling.constraints import ConstraintCompiler
from kvcore.scheduler import Scheduler
from kvcore.speculation import SpecDecodeStats, Speculator

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int  # sequences holding blocks
    num_waiting: int  # sequences waiting (a request's pending forks count too)
    kv_cache_usage: float  # fraction of blocks referenced, 0-1
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of those, served from the cache
    num_preemptions: int
    block_size: int
    cache_dtype: str
    kv_cache_bytes: int = 0  # the pool's arrays (int4: rows, fp16 window and slot table)
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters (None: off)
    # structured outputs: seconds per step computing token masks, as (bucket edges, counts
    # per bucket + one above all, sum); None before the first constrained step
    mask_seconds: tuple[tuple[float, ...], tuple[int, ...], float] | None = None


class Engine:
    """Continuous batching over one model and one paged KV cache (docs/architecture.md): the engine
    core runs the sequences, the output processor turns their tokens into request outputs."""

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
        self.kv_cache: KVCache = make_kv_cache(config, mc, num_blocks, self.cache_dtype, device,
                                               self.kv)
        eos = mc.eos_token_ids or ((self.tokenizer.eos_token_id,)
                                   if self.tokenizer.eos_token_id is not None else ())
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        scheduler = Scheduler(self.kv, config.scheduler.max_num_batched_tokens,
                              config.scheduler.max_num_seqs)
        async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                            else device == "cuda")
        speculator = None if config.speculative is None else Speculator(config.speculative)
        self.core = EngineCore(scheduler, ModelRunner(self.model, self.kv_cache, block_size),
                               RowSampler(self.eos_token_ids, mc.vocab_size), mc.vocab_size,
                               config.seed, async_scheduling, speculator)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        # structured outputs: constraints compiled against this vocabulary (cached)
        self.constraints = ConstraintCompiler(self.tokenizer.to_json, mc.vocab_size,
                                              self.eos_token_ids)
        # the weights' and tokenizer's objects never become garbage: keep the cyclic GC from
        # walking them at every collection during serving (a pause inside a step)
        gc.freeze()
        log.info("kv cache pool", device=device, num_blocks=num_blocks, block_size=block_size,
                 cache_dtype=self.cache_dtype, bytes=self.kv_cache.num_bytes,
                 max_model_len=self.max_model_len)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    # --- requests ---

    def add_request(self, request_id: str, prompt: str | Seq[int],
                    params: SamplingParams | BeamSearchParams, *, priority: int = 0,
                    cache_salt: str | None = None, prompt_text: str | None = None) -> None:
        """Queue a request: `check_request`, then `add_checked`. ParamError (a ValueError naming
        the parameter; nothing left allocated) for an empty prompt, one longer than
        max_model_len, prompt + max_tokens > max_model_len, more sequences than max_num_seqs or
        blocks than the pool holds, or a duplicate request_id. `prompt_text`: the text of a
        pre-tokenized `prompt`."""
        text = prompt if isinstance(prompt, str) else prompt_text
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = self.check_request(prompt_ids, params, priority, cache_salt)
        self.add_checked(request_id, prompt_ids, params, max_tokens, priority=priority,
                         cache_salt=cache_salt, prompt_text=text)

    def check_request(self, prompt_ids: Seq[int], params: SamplingParams | BeamSearchParams,
                      priority: int = 0, cache_salt: str | None = None) -> int:
        """Every check of a request against the engine's fixed configuration (vocabulary,
        context, pool size, the constraint compiled and cached), once: the resolved max_tokens,
        or ParamError. Reads only what never changes after start-up, so any thread may call it
        (AsyncEngine does, on the event loop, before it queues the request, once
        AsyncEngine.prepare compiled the constraint off the loop: then a cache hit)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ParamError("priority", f"priority must be an integer, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ParamError("cache_salt", f"cache_salt must be a string or None, "
                             f"got {cache_salt!r}")
        max_tokens = check_prompt(prompt_ids, params, self.max_model_len,
                                  self.model_config.vocab_size, self.kv)
        if params.constraint is not None:  # ParamError with the compiler's message
            # a cache hit after AsyncEngine.prepare; compiled here (blocking) otherwise
            self.constraints.compile(params.constraint, cache_salt=cache_salt)
        return max_tokens

    def add_checked(self, request_id: str, prompt_ids: list[int],
                    params: SamplingParams | BeamSearchParams, max_tokens: int, *,
                    priority: int = 0, cache_salt: str | None = None,
                    prompt_text: str | None = None) -> None:
        """Queue a request `check_request` passed (with the max_tokens it returned); only what
        depends on the engine's state is checked here (a duplicate request_id, admission)."""
        if request_id in self.output_processor:
            raise ParamError("request_id", f"request_id {request_id!r} is already in use")
        text = prompt_text
        eos = frozenset(self.eos_token_ids)
        policy = None
        if isinstance(params, SamplingParams):
            eos_ids = frozenset() if params.ignore_eos else eos
            stop_ids = eos_ids | frozenset(params.stop_token_ids)
            num_seqs = params.n
        else:  # beams end by their policy, not by a stop id
            eos_ids = stop_ids = frozenset()
            num_seqs = params.beam_width
            policy = BeamPolicy(BeamSearch(params, self.eos_token_ids))
        seq = Sequence(seq_id=request_id, request_id=request_id, prompt_token_ids=prompt_ids,
                       params=params, max_tokens=max_tokens, priority=priority,
                       cache_salt=cache_salt, stop_token_ids=stop_ids, eos_token_ids=eos_ids,
                       num_pending_forks=num_seqs - 1)
        if params.constraint is not None:  # compiled by check_request: a cache hit
            seq.matcher = self.constraints.matcher(params.constraint, cache_salt)
        self.output_processor.add(request_id, text, prompt_ids, params)
        try:
            self.core.add(seq, policy)  # admission control: nothing allocated on refusal
        except Exception:
            self.output_processor.discard(request_id)
            raise

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request now (its blocks return to the pool); unknown id: None. Returns its
        final output (finish_reason "abort") for callers that stream it."""
        live = self.core.abort(request_id)
        return self.output_processor.abort(request_id, live)

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    # --- one step ---

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that progressed or finished.

        A failure is contained where it happens: an exception in one request's sampling, beam
        step, detokenization or stop checks fails that request only (its output carries the
        error); an exception in the shared forward pass fails the requests of that step, and
        the engine goes on with the others and the queue."""
        core = self.core
        return self.output_processor.process(
            core.step(),
            stop_seq=lambda seq_id: core.finish_seq(seq_id, SequenceStatus.FINISHED_STOPPED),
            fail_request=lambda request_id: core.abort(request_id,
                                                       SequenceStatus.FINISHED_ERROR))

    def stats(self) -> EngineStats:
        kv = self.kv
        scheduler = self.scheduler
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=sum(seq.num_seqs for seq in scheduler.waiting),
            kv_cache_usage=kv.usage(), num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks, prefix_cache_queries=kv.num_prefix_queries,
            prefix_cache_hits=kv.num_prefix_hits, num_preemptions=scheduler.num_preemptions,
            block_size=kv.block_size, cache_dtype=self.cache_dtype,
            kv_cache_bytes=self.kv_cache.num_bytes,
            spec_decode=None if self.core.speculator is None else self.core.speculator.stats,
            mask_seconds=self.core.constrainer.mask_times())
