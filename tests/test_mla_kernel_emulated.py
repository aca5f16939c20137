"""The MLA tensor-core kernel (mla_attention.cu), run unchanged on the CPU by the emulation
harness, equals the float64 oracle and the NumPy reference on fresh random inputs: decode rows
with and without split-KV, prefill chunks beside them, fp16 / bf16 / fp8 caches."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from kvcore.kernels.cpu import mla as reference
from kvcore.kernels.cuda.mla import mla_smem_bytes
from kvcore.kernels.cuda.ops import CudaOps

pytest.importorskip("cupy", reason="cupy's CCCL headers provide <nv/target> for cuda_fp16.h")
if shutil.which("g++") is None:
    pytest.skip("the emulation harness needs g++", allow_module_level=True)

from cuda_emu import EmuBackend  # noqa: E402
from kernel_problems import BF16, mla_f64, mla_problem  # noqa: E402

TOL = {np.dtype(np.float16): 2e-3, BF16: 1.6e-2}


def ops(defines: tuple[str, ...] = (), seed: int = 0, num_sms: int = 8) -> CudaOps:
    return CudaOps(EmuBackend(defines, order_seed=seed, num_sms=num_sms))


def check(problem: dict, num_partitions: int | None = None, host_metadata: bool | None = None,
          seed: int = 0) -> np.ndarray:
    out = ops(seed=seed).mla_paged_attention(**problem, num_partitions=num_partitions,
                                             host_metadata=host_metadata)
    expected = mla_f64(problem)
    assert out.dtype == problem["query"].dtype and out.shape == expected.shape
    tol = TOL[out.dtype]
    np.testing.assert_allclose(out.astype(np.float32), expected, rtol=tol, atol=tol)
    # the CPU path's function too (which may read the NaN-poisoned free slots of a block it
    # uses and mask them by multiplication: free slots hold finite values in a real cache)
    cache = problem["cache"]
    finite = np.where(np.isnan(cache.astype(np.float32)), 0, cache).astype(cache.dtype)
    cpu = reference.mla_paged_attention(**dict(problem, cache=finite))
    np.testing.assert_allclose(out.astype(np.float32), cpu.astype(np.float32), rtol=tol,
                               atol=tol)
    return out


CASES = [
    # (H, kv_lora_rank, rope dim, block_size, context_lens, q_lens, dtypes, num_partitions)
    (16, 64, 16, 16, [1, 15, 16, 17, 100], [1] * 5, "f16", None),  # block edges, SM-count split
    (32, 128, 32, 8, [77, 9], [1, 1], "bf16", 3),                 # split KV, last part short
    (16, 128, 16, 16, [130, 5], [1, 1], "f16-fp8", 2),            # fp8 with a scale
    (32, 64, 32, 4, [45, 2], [1, 1], "bf16-fp8", 1),
    (16, 64, 16, 8, [20, 37, 9], [20, 1, 4], "f16", 2),           # prompt, decode, chunk
    (24, 64, 16, 8, [13, 30], [13, 6], "f16", None),              # tiles straddle positions
    (32, 64, 32, 16, [40, 70], [17, 1], "f16-fp8", None),         # chunk beside a decode row
    (128, 512, 64, 16, [100, 20], [1, 3], "f16-fp8", 2),          # DeepSeek's: 32-key tiles
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}r{c[1]}p{c[2]}-{c[6]}")
def test_mla_attention(case: tuple) -> None:
    heads, rank, rope, bs, ctx, q_lens, dtypes, parts = case
    rng = np.random.default_rng()
    kv_scale = 0.05 if dtypes.endswith("fp8") else 1.0
    check(mla_problem(rng, ctx, q_lens, heads, rank, rope, bs, dtypes, kv_scale), parts)


def test_random_cases() -> None:
    """Random head counts (tiles cut anywhere in a position's heads), contexts, chunk lengths,
    block sizes and partitions over the variants built above; KVCORE_EMU_CASES=N runs N."""
    variants = sorted({(c[1], c[2], c[6]) for c in CASES})
    for _ in range(int(os.environ.get("KVCORE_EMU_CASES", "2"))):
        rng = np.random.default_rng()
        rank, rope, dtypes = variants[int(rng.integers(len(variants)))]
        num_seqs = int(rng.integers(1, 4))
        ctx = rng.integers(1, 80, size=num_seqs)
        q_lens = np.where(rng.random(num_seqs) < 0.5, 1, rng.integers(1, ctx + 1))
        kv_scale = 0.05 if dtypes.endswith("fp8") else 1.0
        problem = mla_problem(rng, ctx.tolist(), q_lens.tolist(), int(rng.integers(1, 41)), rank,
                              rope, int(rng.choice([4, 8, 16])), dtypes, kv_scale)
        check(problem, int(rng.integers(1, 5)), host_metadata=bool(rng.random() < 0.5))


def test_device_metadata_grids_from_shapes() -> None:
    """Device metadata: nothing read back, grids sized from the shapes; the same results."""
    rng = np.random.default_rng()
    problem = mla_problem(rng, [33, 12, 50], [1, 12, 1], 16, 64, 16, 8, "f16")
    check(problem, num_partitions=3, host_metadata=False)


def test_thread_order_does_not_change_results() -> None:
    rng = np.random.default_rng()
    problem = mla_problem(rng, [70, 21], [1, 5], 24, 64, 16, 8, "f16")
    outs = [check(problem, 2, seed=seed) for seed in (0, 1)]
    assert np.array_equal(outs[0], outs[1])


def test_missing_barrier_fails() -> None:
    """The mutant without the barrier after staging: the comparison must catch it."""
    rng = np.random.default_rng()
    problem = mla_problem(rng, [40, 23], [1, 7], 16, 64, 16, 8, "f16")
    broken = ops(("KVC_BREAK_SYNC",)).mla_paged_attention(**problem)
    assert not np.allclose(broken.astype(np.float32), mla_f64(problem), rtol=1e-2, atol=1e-2)


def test_arguments_are_checked() -> None:
    rng = np.random.default_rng()
    problem = mla_problem(rng, [9], [1], 16, 64, 16, 4, "f16")
    with pytest.raises(ValueError, match="multiples of 16"):
        ops().mla_paged_attention(**dict(problem, kv_lora_rank=56))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        ops().mla_paged_attention(**dict(problem, query=problem["query"].astype(np.float32)))
    with pytest.raises(ValueError, match="kv_scale must be"):
        ops().mla_paged_attention(**dict(problem, kv_scale=0.0))
    with pytest.raises(ValueError, match="block_tables must be int32"):
        ops().mla_paged_attention(**dict(problem,
                                         block_tables=problem["block_tables"].astype(np.int64)))
    with pytest.raises(ValueError, match="query width"):
        ops().mla_paged_attention(**dict(problem, query=problem["query"][:, :, :64].copy()))


def test_shared_memory_of_deepseek_shape() -> None:
    """DeepSeek-V2/V3's 512 + 64: 64 query rows and two buffers of key tiles: 64-key tiles of a
    16-bit cache need swizzled (unpadded) rows to fit sm_90's 227 KB (225.75 KB), sm_80 takes
    32-key tiles (151.75 KB of its 163 KB); fp8's 64-key tiles fit both (156.75 KB)."""
    assert mla_smem_bytes(512, 64) == 64 * 1152 + 2 * 64 * 1152 + 64 * 144 + 768 == 231168
    assert mla_smem_bytes(512, 64, 2, 32) == 155392
    assert mla_smem_bytes(512, 64, 1) == 64 * 1168 + 2 * 64 * 592 + 64 * 144 + 768 == 160512
    assert mla_smem_bytes(64, 16) == 64 * 176 + 2 * 64 * 176 + 64 * 144 + 3 * 64 * 4
    assert mla_smem_bytes(960, 64) == 64 * 2064 + 2 * 16 * 2064 + 64 * 48 + 3 * 64 * 4


@pytest.mark.parametrize("dtypes", ["f16", "bf16-fp8"])
def test_cache_latent_and_shared_block_copies(dtypes: str) -> None:
    """The latent-cache write equals the CPU's byte for byte; copy-on-write of a shared K/V
    cache (no separate V arrays) copies each block once per layer."""
    from kernel_problems import DTYPES

    act, cache_dtype = DTYPES[dtypes]
    rng = np.random.default_rng()
    entries = (rng.standard_normal((7, 1, 48)) * 20).astype(act)  # (T, 1, r + Dr)
    slots = rng.permutation(6 * 4)[:7].astype(np.int64)
    slots[2] = -1  # a padding row is skipped
    scale = 0.1 if dtypes.endswith("fp8") else 1.0
    garbage = rng.standard_normal((6, 4, 1, 48)).astype(np.float32).astype(cache_dtype)
    got, want = garbage.copy(), garbage.copy()
    ops().cache_latent(entries, got, slots, scale)
    reference.cache_latent(entries, want, slots, scale)
    assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()
    layers = [got, got.copy() * 2]
    expected = [c.copy() for c in layers]
    mapping = np.array([[0, 5], [3, 1]], dtype=np.int64)
    ops().copy_blocks(layers, [], mapping)
    for cache in expected:
        cache[[5, 1]] = cache[[0, 3]]
    for g, w in zip(layers, expected, strict=True):
        assert g.view(np.uint8).tobytes() == w.view(np.uint8).tobytes()
