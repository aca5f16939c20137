"""Launch logic of the CUDA kernels: argument checks, grid and shared-memory sizing, launches.

`CudaOps(backend)` holds the wrappers, written against a small backend (array module, kernel
lookup, pointer tables, host copies) so the same code drives CuPy on a GPU (kvcore.kernels.cuda)
and the CPU emulation harness of the tests. Every wrapper checks dtype, shape and contiguity
before it launches and raises ValueError naming the argument.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

Kernel = Callable[..., None]  # kernel(grid, block, args, shared_mem=...) as cupy.RawKernel
SMEM_LIMIT = 48 * 1024  # dynamic shared memory a kernel gets without opting in
DEFAULT_PARTITION_SIZE = 512
_DECODE_THREADS = 128  # fixed in paged_attention_decode.cu (KVC_DECODE_THREADS)
_PREFILL_THREADS = 128
_GCHUNK = 8  # KVC_GCHUNK
_SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
# CuPy has no bf16 or fp8 dtype: there caches hold the raw bits (uint16 / uint8, see KVCache)
_CACHE_SUFFIX = {**_SUFFIX, "uint16": "bf16", "float8_e4m3fn": "fp8", "uint8": "fp8"}
# (activation, cache) pairs with instantiated kernels
_CACHE_PAIRS = {("f32", "f32"), ("f32", "f16"), ("f32", "bf16"), ("f32", "fp8"),
                ("f16", "f16"), ("f16", "fp8"), ("bf16", "bf16"), ("bf16", "fp8")}


class Backend(Protocol):
    xp: Any

    def function(self, source: str, name: str) -> Kernel: ...

    def pointer_array(self, arrays: Sequence[Any]) -> Any: ...

    def to_host(self, array: Any) -> np.ndarray: ...


def _suffix(name: str, array: Any) -> str:
    suffix = _SUFFIX.get(array.dtype.name)
    if suffix is None:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {array.dtype}")
    return suffix


def _cache_suffix(name: str, cache: Any, activation_suffix: str) -> str:
    suffix = _CACHE_SUFFIX.get(cache.dtype.name)
    if (activation_suffix, suffix) not in _CACHE_PAIRS:
        raise ValueError(f"{name} dtype {cache.dtype} cannot hold {activation_suffix} "
                         "activations: use the same dtype, fp8 (float8_e4m3fn / uint8), or any "
                         "cache dtype with float32 activations")
    return str(suffix)


def _contiguous(name: str, array: Any) -> None:
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def _int_array(name: str, array: Any, dtype: str, shape: tuple[int, ...] | None = None) -> None:
    if array.dtype.name != dtype:
        raise ValueError(f"{name} must be {dtype}, got {array.dtype}")
    if shape is not None and tuple(array.shape) != shape:
        raise ValueError(f"{name} shape {tuple(array.shape)} != {shape}")
    _contiguous(name, array)


def decode_smem_bytes(group: int, head_dim: int, partition_size: int) -> int:
    """q (G, D) + logits (G, P) + cross-warp sums (8, D) + stats (2, G), fp32."""
    return 4 * (group * head_dim + group * partition_size + _GCHUNK * head_dim + 2 * group)


def prefill_smem_bytes(group: int, head_dim: int, q_tile: int, k_tile: int) -> int:
    rows = q_tile * group
    return 4 * (2 * rows * head_dim + k_tile * (head_dim + 1) + k_tile * head_dim
                + rows * k_tile + 3 * rows)


def prefill_tiles(group: int, head_dim: int) -> tuple[int, int]:
    """(q_tile, k_tile): about 16 query rows per block, the largest key tile that fits."""
    for k_tile in (32, 16, 8):
        for q_tile in range(max(1, 16 // group), 0, -1):
            if prefill_smem_bytes(group, head_dim, q_tile, k_tile) <= SMEM_LIMIT:
                return q_tile, k_tile
    raise ValueError(f"GQA group {group} x head_dim {head_dim} exceeds the prefill kernel's "
                     "shared memory")


class CudaOps:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.xp = backend.xp

    def reshape_and_cache(self, key: Any, value: Any, k_cache: Any, v_cache: Any,
                          slot_mapping: Any, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        if key.ndim != 3 or value.shape != key.shape:
            raise ValueError(f"key {key.shape} / value {value.shape} must be equal (T, Hkv, D)")
        num_tokens, num_kv_heads, head_dim = key.shape
        if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or \
                tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
            raise ValueError(f"k_cache {k_cache.shape} / v_cache {v_cache.shape} must be equal "
                             f"(num_blocks, block_size, {num_kv_heads}, {head_dim})")
        if value.dtype != key.dtype or v_cache.dtype != k_cache.dtype:
            raise ValueError("key/value and k_cache/v_cache must share their dtypes")
        suffix = _suffix("key", key)
        cache_suffix = _cache_suffix("k_cache", k_cache, suffix)
        slot_mapping = self.xp.asarray(slot_mapping)
        _int_array("slot_mapping", slot_mapping, "int64", (num_tokens,))
        for name, array in (("key", key), ("value", value), ("k_cache", k_cache),
                            ("v_cache", v_cache)):
            _contiguous(name, array)
        if num_tokens == 0:
            return
        kernel = self.backend.function("cache_ops.cu", f"reshape_and_cache_{suffix}_{cache_suffix}")
        kernel((num_tokens,), (128,), (key, value, k_cache, v_cache, slot_mapping,
                                       np.int32(num_kv_heads * head_dim), np.float32(k_scale),
                                       np.float32(v_scale)))

    def copy_blocks(self, k_caches: list[Any], v_caches: list[Any], block_mapping: Any) -> None:
        mapping = np.asarray(self.backend.to_host(block_mapping))
        if mapping.size == 0:
            return
        if mapping.ndim != 2 or mapping.shape[1] != 2:
            raise ValueError(f"block_mapping must be (M, 2), got {mapping.shape}")
        if not k_caches or len(k_caches) != len(v_caches):
            raise ValueError(f"k_caches ({len(k_caches)}) and v_caches ({len(v_caches)}) must "
                             "be non-empty lists of equal length")
        shape, dtype = k_caches[0].shape, k_caches[0].dtype
        for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
            for i, cache in enumerate(caches):
                if cache.shape != shape or cache.dtype != dtype:
                    raise ValueError(f"{name}[{i}] is {cache.shape} {cache.dtype}, "
                                     f"expected {shape} {dtype}")
                _contiguous(f"{name}[{i}]", cache)
        if mapping.min() < 0 or mapping.max() >= shape[0]:
            raise ValueError(f"block_mapping holds a block id outside [0, {shape[0]})")
        src, dst = mapping[:, 0], mapping[:, 1]
        # parallel blocks copy at once: a destination that is also a source would race
        if len(set(dst.tolist())) != len(dst) or set(dst.tolist()) & set(src.tolist()):
            raise ValueError("block_mapping destinations must be distinct and never a source")
        bytes_per_block = int(np.prod(shape[1:])) * dtype.itemsize
        mapping_dev = self.xp.asarray(np.ascontiguousarray(mapping, dtype=np.int64))
        kernel = self.backend.function("cache_ops.cu", "copy_blocks")
        kernel((len(k_caches), len(mapping)), (256,),
               (self.backend.pointer_array(k_caches), self.backend.pointer_array(v_caches),
                mapping_dev, np.int64(bytes_per_block)))

    def paged_attention(self, query: Any, k_cache: Any, v_cache: Any, block_tables: Any,
                        context_lens: Any, query_start_loc: Any, scale: float,
                        sliding_window: int | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0, *, partition_size: int | None = None) -> Any:
        if query.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
            raise ValueError(f"query {query.shape} must be (T, H, D) and k_cache {k_cache.shape}"
                             f" / v_cache {v_cache.shape} equal (num_blocks, block_size, Hkv, D)")
        num_tokens, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
        if cache_dim != head_dim or num_heads % num_kv_heads:
            raise ValueError(f"query {query.shape} does not fit cache {k_cache.shape}: head_dim "
                             "must match and H be a multiple of Hkv")
        if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
            raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
        if v_cache.dtype != k_cache.dtype:
            raise ValueError("k_cache and v_cache must share their dtype")
        suffix = _suffix("query", query)
        cache_suffix = _cache_suffix("k_cache", k_cache, suffix)
        for name, array in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
            _contiguous(name, array)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        # metadata may come from the host; one upload each (no-op for device arrays)
        block_tables, context_lens, query_start_loc = (
            self.xp.asarray(a) for a in (block_tables, context_lens, query_start_loc))
        qsl = np.asarray(self.backend.to_host(query_start_loc))
        ctx = np.asarray(self.backend.to_host(context_lens))
        num_seqs = ctx.shape[0] if ctx.ndim == 1 else -1
        _int_array("context_lens", context_lens, "int32", (num_seqs,))
        _int_array("query_start_loc", query_start_loc, "int32", (num_seqs + 1,))
        _int_array("block_tables", block_tables, "int32")
        if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
            raise ValueError(f"block_tables must be ({num_seqs}, max_blocks), "
                             f"got {block_tables.shape}")
        q_lens = np.diff(qsl.astype(np.int64))
        if qsl[0] != 0 or qsl[-1] != num_tokens or np.any(q_lens < 0):
            raise ValueError(f"query_start_loc must rise from 0 to {num_tokens}, got {qsl}")
        if np.any(q_lens > ctx) or np.any(-(-ctx.astype(np.int64) // block_size)
                                          > block_tables.shape[1]):
            raise ValueError("context_lens must cover each sequence's queries and fit its "
                             "block table")
        xp = self.xp
        out = xp.empty((num_tokens, num_heads, head_dim), dtype=query.dtype)  # (T, H, D)
        window = int(sliding_window or 0)
        group = num_heads // num_kv_heads
        metadata = (block_tables, context_lens, query_start_loc)
        if np.any(q_lens == 1):
            decode_ctx = ctx[q_lens == 1].astype(np.int64)
            span = decode_ctx - (np.maximum(decode_ctx - window, 0) if window else 0)
            part = self._partition_size(group, head_dim, int(span.max()), partition_size)
            num_parts = int(-(-int(span.max()) // part))
            stats_shape = (num_seqs, num_heads, num_parts)
            tmp_out = xp.empty((*stats_shape, head_dim) if num_parts > 1 else (1,), np.float32)
            max_logits = xp.empty(stats_shape if num_parts > 1 else (1,), np.float32)
            exp_sums = xp.empty(stats_shape if num_parts > 1 else (1,), np.float32)
            kernel = self.backend.function("paged_attention_decode.cu",
                                           f"paged_attention_decode_{suffix}_{cache_suffix}")
            kernel((num_kv_heads, num_seqs, num_parts), (_DECODE_THREADS,),
                   (out, tmp_out, max_logits, exp_sums, query, k_cache, v_cache, *metadata,
                    *(np.int32(v) for v in (num_heads, num_kv_heads, head_dim, block_size,
                                            block_tables.shape[1], part, num_parts, window)),
                    np.float32(scale), np.float32(k_scale), np.float32(v_scale)),
                   shared_mem=decode_smem_bytes(group, head_dim, part))
            if num_parts > 1:
                reduce = self.backend.function("paged_attention_decode.cu",
                                               f"paged_attention_reduce_{suffix}")
                reduce((num_heads, num_seqs), (_DECODE_THREADS,),
                       (out, tmp_out, max_logits, exp_sums, context_lens, query_start_loc,
                        *(np.int32(v) for v in (num_heads, head_dim, part, num_parts, window))),
                       shared_mem=4 * (num_parts + 1))
        if np.any(q_lens > 1):
            q_tile, k_tile = prefill_tiles(group, head_dim)
            num_tiles = int(-(-int(q_lens.max()) // q_tile))
            kernel = self.backend.function("paged_attention_prefill.cu",
                                           f"paged_attention_prefill_{suffix}_{cache_suffix}")
            kernel((num_kv_heads, num_seqs, num_tiles), (_PREFILL_THREADS,),
                   (out, query, k_cache, v_cache, *metadata,
                    *(np.int32(v) for v in (num_heads, num_kv_heads, head_dim, block_size,
                                            block_tables.shape[1], q_tile, k_tile, window)),
                    np.float32(scale), np.float32(k_scale), np.float32(v_scale)),
                   shared_mem=prefill_smem_bytes(group, head_dim, q_tile, k_tile))
        return out

    @staticmethod
    def _partition_size(group: int, head_dim: int, max_span: int,
                        requested: int | None) -> int:
        """The requested (or default) partition, shrunk until its scores fit shared memory."""
        part = requested if requested is not None else DEFAULT_PARTITION_SIZE
        if part < 1:
            raise ValueError(f"partition_size must be >= 1, got {part}")
        part = min(part, max_span)
        while part > 32 and decode_smem_bytes(group, head_dim, part) > SMEM_LIMIT:
            part //= 2
        if decode_smem_bytes(group, head_dim, part) > SMEM_LIMIT:
            raise ValueError(f"GQA group {group} x head_dim {head_dim} exceeds the decode "
                             "kernel's shared memory")
        return part

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        suffix = _suffix("x", x)
        if x.ndim != 2 or weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
            raise ValueError(f"x {x.shape} {x.dtype} must be (T, hidden) and weight "
                             f"{weight.shape} {weight.dtype} (hidden,) of the same dtype")
        _contiguous("x", x)
        _contiguous("weight", weight)
        out = self.xp.empty(x.shape, dtype=x.dtype)  # (T, hidden)
        if x.shape[0]:
            self.backend.function("layers.cu", f"rms_norm_{suffix}")(
                (x.shape[0],), (256,), (out, x, weight, np.float32(eps), np.int32(x.shape[1])))
        return out

    def silu_and_mul(self, x: Any) -> Any:
        suffix = _suffix("x", x)
        if x.ndim != 2 or x.shape[1] % 2:
            raise ValueError(f"x must be (T, 2 * intermediate), got {x.shape}")
        _contiguous("x", x)
        inter = x.shape[1] // 2
        out = self.xp.empty((x.shape[0], inter), dtype=x.dtype)  # (T, I)
        if x.shape[0]:
            self.backend.function("layers.cu", f"silu_and_mul_{suffix}")(
                (x.shape[0],), (256,), (out, x, np.int32(inter)))
        return out

    def rope(self, x: Any, positions: Any, cos: Any, sin: Any) -> Any:
        suffix = _suffix("x", x)
        if x.ndim != 3 or x.shape[2] % 2:
            raise ValueError(f"x must be (T, H, D) with D even, got {x.shape}")
        num_tokens, num_heads, head_dim = x.shape
        positions = self.xp.asarray(positions)
        _int_array("positions", positions, "int64", (num_tokens,))
        for name, table in (("cos", cos), ("sin", sin)):
            if table.dtype.name != "float32" or table.ndim != 2 or table.shape[1] != head_dim // 2:
                raise ValueError(f"{name} must be float32 (max_pos, {head_dim // 2}), got "
                                 f"{table.shape} {table.dtype}")
            _contiguous(name, table)
        item = x.dtype.itemsize
        # tokens may be strided (a column slice of the fused qkv output); (H, D) must be dense
        if tuple(x.strides[1:]) != (head_dim * item, item) or x.strides[0] % item:
            raise ValueError(f"x must be contiguous within each token, got strides {x.strides}")
        out = self.xp.empty(x.shape, dtype=x.dtype)  # (T, H, D)
        if num_tokens:
            self.backend.function("layers.cu", f"rope_{suffix}")(
                (num_tokens,), (128,), (out, x, positions, cos, sin, np.int32(num_heads),
                                        np.int32(head_dim), np.int64(x.strides[0] // item)))
        return out
