"""KV cache sizing: bytes/token = 2 x layers x kv_heads x head_dim x bytes per element (MLA:
layers x (kv_lora_rank + qk_rope_head_dim) x bytes, one latent that is both K and V), and more.

int4 (kvcore.cache.int4's format) is sized per block: each layer's K row (nibbles + a scale and
a zero per channel) and V row (nibbles + a scale and a zero per token and group of channels),
plus the block's window_slot entry; the fp16 window of recent tokens is a fixed pool beside the
blocks (window_bytes), taken from the memory budget before the blocks."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvcore.config import ModelConfig

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
KV_DTYPES = (*DTYPE_BYTES, "int4")  # what a KV cache can hold
INT4_GROUP = 32  # kvcore.cache.int4.DEFAULT_GROUP (a test keeps them equal)
# names other layers meet (config.json's torch_dtype, NumPy/ml_dtypes) -> the planner's dtype names
DTYPE_ALIASES: dict[str, str] = {
    "float32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8",
    "e4m3": "fp8",
}

_DECIMAL_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BINARY_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_UNITS = {**_DECIMAL_UNITS, **_BINARY_UNITS}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True, slots=True)
class KVPlan:
    bytes_per_token: int  # K and V of every layer for one token
    bytes_per_block: int  # one block of block_size tokens, all layers
    tokens_per_sequence: int  # KV slots one sequence holds at most (the window caps it)
    blocks_per_sequence: int
    bytes_per_sequence: int  # blocks_per_sequence whole blocks: what the pool really gives it
    num_blocks: int | None  # blocks that fit the memory budget; None without a budget
    max_concurrent_sequences: int | None  # sequences of tokens_per_sequence the budget holds
    window_bytes: int = 0  # int4: the fp16 window pool, outside the blocks


def canonical_dtype(dtype: str) -> str:
    """The planner's name for a KV dtype (fp32/fp16/bf16/fp8/int4); aliases like "float16"
    accepted."""
    name = DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if name not in KV_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(KV_DTYPES)}, got {dtype!r}")
    return name


def _positive(name: str, value: object) -> int:
    # bool is an int subclass; True layers is a bug, not a size
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str,
                    shared_kv: bool = False, block_size: int = 16,
                    group: int = INT4_GROUP) -> int:
    """K and V (the 2) for every layer and KV head of one token; with shared_kv (MLA: one
    "KV head" of kv_lora_rank + qk_rope_head_dim that is both) the 2 is 1. int4: a block's
    bytes over its block_size tokens, rounded up."""
    if canonical_dtype(dtype) == "int4":
        per_block = bytes_per_block(num_layers, num_kv_heads, head_dim, dtype, block_size,
                                    shared_kv, group)
        return -(-per_block // block_size)
    _positive("num_layers", num_layers)
    _positive("num_kv_heads", num_kv_heads)
    _positive("head_dim", head_dim)
    arrays = 1 if shared_kv else 2
    return arrays * num_layers * num_kv_heads * head_dim * DTYPE_BYTES[canonical_dtype(dtype)]


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str,
                    block_size: int, shared_kv: bool = False, group: int = INT4_GROUP) -> int:
    """One block of block_size tokens, all layers: what the pool allocates per block."""
    _positive("block_size", block_size)
    if canonical_dtype(dtype) != "int4":
        return bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, shared_kv) * block_size
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("group", group)):
        _positive(name, value)
    if shared_kv:
        raise ValueError("dtype int4 does not hold a shared (MLA latent) cache")
    group = math.gcd(group, head_dim)  # as the cache: a head narrower than the group is one
    if head_dim % 2 or head_dim % group:
        raise ValueError(f"int4 needs an even head_dim that group {group} divides, "
                         f"got {head_dim}")
    nibbles = block_size * num_kv_heads * head_dim // 2
    key_row = nibbles + 4 * num_kv_heads * head_dim  # fp16 scale + zero per channel
    value_row = nibbles + 4 * block_size * num_kv_heads * (head_dim // group)
    return num_layers * (key_row + value_row) + 4  # + the block's int32 window_slot entry


def window_bytes(num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int,
                 block_size: int) -> int:
    """An int4 cache's fp16 window: K and V of num_slots blocks in every layer."""
    return 2 * num_layers * num_slots * block_size * num_kv_heads * head_dim * 2


def model_bytes_per_token(model_config: ModelConfig, dtype: str, block_size: int = 16) -> int:
    """bytes_per_token of a model's cache layout (MLA: the latent and the rope key part)."""
    heads, width, shared = model_config.kv_layout
    return bytes_per_token(model_config.num_layers, heads, width, dtype, shared, block_size)


