"""Shared pieces of the CUDA launch wrappers: the backend protocol, launches, argument checks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

Kernel = Callable[..., None]  # kernel(grid, block, args, shared_mem=...) as cupy.RawKernel
SMEM_LIMIT = 48 * 1024  # dynamic shared memory a kernel gets without opting in
_SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
# CuPy has no bf16 or fp8 dtype: there caches hold the raw bits (uint16 / uint8, see KVCache)
_CACHE_SUFFIX = {**_SUFFIX, "uint16": "bf16", "float8_e4m3fn": "fp8", "uint8": "fp8"}
# (activation, cache) pairs with instantiated kernels
_CACHE_PAIRS = {("f32", "f32"), ("f32", "f16"), ("f32", "bf16"), ("f32", "fp8"),
                ("f16", "f16"), ("f16", "fp8"), ("bf16", "bf16"), ("bf16", "fp8")}


@dataclass(frozen=True, slots=True)
class Launch:
    """One prepared kernel launch; calling it only enqueues the kernel (no host sync)."""

    kernel: Kernel
    grid: tuple[int, ...]
    block: tuple[int, ...]
    args: tuple[Any, ...]
    shared_mem: int = 0

    def __call__(self) -> None:
        self.kernel(self.grid, self.block, self.args, shared_mem=self.shared_mem)


class Backend(Protocol):
    xp: Any

    @property
    def num_sms(self) -> int:
        """Streaming multiprocessors of the device (split-KV sizing)."""

    def function(self, source: str, name: str, defines: tuple[str, ...] = ()) -> Kernel: ...

    def pointer_array(self, arrays: Sequence[Any]) -> Any: ...

    def to_host(self, array: Any) -> np.ndarray: ...


def suffix_of(name: str, array: Any) -> str:
    suffix = _SUFFIX.get(array.dtype.name)
    if suffix is None:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {array.dtype}")
    return suffix


def cache_suffix_of(name: str, cache: Any, activation_suffix: str) -> str:
    suffix = _CACHE_SUFFIX.get(cache.dtype.name)
    if (activation_suffix, suffix) not in _CACHE_PAIRS:
        raise ValueError(f"{name} dtype {cache.dtype} cannot hold {activation_suffix} "
                         "activations: use the same dtype, fp8 (float8_e4m3fn / uint8), or any "
                         "cache dtype with float32 activations")
    return str(suffix)


def check_contiguous(name: str, array: Any) -> None:
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def check_int_array(name: str, array: Any, dtype: str,
                    shape: tuple[int, ...] | None = None) -> None:
    if array.dtype.name != dtype:
        raise ValueError(f"{name} must be {dtype}, got {array.dtype}")
    if shape is not None and tuple(array.shape) != shape:
        raise ValueError(f"{name} shape {tuple(array.shape)} != {shape}")
    check_contiguous(name, array)


def check_seq_metadata(backend: Backend, block_tables: Any, context_lens: Any,
                       query_start_loc: Any, num_tokens: int, block_size: int,
                       host_metadata: bool | None
                       ) -> tuple[int, int, tuple[np.ndarray, np.ndarray] | None]:
    """The sequence metadata of a paged-attention launch: (num_seqs, max_blocks, host lens).
    Host lens: ((S,) query lengths, (S,) context lengths) int64, read on the host and checked,
    when the metadata is on the host (`host_metadata` None = decide by type); None for device
    metadata, which is never read back (the grids then come from the shapes)."""
    if context_lens.ndim != 1:
        raise ValueError(f"context_lens must be 1-D (num_seqs,), got shape {context_lens.shape}")
    num_seqs = context_lens.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be ({num_seqs}, max_blocks), "
                         f"got {block_tables.shape}")
    max_blocks = block_tables.shape[1]
    if host_metadata is None:
        host_metadata = isinstance(query_start_loc, np.ndarray) and isinstance(context_lens,
                                                                               np.ndarray)
    if not host_metadata:
        return num_seqs, max_blocks, None
    qsl = np.asarray(backend.to_host(query_start_loc)).astype(np.int64)
    ctx = np.asarray(backend.to_host(context_lens)).astype(np.int64)
    q_lens = np.diff(qsl)
    if qsl.shape != (num_seqs + 1,) or qsl[0] != 0 or qsl[-1] != num_tokens or \
            np.any(q_lens < 0):
        raise ValueError(f"query_start_loc must rise from 0 to {num_tokens}, got {qsl}")
    if np.any(q_lens > ctx) or np.any(-(-ctx // block_size) > max_blocks):
        raise ValueError("context_lens must cover each sequence's queries and fit its "
                         "block table")
    return num_seqs, max_blocks, (q_lens, ctx)


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What sizes a paged-attention launch: exact from host metadata, else bounds from the
    shapes alone (every other sequence holds at least one of the T tokens)."""
    num_seqs: int
    max_blocks: int
    num_decode: int | None  # decode rows (one query token); None: unknown, any may be
    decode_span: int  # most keys one decode row attends to (the sliding window included)
    max_q_len: int


def batch_shape(backend: Backend, block_tables: Any, context_lens: Any, query_start_loc: Any,
                num_tokens: int, block_size: int, host_metadata: bool | None,
                window: int) -> BatchShape:
    """check_seq_metadata, then the batch's decode rows, decode span and longest query."""
    num_seqs, max_blocks, host_lens = check_seq_metadata(
        backend, block_tables, context_lens, query_start_loc, num_tokens, block_size,
        host_metadata)
    if host_lens is None:
        span = max_blocks * block_size
        return BatchShape(num_seqs, max_blocks, None, min(window, span) if window else span,
                          num_tokens - num_seqs + 1)
    q_lens, ctx = host_lens
    decode_ctx = ctx[q_lens == 1]
    span = int((np.minimum(decode_ctx, window) if window else decode_ctx).max(initial=0))
    return BatchShape(num_seqs, max_blocks, int(decode_ctx.shape[0]), span,
                      int(q_lens.max(initial=0)))


def upload_seq_metadata(xp: Any, block_tables: Any, context_lens: Any, query_start_loc: Any,
                        num_seqs: int) -> tuple[Any, Any, Any]:
    """The metadata on the device (one upload each, a no-op for device arrays), dtypes and
    shapes checked: (block_tables, context_lens, query_start_loc)."""
    block_tables, context_lens, query_start_loc = (
        xp.asarray(a) for a in (block_tables, context_lens, query_start_loc))
    check_int_array("context_lens", context_lens, "int32", (num_seqs,))
    check_int_array("query_start_loc", query_start_loc, "int32", (num_seqs + 1,))
    check_int_array("block_tables", block_tables, "int32")
    return block_tables, context_lens, query_start_loc
