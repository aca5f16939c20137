"""Which CPU attention runs: the compiled numba kernel (default) or the NumPy one (reference and
fallback); the compiled kernel's checks, its disk cache and its start-up warm-up; and the
compiled float32 matmul (kvcore.kernels.cpu.matmul) every float32 linear layer of the CPU
forward runs.

numba caches compiled kernels on disk (next to the source, or under $KVCORE_HOME/numba-cache when
the package directory is read-only), so only a machine's first start compiles; `warm_up` loads
(or compiles) every variant a cache dtype needs before the engine takes requests.

Threads: the kernel runs numba's own pool, kvcore.kernels.cpu.threads.num_threads() threads
($KVCORE_NUM_THREADS). OpenBLAS and numba alternate rather than overlap: a forward pass calls
attention between GEMMs, never beside one; OpenBLAS's workers go to sleep after about 0.1 ms
(OPENBLAS_THREAD_TIMEOUT, set by kvcore/__init__) and numba's (OpenMP) workers at once
(OMP_WAIT_POLICY=PASSIVE when its pool starts), so the two pools do not fight for the cores.
`KVCORE_CPU_ATTENTION=numpy` forces the NumPy kernel.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import structlog

from kvcore.kernels.cpu.kv_int4 import Int4Layer
from kvcore.kernels.cpu.threads import num_threads, run_parallel, split

log = structlog.get_logger("kvcore.kernels")

_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_BF16 = np.dtype(ml_dtypes.bfloat16)
# the planner's cache dtype names -> the NumPy dtype of a CPU cache (as KVCache.storage_dtype)
CPU_CACHE_DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": _BF16,
                    "fp8": _FP8}
# what the kernel gets for the cache it does not read: an fp32 cache as floats, any other as bits
_NO_FLOATS = np.zeros((1, 1, 1, 1), np.float32)
_NO_BITS = np.zeros((1, 1, 1, 1), np.uint8)
# the int4 arguments (window K, V, window_slot, group, blocks per super-block) of a cache
# that is not int4
_NO_INT4 = (np.zeros((1, 1, 1, 1), np.uint16), np.zeros((1, 1, 1, 1), np.uint16),
            np.zeros(1, np.int32), 0, 0)
_MODE_INT4 = 4  # attention_blocks.MODE_INT4 (this module does not import numba)
_compiled: ModuleType | None = None
_load_error: str | None = None
_enabled = os.environ.get("KVCORE_CPU_ATTENTION", "numba") != "numpy"


def _cache_dir() -> None:
    """Point numba's disk cache at $KVCORE_HOME/numba-cache when it cannot write beside the
    package's sources (a read-only install), unless NUMBA_CACHE_DIR already says where."""
    if "NUMBA_CACHE_DIR" in os.environ or os.access(Path(__file__).parent, os.W_OK):
        return
    home = os.environ.get("KVCORE_HOME") or str(Path.home() / ".cache" / "kvcore")
    os.environ["NUMBA_CACHE_DIR"] = str(Path(home) / "numba-cache")


def _start_threads_passive() -> None:
    """Start numba's thread pool with OMP_WAIT_POLICY=PASSIVE (unless the variable is set):
    libgomp's workers otherwise spin between parallel regions, and on a busy machine a region
    then waits for a spinning sibling's time slice (measured on 2 loaded cores: batch 32 x 512
    decode attention 22-37 ms per layer with spinning workers, 3.5 ms with sleeping ones).
    libgomp reads the variable once, when it is loaded, which is here; it is restored after so
    other OpenMP libraries loaded later (torch) keep their own default."""
    if "OMP_WAIT_POLICY" in os.environ:
        _launch_threads()
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        _launch_threads()
    finally:
        del os.environ["OMP_WAIT_POLICY"]


# numba's threading layers, best first: OpenMP (libgomp; its passive workers sleep between
# regions), then numba's own workqueue (always there; one region at a time per process, which
# is how kvcore calls it: the engine thread runs every compiled region). TBB is not tried: its
# workers spin after a region, and its pip wheel is not a kvcore dependency.
THREADING_LAYERS = ("omp", "workqueue")