def full_kv_bytes_per_token(num_layers: int, num_heads: int, qk_head_dim: int, v_head_dim: int,
                            dtype: str) -> int:
    """What an MLA model would cache per token with full per-head K (qk_head_dim) and V
    (v_head_dim) for all num_heads heads: the baseline the latent cache is compared with."""
    _positive("num_heads", num_heads)
    return (bytes_per_token(num_layers, num_heads, qk_head_dim, dtype) // 2
            + bytes_per_token(num_layers, num_heads, v_head_dim, dtype) // 2)


def num_blocks_for_memory(memory_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int,
                          dtype: str, block_size: int, shared_kv: bool = False,
                          fixed_bytes: int = 0) -> int:
    """Whole blocks of block_size tokens that fit memory_bytes once fixed_bytes (an int4
    window) are set aside (0 when not even one fits)."""
    _positive("memory", memory_bytes)
    per_block = bytes_per_block(num_layers, num_kv_heads, head_dim, dtype, block_size, shared_kv)
    return max(0, memory_bytes - fixed_bytes) // per_block


def tokens_held(context: int, block_size: int, sliding_window: int | None) -> int:
    """KV slots a sequence of `context` tokens holds at its peak.

    With a sliding window only blocks wholly outside it are released, so the window, rounded up to
    whole blocks, plus one block for a window that straddles a block boundary stays allocated.
    """
    _positive("context", context)
    _positive("block_size", block_size)
    if sliding_window is None:
        return context
    _positive("sliding_window", sliding_window)
    window_blocks = -(-sliding_window // block_size) + 1
    return min(context, window_blocks * block_size)


def plan(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, context: int,
         memory: int | None = None, block_size: int = 16,
         sliding_window: int | None = None, shared_kv: bool = False,
         window_slots: int = 0) -> KVPlan:
    """The KV budget of a model shape: per token, per sequence of `context`, what `memory` holds.
    shared_kv: one array per layer is both K and V (MLA's latent; num_kv_heads 1).
    window_slots: an int4 cache's fp16 window blocks (kvcore.cache.int4_window), set aside."""
    per_token = bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, shared_kv, block_size)
    tokens = tokens_held(context, block_size, sliding_window)
    blocks_per_seq = -(-tokens // block_size)
    per_block = bytes_per_block(num_layers, num_kv_heads, head_dim, dtype, block_size, shared_kv)
    fixed = (window_bytes(num_layers, num_kv_heads, head_dim, window_slots, block_size)
             if canonical_dtype(dtype) == "int4" else 0)
    num_blocks = max_seqs = None
    if memory is not None:
        num_blocks = num_blocks_for_memory(memory, num_layers, num_kv_heads, head_dim, dtype,
                                           block_size, shared_kv, fixed)
        max_seqs = num_blocks // blocks_per_seq
    return KVPlan(
        bytes_per_token=per_token,
        bytes_per_block=per_block,
        tokens_per_sequence=tokens,
        blocks_per_sequence=blocks_per_seq,
        bytes_per_sequence=blocks_per_seq * per_block,
        num_blocks=num_blocks,
        max_concurrent_sequences=max_seqs,
        window_bytes=fixed,
    )


def plan_for_model(model_config: ModelConfig, dtype: str, context: int | None = None,
                   memory: int | None = None, block_size: int = 16,
                   window_slots: int = 0) -> KVPlan:
    """plan() for a ModelConfig; context defaults to the model's max_position_embeddings."""
    heads, width, shared = model_config.kv_layout
    return plan(model_config.num_layers, heads, width, dtype,
                context if context is not None else model_config.max_position_embeddings,
                memory=memory, block_size=block_size, sliding_window=model_config.sliding_window,
                shared_kv=shared, window_slots=window_slots)


# kvcore.cache.tiers.pagefile's header less its token ids (8 bytes each); a test keeps it equal
PAGE_FILE_FIXED_BYTES = 92


@dataclass(frozen=True, slots=True)
class TierPlan:
    """What a KV tier of capacity_bytes holds."""

    bytes_per_page: int  # one block of every layer (on disk: with its file's header)
    pages: int
    tokens: int
    sequences: int  # of tokens_per_sequence tokens


def page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, block_size: int,
               shared_kv: bool = False, offload_dtype: str = "auto") -> int:
    """One page (a block of every layer's K and V) as a tier holds it: the pool's own bytes
    (offload_dtype auto), or the host tier's int4 / fp8 compression of a float pool."""
    if offload_dtype == "auto":
        per_block = bytes_per_block(num_layers, num_kv_heads, head_dim, dtype, block_size,
                                    shared_kv)
        return per_block - (4 if canonical_dtype(dtype) == "int4" else 0)  # no window entry
    arrays = num_layers * (1 if shared_kv else 2)
    values = bytes_per_token(num_layers, num_kv_heads, head_dim, "fp32", shared_kv) // 4
    elements = values * block_size  # of one page
    if offload_dtype == "fp8":
        return elements + 4 * arrays  # one float32 scale per array
    if offload_dtype != "int4":
        raise ValueError(f"offload_dtype must be auto, int4 or fp8, got {offload_dtype!r}")
    group = math.gcd(INT4_GROUP, head_dim)
    keys = arrays if shared_kv else arrays // 2
    return (elements // 2 + 4 * keys * num_kv_heads * head_dim
            + 4 * (arrays - keys) * block_size * num_kv_heads * (head_dim // group))


def tier_plan(capacity_bytes: int, bytes_per_page: int, block_size: int,
              tokens_per_sequence: int) -> TierPlan:
    pages = capacity_bytes // bytes_per_page
    return TierPlan(bytes_per_page, pages, pages * block_size,
                    pages // -(-tokens_per_sequence // block_size))  # whole blocks each


def parse_size(text: str | int) -> int:
    """Bytes in "64GiB", "1.5 GB", "512KiB", "1000": KB/MB/GB/TB decimal, KiB..TiB binary."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must be >= 0 bytes, got {text!r}")
        return text
    match = _SIZE_RE.match(text) if isinstance(text, str) else None
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in _SIZE_UNITS):
        raise ValueError(f"invalid size {text!r}: expected a number with an optional unit "
                         f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 64GiB")
    number = match.group(1)
    scale = _SIZE_UNITS.get(unit, 1)
    if "." not in number:
        return int(number) * scale
    whole, _, frac = number.partition(".")
    # exact rational arithmetic: "1.1GB" must be 1_100_000_000, not a float's neighbour
    numerator = int((whole or "0") + frac) * scale
    return numerator // 10 ** len(frac)


def format_size(num_bytes: int) -> str:
    """Human binary units: 512 KiB, 2 GiB, 2.5 MiB, 9.77 GiB (two decimals at most)."""
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
    value, unit = float(num_bytes), "B"
    for name in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024:
            break
        value, unit = value / 1024, name
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{text} {unit}"
