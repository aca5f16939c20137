"""The int4 cache's CUDA writes under the emulator: the seal is bit-exact against
kvcore.cache.int4 (every code, scale 0, NaN / inf, random), the window write lands in the
window slot of each token's block, and the wrappers refuse what would corrupt the cache."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kvcore.cache import int4
from kvcore.kernels.cuda import kv_int4
from kvcore.kernels.cuda.ops import CudaOps

pytest.importorskip("cupy", reason="cupy's CCCL headers provide <nv/target> for cuda_fp16.h")
if shutil.which("g++") is None:
    pytest.skip("the emulation harness needs g++", allow_module_level=True)

from cuda_emu import EmuBackend  # noqa: E402


def ops() -> CudaOps:
    return CudaOps(EmuBackend())


def special_window(rng: np.random.Generator, num_slots: int, block_size: int, heads: int,
                   head_dim: int) -> np.ndarray:
    """Random fp16 windows (num_slots, block_size, heads, head_dim) with the quantizer's edge
    cases planted: every code 0-15 along a key channel and a value group, constant channels and
    groups (scale 0), NaN, +-inf, +-65504, tiny spans (scale rounds to a subnormal or 0)."""
    w = (rng.standard_normal((num_slots, block_size, heads, head_dim)) * 3).astype(np.float16)
    ramp = np.arange(block_size, dtype=np.float32) % 16  # codes 0..15 down a key channel
    w[0, :, 0, 0] = ramp * 0.25
    w[0, 0, 0, 8:24] = np.arange(16) * 0.5  # codes 0..15 along one value group
    w[0, :, 0, 1] = 1.5  # constant key channel: scale 0
    w[0, 3, 0, 32:] = -2.0  # a constant value group: scale 0
    w[0, 1, 0, 2] = np.nan
    w[0, 2, 0, 3], w[0, 4, 0, 3] = np.inf, -np.inf
    w[0, 5, 0, 4], w[0, 6, 0, 4] = 65504, -65504
    w[0, :, 0, 5] = np.float16(1e-4) + np.arange(block_size) * np.float16(6e-8)  # subnormal
    w[0, :, 0, 6] = np.float16(2.0) * (1 + (np.arange(block_size) % 2) * np.float16(2 ** -10))
    w[0, 7, 0, 40:44] = [np.nan, np.inf, -np.inf, 0.0]
    return w


@pytest.mark.parametrize("block_size,heads,head_dim,group",
                         [(16, 2, 64, 32), (32, 1, 64, 64), (16, 3, 128, 32), (32, 2, 128, 64)])
def test_seal_is_bit_exact(block_size: int, heads: int, head_dim: int, group: int) -> None:
    rng = np.random.default_rng()
    num_blocks, num_slots, layers = 6, 3, 2
    windows = [special_window(rng, num_slots, block_size, heads, head_dim)
               for _ in range(2 * layers)]
    k_rows = int4.key_row_bytes(block_size, heads, head_dim)
    v_rows = int4.value_row_bytes(block_size, heads, head_dim, group)
    assert (k_rows, v_rows) == (kv_int4.key_row_bytes(block_size, heads, head_dim),
                                kv_int4.value_row_bytes(block_size, heads, head_dim, group))
    caches = [rng.integers(0, 256, (num_blocks, n), dtype=np.uint8)
              for _ in range(layers) for n in (k_rows, v_rows)]
    before = [c.copy() for c in caches]
    pairs = np.array([[4, 0], [1, 2], [0, 1]], dtype=np.int64)
    ops().seal_blocks(caches[0::2], caches[1::2], windows[0::2], windows[1::2], pairs, group)
    for layer in range(layers):
        k_cache, v_cache = caches[2 * layer], caches[2 * layer + 1]
        for block in range(num_blocks):
            if block not in pairs[:, 0]:  # untouched
                assert np.array_equal(k_cache[block], before[2 * layer][block])
                assert np.array_equal(v_cache[block], before[2 * layer + 1][block])
        for block, slot in pairs.tolist():
            k = windows[2 * layer][slot].astype(np.float32)
            v = windows[2 * layer + 1][slot].astype(np.float32)
            want_k = int4.quantize_key_block(k)
            want_v = int4.quantize_value_block(v, group)
            assert k_cache[block].tobytes() == want_k.tobytes(), (layer, block)
            assert v_cache[block].tobytes() == want_v.tobytes(), (layer, block)
    # the planted cases are reached: every code, and scale 0, appear in the sealed K row
    codes = k_cache[4, :block_size * heads * head_dim // 2]
    assert set((codes & 0xF).tolist()) | set((codes >> 4).tolist()) == set(range(16))
    params = k_cache[4, block_size * heads * head_dim // 2:].view(np.float16)
    assert params[1] == 0 and np.isfinite(params).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_write_goes_to_the_window_slot(dtype: type) -> None:
    rng = np.random.default_rng()
    block_size, heads, dim, num_blocks = 16, 2, 64, 5
    key = rng.standard_normal((6, heads, dim)).astype(dtype)
    value = rng.standard_normal((6, heads, dim)).astype(dtype)
    window_slot = np.array([-1, 1, -1, 0, -1], dtype=np.int32)
    slots = np.array([3 * 16 + 0, 3 * 16 + 15, 1 * 16 + 7, -1, 1 * 16 + 8, 3 * 16 + 1],
                     dtype=np.int64)
    k_window = rng.standard_normal((2, block_size, heads, dim)).astype(np.float16)
    v_window = rng.standard_normal((2, block_size, heads, dim)).astype(np.float16)
    want_k, want_v = k_window.copy(), v_window.copy()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            w = window_slot[slot // block_size]
            want_k[w, slot % block_size] = key[t].astype(np.float16)
            want_v[w, slot % block_size] = value[t].astype(np.float16)
    ops().reshape_and_cache_int4(key, value, k_window, v_window, window_slot, slots)
    assert k_window.tobytes() == want_k.tobytes() and v_window.tobytes() == want_v.tobytes()
    with pytest.raises(ValueError, match="sealed int4 block"):
        ops().reshape_and_cache_int4(key, value, k_window, v_window, window_slot,
                                     np.array([0, -1, -1, -1, -1, -1], np.int64))
    with pytest.raises(ValueError, match="slot outside"):
        ops().reshape_and_cache_int4(key, value, k_window, v_window, window_slot,
                                     np.full(6, num_blocks * block_size, np.int64))
    assert k_window.tobytes() == want_k.tobytes()  # refused writes changed nothing


def test_seal_checks_its_arguments() -> None:
    rows = (kv_int4.key_row_bytes(16, 1, 64), kv_int4.value_row_bytes(16, 1, 64, 32))
    k, v = (np.zeros((3, n), np.uint8) for n in rows)
    win = np.zeros((2, 16, 1, 64), np.float16)
    with pytest.raises(ValueError, match="at most once"):
        ops().seal_blocks([k], [v], [win], [win], np.array([[1, 0], [1, 1]]), 32)
    with pytest.raises(ValueError, match="window slot outside"):
        ops().seal_blocks([k], [v], [win], [win], np.array([[1, 2]]), 32)
    with pytest.raises(ValueError, match="v_cache must be uint8"):
        ops().seal_blocks([k], [v], [win], [win], np.array([[1, 0]]), 64)
    with pytest.raises(ValueError, match="int4 group"):
        ops().seal_blocks([k], [v], [win], [win], np.array([[1, 0]]), 12)
