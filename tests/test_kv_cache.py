"""KVCache: per-layer tensors, dtypes, fp8 scales, copy-on-write block copies, bytes used."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kvcore.cache.kv_cache import KVCache


@pytest.mark.parametrize("dtype,np_dtype,itemsize", [
    ("fp32", np.float32, 4), ("auto", np.float32, 4), ("fp16", np.float16, 2),
    ("bf16", ml_dtypes.bfloat16, 2), ("fp8", ml_dtypes.float8_e4m3fn, 1)])
def test_layout_and_bytes(dtype: str, np_dtype, itemsize: int) -> None:
    cache = KVCache(3, 10, 4, 2, 8, dtype)
    assert len(cache.key_caches) == len(cache.value_caches) == 3
    for array in cache.key_caches + cache.value_caches:
        assert array.shape == (10, 4, 2, 8) and array.dtype == np_dtype
        assert not array.astype(np.float32).any()
    assert len({id(a) for a in cache.key_caches + cache.value_caches}) == 6
    assert cache.num_bytes == 2 * 3 * 10 * 4 * 2 * 8 * itemsize
    assert cache.num_bytes == sum(a.nbytes for a in cache.key_caches + cache.value_caches)


def test_copy_blocks_every_layer() -> None:
    rng = np.random.default_rng(0)
    cache = KVCache(2, 6, 4, 2, 8)
    for array in cache.key_caches + cache.value_caches:
        array[...] = rng.standard_normal(array.shape)
    before = [a.copy() for a in cache.key_caches + cache.value_caches]
    cache.copy_blocks([(1, 4), (2, 0)])
    for array, old in zip(cache.key_caches + cache.value_caches, before, strict=True):
        np.testing.assert_array_equal(array[4], old[1])
        np.testing.assert_array_equal(array[0], old[2])
        np.testing.assert_array_equal(array[[1, 2, 3, 5]], old[[1, 2, 3, 5]])
    cache.copy_blocks([])
    with pytest.raises(ValueError, match="outside"):
        cache.copy_blocks([(0, 6)])


def test_scales_and_bad_arguments() -> None:
    cache = KVCache(2, 4, 4, 1, 8, "fp8", k_scales=[0.5, 2.0], v_scales=[1.0, 0.25])
    assert cache.layer(1)[2:] == (2.0, 0.25)
    assert KVCache(2, 4, 4, 1, 8).layer(0)[2:] == (1.0, 1.0)
    with pytest.raises(ValueError, match="k_scales"):
        KVCache(2, 4, 4, 1, 8, "fp8", k_scales=[1.0])
    with pytest.raises(ValueError, match="dtype"):
        KVCache(2, 4, 4, 1, 8, "int8")
    with pytest.raises(ValueError, match="num_blocks"):
        KVCache(2, 0, 4, 1, 8)
