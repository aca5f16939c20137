"""Bad paged-attention launches raise a ValueError naming the argument before any kernel is
fetched or launched (a recording backend: no GPU, no emulation needed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kernel_problems import paged_problem
from kvcore.kernels.cuda.attention import plan_paged_attention
from kvcore.kernels.cuda.ops import CudaOps


class RecordingBackend:
    """Hands out kernels that only record their launches."""

    xp = np
    num_sms = 8

    def __init__(self) -> None:
        self.fetched: list[tuple[str, str, tuple[str, ...]]] = []
        self.launched: list[str] = []

    def function(self, source: str, name: str, defines: tuple[str, ...] = ()) -> Any:
        self.fetched.append((source, name, defines))
        return lambda grid, block, args, shared_mem=0: self.launched.append(name)

    def pointer_array(self, arrays: Any) -> Any:
        raise AssertionError("not used by paged attention")

    def to_host(self, array: Any) -> np.ndarray:
        return np.asarray(array)


def _problem() -> dict:
    # a mixed batch on fp16 with an fp8 cache: decode and prefill both planned
    return paged_problem(np.random.default_rng(0), [40, 9], [1, 9], 8, 2, 64, 8, "f16-fp8",
                         0.05, 0.02)


def _strided(a: np.ndarray) -> np.ndarray:
    return np.repeat(a, 2, axis=-1)[..., ::2]  # same values, not C-contiguous


BAD: list[tuple[str, Callable[[dict], dict], str]] = [
    ("query dtype", lambda p: {**p, "query": p["query"].astype(np.int32)}, "query must be"),
    ("query rank", lambda p: {**p, "query": p["query"][0]}, r"query \(8, 64\) must be"),
    ("query strided", lambda p: {**p, "query": _strided(p["query"])},
     "query must be C-contiguous"),
    ("k_cache strided", lambda p: {**p, "k_cache": _strided(p["k_cache"])},
     "k_cache must be C-contiguous"),
    ("cache dtype", lambda p: {**p, "k_cache": p["k_cache"].astype(np.float32),
                               "v_cache": p["v_cache"].astype(np.float32)},
     "k_cache dtype float32 cannot hold f16"),
    ("v_cache dtype", lambda p: {**p, "v_cache": p["v_cache"].astype(np.float16)},
     "k_cache and v_cache must share"),
    ("head_dim variant", lambda p: {**p, "query": np.zeros((10, 8, 48), np.float16),
                                    "k_cache": np.zeros((10, 8, 2, 48), p["k_cache"].dtype),
                                    "v_cache": np.zeros((10, 8, 2, 48), p["k_cache"].dtype)},
     r"head_dim must be one of \(16, 32, 64, 128, 256\)"),
    ("group", lambda p: {**p, "query": np.zeros((10, 66, 64), np.float16)},
     "GQA group .* must be <= 32, got 33"),
    ("block_tables dtype", lambda p: {**p, "block_tables": p["block_tables"].astype(np.int64)},
     "block_tables must be int32"),
    ("block_tables rows", lambda p: {**p, "block_tables": p["block_tables"][:1]},
     r"block_tables must be \(2, max_blocks\)"),
    ("context_lens rank", lambda p: {**p, "context_lens": p["context_lens"][None]},
     "context_lens must be 1-D"),
    ("context_lens dtype", lambda p: {**p, "context_lens": p["context_lens"].astype(np.int64)},
     "context_lens must be int32"),
    ("query_start_loc", lambda p: {**p, "query_start_loc": np.array([0, 1, 9], np.int32)},
     "query_start_loc must rise from 0 to 10"),
    ("scale", lambda p: {**p, "scale": float("nan")}, "scale must be a finite number > 0"),
    ("v_scale", lambda p: {**p, "v_scale": 0.0}, "v_scale must be a finite number > 0"),
]


@pytest.mark.parametrize("mutate,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_launch_is_refused_before_any_kernel(mutate: Callable[[dict], dict],
                                                 match: str) -> None:
    backend = RecordingBackend()
    with pytest.raises(ValueError, match=match):
        CudaOps(backend).paged_attention(**mutate(_problem()))
    assert backend.fetched == [] and backend.launched == []


@pytest.mark.parametrize("kwargs,match", [
    ({"partition_tokens": 0}, "partition_tokens must be >= 1, got 0"),
    ({"sliding_window": 0}, "sliding_window must be >= 1 or None, got 0"),
])
def test_bad_options_are_refused(kwargs: dict, match: str) -> None:
    backend = RecordingBackend()
    problem = _problem()
    with pytest.raises(ValueError, match=match):
        plan_paged_attention(backend, **problem, **kwargs)
    assert backend.fetched == []


@pytest.mark.parametrize("heads,kernels", [
    (8, ["paged_attention_decode_tc", "paged_attention_prefill_mma"]),  # group 4: tensor cores
    (4, ["paged_attention_decode", "paged_attention_prefill_mma"]),     # group 2: CUDA cores
])
def test_good_launch_picks_the_variants(heads: int, kernels: list[str]) -> None:
    """A valid mixed batch plans decode (tensor cores from group 4 on) and the register-tile
    prefill, each compiled for its (head_dim, group, dtypes), and launches them in order."""
    backend = RecordingBackend()
    problem = paged_problem(np.random.default_rng(0), [40, 9], [1, 9], heads, 2, 64, 8,
                            "f16-fp8", 0.05, 0.02)
    CudaOps(backend).paged_attention(**problem)
    assert backend.launched == kernels
    assert set(backend.fetched[0][2]) == {"KVC_HEAD_DIM=64", f"KVC_GROUP={heads // 2}",
                                          "KVC_SCALAR=__half", "KVC_CACHE=__nv_fp8_e4m3"}
    assert set(backend.fetched[-1][2]) == {"KVC_HEAD_DIM=64", "KVC_SCALAR=__half",
                                           "KVC_CACHE=__nv_fp8_e4m3"}


@pytest.mark.parametrize("shape,decode,prefill", [
    (("f16", "f16", 4, 128, 16), "paged_attention_decode_tc.cu", "paged_attention_prefill_mma.cu"),
    (("bf16", "fp8", 8, 256, 16), "paged_attention_decode_tc.cu", "paged_attention_prefill_tc.cu"),
    (("f16", "f16", 8, 64, 12), "paged_attention_prefill_tc.cu", "paged_attention_prefill_tc.cu"),
    (("f16", "f16", 2, 64, 16), "paged_attention_decode.cu", "paged_attention_prefill_mma.cu"),
    (("f32", "fp8", 8, 128, 16), "paged_attention_decode.cu", "paged_attention_prefill.cu"),
    (("f16", "int4", 1, 128, 16), "paged_attention_decode_tc.cu",
     "paged_attention_prefill_mma.cu"),
])
def test_the_kernel_table_picks(shape: tuple, decode: str, prefill: str) -> None:
    """variants.pick: the table the planners launch from and compile_check builds from."""
    from kvcore.kernels.cuda.variants import AttentionShape, pick

    s = AttentionShape(*shape)
    assert pick("decode", s).source == decode and pick("prefill", s).source == prefill