def _launch_threads() -> None:
    """Start numba's pool on an explicitly chosen threading layer ($NUMBA_THREADING_LAYER when
    set, else the first of THREADING_LAYERS that starts), sized by
    kvcore.kernels.cpu.threads.num_threads(); log which."""
    import numba
    from numba.np.ufunc import parallel

    wanted = os.environ.get("NUMBA_THREADING_LAYER")
    errors = []
    for layer in (wanted,) if wanted else THREADING_LAYERS:
        numba.config.THREADING_LAYER = layer  # type: ignore[attr-defined]
        try:
            parallel._launch_threads()  # what numba's first parallel call does
        except ValueError as exc:  # this layer cannot start here: try the next
            errors.append(f"{layer}: {exc}")
            continue
        break
    else:
        raise ValueError("no numba threading layer starts: " + "; ".join(errors))
    numba.set_num_threads(min(num_threads(), numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    log.info("CPU kernel threads", threads=num_threads(), numba_layer=numba.threading_layer(),
             numba_pool=numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]


def compiled() -> ModuleType | None:
    """kvcore.kernels.cpu.attention, or None when numba cannot be imported (logged once)."""
    global _compiled, _load_error
    if _compiled is None and _load_error is None:
        _cache_dir()
        try:
            from kvcore.kernels.cpu import attention

            _start_threads_passive()
        except (ImportError, ValueError) as exc:  # numba missing, built for another NumPy,
            # or no threading layer it can start (a ValueError from numba)
            _load_error = str(exc)
            log.warning("numba unavailable: CPU paged attention runs the NumPy kernels",
                        error=str(exc))
        else:
            _compiled = attention
    return _compiled


def set_enabled(flag: bool) -> None:
    """Use the compiled kernel (True, when numba is there) or the NumPy one (False)."""
    global _enabled
    _enabled = flag


def active() -> bool:
    """Whether paged attention on NumPy arrays runs the compiled kernel."""
    return _enabled and compiled() is not None


def path_name() -> str:
    return "numba (compiled)" if active() else "numpy (reference)"


def _cache_mode(cache: np.ndarray) -> tuple[int, np.ndarray, np.ndarray] | None:
    """(mode, the cache as float32 or a placeholder, its raw bits as unsigned ints or a
    placeholder), or None for a cache the kernel cannot read. Two compiled variants in all:
    (float32, uint8) serves fp32 and fp8, (float32, uint16) bf16 and fp16."""
    if not cache.flags.c_contiguous:
        return None
    if cache.dtype == np.float32:
        return 0, cache, _NO_BITS
    if cache.dtype == _BF16:
        return 1, _NO_FLOATS, cache.view(np.uint16)
    if cache.dtype == np.float16:
        return 2, _NO_FLOATS, cache.view(np.uint16)
    if cache.dtype == _FP8:
        return 3, _NO_FLOATS, cache.view(np.uint8)
    return None


def supports(query: np.ndarray, k_cache: np.ndarray | Int4Layer,
             v_cache: np.ndarray | Int4Layer) -> bool:
    """Whether the compiled kernel takes these arrays (else the NumPy kernel runs)."""
    if isinstance(k_cache, Int4Layer):
        return active() and query.dtype in (np.float32, np.float16)
    assert not isinstance(v_cache, Int4Layer)
    return (active() and k_cache.dtype == v_cache.dtype and _cache_mode(k_cache) is not None
            and v_cache.flags.c_contiguous and query.dtype in (np.float32, np.float16))


def paged_attention(query: np.ndarray, k_cache: np.ndarray | Int4Layer,
                    v_cache: np.ndarray | Int4Layer, block_tables: np.ndarray,
                    context_lens: np.ndarray, query_start_loc: np.ndarray, scale: float,
                    sliding_window: int | None,
                    k_scale: float, v_scale: float) -> np.ndarray:
    """The compiled kernel, same contract as kvcore.kernels.cpu.paged_attention (shapes checked
    there). Arrays are cast to the one set of types the warm-up compiled: no JIT on a request."""
    kernel = compiled()
    assert kernel is not None
    if isinstance(k_cache, Int4Layer):
        assert isinstance(v_cache, Int4Layer)
        k_mode, k_floats, v_floats = _MODE_INT4, _NO_FLOATS, _NO_FLOATS
        # (num_blocks, 1, 1, row_bytes): four dimensions, as the other dtypes' bits
        k_bits, v_bits = (layer.rows.reshape(layer.rows.shape[0], 1, 1, -1)
                          for layer in (k_cache, v_cache))
        int4 = (k_cache.window.view(np.uint16), v_cache.window.view(np.uint16),
                k_cache.window_slot, v_cache.group, k_cache.window_blocks)
    else:
        assert not isinstance(v_cache, Int4Layer)
        k_mode, k_floats, k_bits = _cache_mode(k_cache)  # type: ignore[misc]
        _, v_floats, v_bits = _cache_mode(v_cache)  # type: ignore[misc]
        int4 = _NO_INT4
    # scale and k_scale folded into the queries: score = (q * scale * k_scale) . stored key
    q = np.multiply(query, np.float32(scale * k_scale), dtype=np.float32)  # (T, H, D) dense
    tables = np.ascontiguousarray(block_tables, dtype=np.int32)
    lens = np.ascontiguousarray(context_lens, dtype=np.int32)
    starts = np.ascontiguousarray(query_start_loc, dtype=np.int32)
    window = int(sliding_window or 0)
    error = kernel.check_batch(tables, lens, starts, k_cache.shape[1], k_cache.shape[0], window)
    if error:
        raise ValueError(kernel.ERRORS[error])
    threads = num_threads()
    kernel.set_threads(threads)
    span = int4[4] * k_cache.shape[1]  # int4: tokens per super-block (tiles end there)
    items, groups, num_rows = kernel.work_items(lens, starts, k_cache.shape[1], window, span)
    out = np.empty(q.shape, np.float32)  # (T, H, D)
    kernel.run(q, k_floats, v_floats, k_bits, v_bits, k_mode, int4, tables, lens, starts, window,
               items, groups, num_rows, float(v_scale), out)
    return out


def warm_up(cache_dtypes: tuple[np.dtype, ...] = (np.dtype(np.float32),)) -> float:
    """Load (or compile, on a machine's first start) the kernel for each cache dtype: a tiny
    mixed batch (a prefill chunk and a decode token, a sliding window) per dtype; and the
    float32 matmul. Returns the seconds it took; logs which attention path the CPU runs."""
    start = time.perf_counter()
    if active():
        rng = np.random.default_rng(0)
        for dtype in cache_dtypes:
            cache = rng.standard_normal((4, 4, 1, 8), dtype=np.float32).astype(dtype)  # bs 4
            query = rng.standard_normal((4, 2, 8), dtype=np.float32)  # (T, H, D): 3 + 1 tokens
            tables = np.array([[0, 1], [2, 3]], np.int32)
            for window in (None, 2):
                paged_attention(query, cache, cache, tables, np.array([3, 5], np.int32),
                                np.array([0, 3, 4], np.int32), 0.3, window, 1.0, 1.0)
        matmul(np.ones((5, 20), np.float32), np.ones((3, 20), np.float32))
    seconds = time.perf_counter() - start
    log.info("CPU paged attention", path=path_name(), warm_up_s=round(seconds, 2))
    return seconds


def warm_up_cpu_kernels(cache_dtype: str) -> float:
    """What the engine calls once at construction, before it takes requests: the compiled
    attention for its cache dtype ("fp32", "fp16", "bf16", "fp8" or "int4"), loaded from
    numba's disk cache or compiled. Returns the seconds it took."""
    if cache_dtype == "int4":
        return warm_up_int4()
    if cache_dtype not in CPU_CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {(*CPU_CACHE_DTYPES, 'int4')}, "
                         f"got {cache_dtype!r}")
    return warm_up((CPU_CACHE_DTYPES[cache_dtype],))


def warm_up_int4() -> float:
    """warm_up for an int4 cache: its attention variant (a sealed and an open block) and the
    sealing quantizer."""
    start = time.perf_counter()
    if active():
        from kvcore.kernels.cpu import kv_int4_blocks

        bs, heads, dim, group = 4, 1, 8, 8
        window = np.zeros((2, bs, heads, dim), np.float16)  # (slots, bs, Hkv, D)
        k_rows = np.zeros((3, kv_int4_blocks.key_row_bytes(bs, heads, dim)), np.uint8)
        v_rows = np.zeros((3, kv_int4_blocks.value_row_bytes(bs, heads, dim, group)), np.uint8)
        slots = np.array([-1, 0, 1], np.int32)
        kv_int4_blocks.seal_blocks(window.view(np.uint16), window.view(np.uint16), k_rows, v_rows,
                                   np.array([0], np.int64), np.array([0], np.int64), group)
        k = Int4Layer(k_rows, window, slots, True, group)
        v = Int4Layer(v_rows, window, slots, False, group)
        query = np.ones((4, 2, dim), np.float32)  # (T, H, D): 3 + 1 tokens
        # each row's own block (one per super-block) in a slot, block 0 sealed behind it
        tables = np.array([[1, 1], [0, 2]], np.int32)
        for sliding in (None, 2):
            paged_attention(query, k, v, tables, np.array([3, 5], np.int32),
                            np.array([0, 3, 4], np.int32), 0.3, sliding, 1.0, 1.0)
        matmul(np.ones((5, 20), np.float32), np.ones((3, 20), np.float32))
    seconds = time.perf_counter() - start
    log.info("CPU paged attention (int4)", path=path_name(), warm_up_s=round(seconds, 2))
    return seconds


ALIGNMENT = 64  # bytes: the matmul's 16-lane loads never split a cache line on such rows
# a thread's share of a matmul must outweigh the hand-off (~0.1 ms on a 2-core VM): at least
# this many bytes of weights x activation rows
MIN_SHARE_BYTES = 256 << 10


def aligned(array: Any, copy: bool = False) -> np.ndarray:
    """A C-contiguous float32 array whose data starts on a 64-byte boundary (the array itself
    when it already does, unless `copy`): rows of a multiple of 16 floats then all start on
    one."""
    array = np.asarray(array)
    if (not copy and array.dtype == np.float32 and array.flags.c_contiguous
            and array.ctypes.data % ALIGNMENT == 0):
        return array
    buffer = np.empty(array.size + ALIGNMENT // 4, np.float32)
    start = (-buffer.ctypes.data % ALIGNMENT) // 4
    out = buffer[start:start + array.size].reshape(array.shape)
    out[...] = array
    return out


def matmul(x: np.ndarray, weight: np.ndarray) -> np.ndarray | None:
    """x (M, in) @ weight (out, in).T for float32 arrays and every M, compiled
    (kvcore.kernels.cpu.matmul: one fixed reduction order per output element, so a row's
    result does not depend on the other rows), split over the kernel threads by output rows;
    None when numba is off or the arrays are not float32 (the caller multiplies them itself).
    x is copied to a 64-byte aligned buffer when it does not start on one (O(M K), against the
    product's O(M K N))."""
    if not (x.ndim == 2 and weight.ndim == 2 and x.dtype == np.float32
            and weight.dtype == np.float32 and x.shape[1] == weight.shape[1] and active()):
        return None
    from kvcore.kernels.cpu import matmul as kernel

    x, weight = aligned(x), (weight if weight.flags.c_contiguous
                             else np.ascontiguousarray(weight))
    num_rows, num_out = x.shape[0], weight.shape[0]
    out = np.empty((num_rows, num_out), dtype=np.float32)  # (M, out)
    if num_rows == 0 or num_out == 0:
        return out
    block = kernel.OUT_BLOCK
    num_blocks = -(-num_out // block)
    share = max(1, MIN_SHARE_BYTES // max(1, block * weight.shape[1] * 4 * num_rows))
    run_parallel(lambda part: kernel.matmul_rows(
        x, weight, out, part.start * block, min(num_out, part.stop * block)),
        split(num_blocks, share))
    return out
