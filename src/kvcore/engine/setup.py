"""Engine set-up helpers: the model and cache dtype for a device, KV pool sizing, request checks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import structlog

from kvcore import kernels
from kvcore.cache import KVCacheManager, int4
from kvcore.cache.int4_window import num_window_slots
from kvcore.cache.kv_cache import KVCache
from kvcore.config import EngineConfig, ModelConfig, ParamError
from kvcore.kernels.cpu import quant
from kvcore.model import BatchInput, load_model
from kvcore.model.half_llama import HALF_CACHE_DTYPES, HalfLlamaModel
from kvcore.model.quantized import model_weight_bytes, resolve_quantization
from kvcore.planner import model_bytes_per_token, num_blocks_for_memory, window_bytes
from kvcore.sampling import BeamSearchParams, SamplingParams

log = structlog.get_logger("kvcore.engine")

CPU_KV_CACHE_MEMORY = 2 * 2**30  # the CPU default budget: 2 GiB, or less when that is plenty
GPU_KV_CACHE_FRACTION = 0.5  # of the device memory still free after the weights


class EngineModel(Protocol):
    """What the engine needs of a model (LlamaModel, or a stub in tests)."""

    config: ModelConfig

    def forward(self, batch: BatchInput, kv_cache: KVCache) -> np.ndarray: ...


def engine_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """SchedulerConfig.max_model_len, capped at (and by default) the model's context."""
    limit = model_config.max_position_embeddings
    return min(config.scheduler.max_model_len or limit, limit)


def engine_cache_dtype(cache_dtype: str, half_model: bool) -> str:
    """The KV cache dtype: "auto" is fp16 on both devices (the fp16 GPU model's own dtype; on
    the CPU, beside fp32 compute, half the bytes per token of fp32 with the default model's
    greedy outputs unchanged, see docs/benchmarks.md); the fp16 model pairs only with fp16, fp8 or
    int4 caches (ValueError otherwise)."""
    if not half_model:
        return "fp16" if cache_dtype == "auto" else cache_dtype
    if cache_dtype == "auto":
        return "fp16"
    if cache_dtype not in HALF_CACHE_DTYPES:
        raise ValueError(f"cache_dtype {cache_dtype!r} does not pair with the fp16 model (device "
                         f"cuda); use one of {('auto', *HALF_CACHE_DTYPES)}")
    return cache_dtype


def load_engine_model(config: EngineConfig, device: str) -> tuple[EngineModel, str]:
    """(model, cache dtype) for a resolved device. cpu: the fp32 LlamaModel; cuda: the fp16
    HalfLlamaModel with CUDA graphs for decode steps unless config.enforce_eager (an MLA model,
    HalfDeepseekModel, always runs eagerly). A cache dtype the device cannot use is a
    ValueError raised before any weight is loaded."""
    cache_dtype = engine_cache_dtype(config.cache.cache_dtype, half_model=device == "cuda")
    weight_format = resolve_quantization(config.quantization, config.model, device)
    model = load_model(config.model, device, weight_format=weight_format)
    if device != "cuda":
        if weight_format != "none":
            quant.warm_up()
        log.info("weights loaded", quantization=weight_format, isa=quant.ISA,
                 weight_bytes=model_weight_bytes(model))
        # the compiled CPU attention for this cache dtype, loaded (or compiled) before the
        # engine takes requests: no JIT on a request
        kernels.warm_up_cpu_kernels(cache_dtype)
        fused = getattr(model, "fused", None)  # the fused decode step's region, likewise
        if fused is not None:
            log.info("CPU fused decode step", warm_up_s=round(fused.warm_up(cache_dtype), 2))
        return model, cache_dtype
    assert isinstance(model, HalfLlamaModel)
    if not config.enforce_eager and model.config.mla is None:  # MLA steps run eagerly
        model.enable_cuda_graphs(config.scheduler.max_num_seqs,
                                 engine_max_model_len(config, model.config),
                                 config.cache.block_size)
    return model, cache_dtype


def window_slots(config: EngineConfig, cache_dtype: str) -> int:
    """An int4 cache's fp16 window blocks (enough that they never run out); 0 otherwise."""
    if cache_dtype != "int4":
        return 0
    return num_window_slots(config.scheduler.max_num_seqs, config.cache.int4_window_tokens,
                            config.cache.block_size, config.scheduler.max_num_batched_tokens)


def pool_size(config: EngineConfig, model_config: ModelConfig, cache_dtype: str,
              max_model_len: int, device: str) -> int:
    """Blocks in the pool: CacheConfig.num_blocks, else kv_cache_memory through the planner,
    else a device default (CPU: 2 GiB, capped at max_num_seqs sequences of max_model_len). An
    int4 cache's fp16 window comes out of the same budget."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    mc = model_config
    per_token = model_bytes_per_token(mc, cache_dtype, cache.block_size)
    kv_heads, kv_width, shared_kv = mc.kv_layout
    window = (window_bytes(mc.num_layers, kv_heads, kv_width, window_slots(config, cache_dtype),
                           cache.block_size) if cache_dtype == "int4" else 0)
    memory = cache.kv_cache_memory
    if memory is None:
        if device == "cuda":
            import cupy  # type: ignore[import-not-found]

            free, _ = cupy.cuda.runtime.memGetInfo()
            memory = int(free * GPU_KV_CACHE_FRACTION)
        else:
            wanted = per_token * config.scheduler.max_num_seqs * max_model_len + window
            memory = min(CPU_KV_CACHE_MEMORY, wanted)
    num_blocks = num_blocks_for_memory(memory, mc.num_layers, kv_heads, kv_width, cache_dtype,
                                       cache.block_size, shared_kv, window)
    if num_blocks < 1:
        extra = f" beside the int4 fp16 window ({window} bytes)" if window else ""
        raise ValueError(f"kv_cache_memory={memory} bytes holds no block of {cache.block_size} "
                         f"tokens ({per_token * cache.block_size} bytes){extra}")
    return num_blocks


def int4_group(model_config: ModelConfig, block_size: int, device: str) -> int:
    """An int4 cache's value channels per scale for this model; on cuda, a model the int4
    kernels do not compile for is a ValueError naming the value, before any allocation."""
    kv_heads, kv_width, shared_kv = model_config.kv_layout
    if shared_kv:
        raise ValueError("cache_dtype 'int4' does not hold a shared (MLA latent) cache; use "
                         "fp16 or fp8")
    group = math.gcd(int4.DEFAULT_GROUP, kv_width)  # a head narrower than the group: one group
    if device == "cuda":
        from kvcore.kernels.cuda.attention_kv_int4 import check_int4_limits

        check_int4_limits(block_size, model_config.num_heads, kv_heads, kv_width, group)
    return group


def make_kv_cache(config: EngineConfig, model_config: ModelConfig, num_blocks: int,
                  cache_dtype: str, device: str, kv: KVCacheManager) -> KVCache:
    """The pool's K/V arrays (on cuda CuPy arrays, an int4 cache's rows, windows and
    window_slot table included); an int4 cache's window slots driven by the block manager."""
    kv_heads, kv_width, shared_kv = model_config.kv_layout  # MLA: one latent K/V "head"
    slots = window_slots(config, cache_dtype)
    block_size = config.cache.block_size
    group = (int4_group(model_config, block_size, device) if cache_dtype == "int4"
             else int4.DEFAULT_GROUP)
    kv_cache = KVCache(model_config.num_layers, num_blocks, block_size, kv_heads,
                       kv_width, cache_dtype, device, shared_kv=shared_kv,
                       num_window_slots=slots or None,
                       window_tokens=config.cache.int4_window_tokens, int4_group=group)
    if kv_cache.window is not None:
        kv.attach_window(kv_cache.window)
    return kv_cache


def check_prompt(prompt_ids: Sequence[int], params: SamplingParams | BeamSearchParams,
                 max_model_len: int, vocab_size: int) -> int:
    """The request against the model and the context: token ids in the vocabulary (prompt,
    stop_token_ids, logit_bias), prompt + max_tokens within max_model_len. Returns the resolved
    max_tokens; ParamError (a ValueError) names the parameter. (A cluster's ingress runs this
    alone: the replica that takes the request checks the rest.)"""
    if not isinstance(params, SamplingParams | BeamSearchParams):
        raise ParamError("params", f"params must be SamplingParams or BeamSearchParams, "
                         f"got {params!r}")
    num_prompt = len(prompt_ids)
    if num_prompt == 0:
        raise ParamError("prompt", "prompt must not be empty")
    for param, ids in (("prompt", prompt_ids), ("stop_token_ids", params.stop_token_ids),
                       ("logit_bias", params.logit_bias or ())):
        bad = [t for t in ids if not isinstance(t, int | np.integer) or not 0 <= t < vocab_size]
        if bad:
            raise ParamError(param, f"{param} token id {bad[0]!r} is outside the vocabulary "
                             f"[0, {vocab_size})")
    if num_prompt >= max_model_len:
        raise ParamError("prompt", f"This model's maximum context length (max_model_len) is "
                         f"{max_model_len} tokens. However, your prompt has {num_prompt} tokens, "
                         f"which leaves no room for a completion.")
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - num_prompt
    if num_prompt + max_tokens > max_model_len:
        raise ParamError("max_tokens", f"This model's maximum context length (max_model_len) "
                         f"is {max_model_len} tokens. However, you requested "
                         f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                         f"{max_tokens} in the completion). Please reduce the length of the "
                         f"prompt or completion.")
    return max_tokens


def check_capacity(num_prompt: int, max_tokens: int, num_seqs: int, max_num_seqs: int,
                   num_blocks: int, block_size: int) -> None:
    """The request against the engine's size: its sequences run together, so all of them
    within max_num_seqs, and all of them at full length within the pool (n > 1: the prompt's
    blocks shared, each choice's own and a copy of the shared last block). ParamError naming
    `n` (or `max_tokens` for one sequence)."""
    if num_seqs > max_num_seqs:
        raise ParamError("n", f"n={num_seqs} sequences run at once, more than this server "
                         f"runs (max_num_seqs={max_num_seqs})")
    if num_seqs == 1:
        needed = -(-(num_prompt + max_tokens) // block_size)
    else:
        needed = -(-num_prompt // block_size) + num_seqs * (-(-max_tokens // block_size) + 1)
    if needed > num_blocks:
        raise ParamError("n" if num_seqs > 1 else "max_tokens",
                         f"{num_seqs} sequence(s) of {num_prompt} + {max_tokens} tokens need "
                         f"{needed} KV blocks, more than the whole pool ({num_blocks} blocks "
                         f"of {block_size} tokens)")
