"""The unchanged CUDA kernels, run on the CPU by the emulation harness, equal the NumPy references.

The launches go through kvcore.kernels.cuda.ops (the same wrappers the GPU path uses) with the
emulation backend; inputs are fresh random data. KVCORE_EMU_CASES=N adds N random decode cases.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from kvcore.kernels import cpu as reference
from kvcore.kernels.cuda.attention import decode_tc_blocks_per_sm
from kvcore.kernels.cuda.occupancy import (
    MAX_PARTITIONS,
    blocks_per_sm,
    decode_partitions,
    split_grid,
    split_partitions,
)
from kvcore.kernels.cuda.ops import CudaOps

pytest.importorskip("cupy", reason="cupy's CCCL headers provide <nv/target> for cuda_fp16.h")
if shutil.which("g++") is None:
    pytest.skip("the emulation harness needs g++", allow_module_level=True)

from cuda_emu import EmuBackend  # noqa: E402
from kernel_problems import BF16, DTYPES, FP8, attention_f64, paged_problem  # noqa: E402

TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2e-3, BF16: 1.6e-2}


def ops(seed: int = 0, defines: tuple[str, ...] = ()) -> CudaOps:
    return CudaOps(EmuBackend(defines, order_seed=seed))


def check_attention(problem: dict, sliding_window: int | None = None,
                    partition_tokens: int | None = None, seed: int = 0,
                    num_sms: int = 8) -> np.ndarray:
    """The kernels' output against the float64 oracle (and the CPU path's dtype and shape)."""
    backend = EmuBackend(order_seed=seed, num_sms=num_sms)
    out = CudaOps(backend).paged_attention(**problem, sliding_window=sliding_window,
                                           **({} if partition_tokens is None else
                                              {"partition_tokens": partition_tokens}))
    expected = attention_f64(problem, sliding_window)
    assert out.dtype == problem["query"].dtype and out.shape == expected.shape
    tol = TOL[out.dtype]
    np.testing.assert_allclose(out.astype(np.float32), expected, rtol=tol, atol=tol)
    return out


DECODE_CASES = [
    # (H, Hkv, D, block_size, context_lens, dtypes, partition_tokens, window); groups of 4+ with
    # fp16 / bf16 activations run on the tensor-core kernel in decode mode
    (4, 4, 64, 16, [1, 15, 16, 17], "f16", None, None),     # GQA 1, block edges
    (6, 2, 64, 16, [100, 513, 17], "bf16", 176, None),        # 3:1, split KV
    (16, 2, 128, 16, [513, 1, 100], "f16", 130, None),        # 8:1
    (16, 1, 128, 8, [4097], "f16-fp8", None, None),         # 16:1, 9 partitions of 512
    (8, 1, 256, 16, [15, 100], "bf16-fp8", 32, 50),          # 8:1 head_dim 256, window
    (3, 1, 256, 16, [513, 2], "f32", 112, None),              # 3:1 fp32, empty partitions
    (8, 8, 128, 16, [100, 33], "f32-fp8", 16, 40),           # 1:1 fp8, window over partitions
    (12, 1, 16, 4, [9, 30], "f16-fp8", 12, None),            # MQA 12: rows narrower than a warp
    (4, 2, 32, 8, [23, 9], "f32-f16", 8, 10),               # fp32 model, fp16 cache
    (6, 2, 32, 8, [19, 45], "f32-bf16", None, 20),
    (16, 2, 64, 16, [100, 513], "f32-f16", 176, None),        # 8:1 on the fp32 (CUDA-core) kernel
    (32, 1, 64, 16, [200, 3], "f16", 112, None),              # 32:1: two row blocks, 2 key slices
    (16, 2, 32, 12, [100, 30], "f16", 48, None),             # block size 12: the smem-tile kernel
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"H{c[0]}kv{c[1]}D{c[2]}-{c[5]}")
def test_decode_attention(case: tuple) -> None:
    heads, kv_heads, dim, bs, ctx, dtypes, parts, window = case
    rng = np.random.default_rng()
    scales = (0.05, 0.02) if dtypes.endswith("fp8") else (1.0, 1.0)
    problem = paged_problem(rng, ctx, [1] * len(ctx), heads, kv_heads, dim, bs, dtypes, *scales,
                            poison=True)
    check_attention(problem, window, parts)


def test_decode_16k_context() -> None:
    """One long context: 16,385 tokens (1,025 blocks of 16), split by the SM count."""
    rng = np.random.default_rng()
    problem = paged_problem(rng, [16385], [1], 8, 1, 128, 16, "f16", poison=True)
    check_attention(problem, num_sms=16)


def test_random_decode_cases() -> None:
    for _ in range(int(os.environ.get("KVCORE_EMU_CASES", "1"))):
        rng = np.random.default_rng()
        kv_heads = int(rng.integers(1, 4))
        heads = kv_heads * int(rng.choice([1, 2, 3, 4, 8]))
        ctx = rng.integers(1, 90, size=int(rng.integers(1, 4))).tolist()
        problem = paged_problem(rng, ctx, [1] * len(ctx), heads, kv_heads, 16,
                                int(rng.choice([4, 8, 16])), str(rng.choice(list(DTYPES))),
                                poison=True)
        window = int(rng.integers(1, 60)) if rng.random() < 0.5 else None
        check_attention(problem, window, int(rng.integers(1, 64)))


def test_split_partitions_follow_the_span_alone() -> None:
    """GQA decode: a sequence's partitions are runs of at least 512 tokens (32 blocks of 16),
    at most 32 of them, whatever else is in the batch; the grid takes the batch's most."""
    assert split_partitions(256, 16) == 8  # 4k: 8 partitions of 512 tokens
    assert split_partitions(1024, 16) == MAX_PARTITIONS  # 16k: 32 of 512
    assert split_partitions(4096, 16) == MAX_PARTITIONS  # 64k: 32 of 2k
    assert split_partitions(33, 16) == 2 and split_partitions(32, 16) == 1
    assert split_grid(256, 16) == 8 and split_grid(8192, 16) == MAX_PARTITIONS
    assert max(split_partitions(n, 16) for n in range(1, 5000)) == MAX_PARTITIONS


def test_decode_partitions_follow_the_sm_count() -> None:
    """MLA: few (sequences x row tiles) on many SMs split more; long spans allow more
    partitions; the count never exceeds the cap, whatever max_model_len a CUDA graph pads to."""
    assert decode_partitions(1, 1024, 16, 132) == MAX_PARTITIONS  # batch 1 x 16k
    # batch 64 x 4k, 8 KV heads: 512 blocks fill 97% of one wave of 4 x 132 slots already
    assert decode_partitions(64 * 8, 256, 16, 132) == 1
    assert decode_partitions(256 * 8, 1024, 16, 132) == 1
    assert decode_partitions(1, 32, 16, 132) == 2  # 512 tokens: 256 per partition at least
    assert decode_partitions(4, 8192, 16, 132) == MAX_PARTITIONS  # 128k-wide graph tables
    # whole waves at 2 resident blocks per SM (264 slots): batch 8 x 4k, 8 KV heads takes 4
    # partitions (256 blocks, 97% of one wave), not the 2.18 waves of 9
    assert decode_partitions(8 * 8, 256, 16, 132, resident=2) == 4
    assert decode_partitions(8, 1024, 16, 132, resident=2) == MAX_PARTITIONS  # b1 x 16k
    with pytest.raises(ValueError, match="num_sms and resident must be >= 1"):
        decode_partitions(1, 4, 16, 0)


def test_resident_blocks_follow_registers_and_shared_memory() -> None:
    # 4 warps of 168 registers (launch bounds ask for 3 blocks): 21,504 per block, 3 in 64k
    # registers and 3 in 228 KB of shared memory (69,632 + 1,024 each)
    assert decode_tc_blocks_per_sm(128, 2) == 3
    assert decode_tc_blocks_per_sm(256, 2) == 1  # 255 registers, 135 KB
    assert blocks_per_sm(128, 64, 0) == 8  # registers: 65,536 / (128 x 64)
    assert blocks_per_sm(256, 16, 0) == 8  # threads: 2048 / 256
    assert blocks_per_sm(128, 32, 100 * 1024) == 2  # shared memory


PREFILL_CASES = [
    # (H, Hkv, D, block_size, context_lens, q_lens, dtypes, window); f16 / bf16 activations run
    # the tensor-core kernel, f32 ones the fp32 kernel
    (6, 2, 16, 8, [13, 40, 6], [1, 17, 6], "f32", None),    # decode + chunk after a prefix + prompt
    (4, 4, 16, 4, [30, 21], [30, 5], "f32", 7),             # 1:1, sliding window
    (8, 1, 16, 8, [25, 3], [9, 3], "f16-fp8", None),        # MQA 8:1
    (16, 2, 32, 16, [40, 1], [20, 1], "f16", 12),           # 8:1, window, with a decode row
    (4, 2, 16, 8, [12, 7], [12, 3], "f32-bf16", None),      # fp32 model, bf16 cache
    (2, 2, 64, 16, [100, 17, 15], [100, 16, 1], "f16", None),  # 1:1: two Q tiles, decode row
    (6, 2, 128, 16, [150, 40], [70, 40], "bf16", None),     # 3:1, chunk over a cached prefix
    (16, 2, 128, 8, [90, 33], [37, 1], "f16-fp8", 50),      # 8:1 fp8, window, mixed batch
    (16, 1, 256, 16, [70], [9], "bf16-fp8", None),          # 16:1 head_dim 256 (32-key tiles)
    (3, 1, 256, 16, [33, 80], [33, 80], "f16", 20),         # 3:1 (63 of 64 rows), window
]


@pytest.mark.parametrize("case", PREFILL_CASES,
                         ids=lambda c: f"H{c[0]}kv{c[1]}D{c[2]}-{c[6]}-w{c[7]}")
def test_prefill_attention(case: tuple) -> None:
    heads, kv_heads, dim, bs, ctx, q_lens, dtypes, window = case
    rng = np.random.default_rng()
    scales = (0.05, 0.02) if dtypes.endswith("fp8") else (1.0, 1.0)
    problem = paged_problem(rng, ctx, q_lens, heads, kv_heads, dim, bs, dtypes, *scales,
                            poison=True)
    check_attention(problem, window)


@pytest.mark.parametrize("window", [None, 9])
def test_grids_sized_from_shapes_alone(window: int | None) -> None:
    """Device metadata: no values read back, grids from the shapes; same results."""
    rng = np.random.default_rng()
    # the variants of the MQA decode case and the MQA prefill case: no extra builds
    problem = paged_problem(rng, [37, 12, 20, 5], [1, 12, 4, 1], 12, 1, 16, 8, "f16-fp8",
                            0.05, 0.02)
    out = ops().paged_attention(**problem, sliding_window=window, partition_tokens=16,
                                host_metadata=False)
    expected = reference.paged_attention(**problem, sliding_window=window)
    np.testing.assert_allclose(out.astype(np.float32), expected.astype(np.float32),
                               rtol=2e-3, atol=2e-3)


def test_thread_order_does_not_change_results() -> None:
    rng = np.random.default_rng()
    problem = paged_problem(rng, [37, 12, 20], [1, 12, 4], 6, 2, 16, 8, "f32")
    outs = [check_attention(problem, None, 3, seed) for seed in (0, 1, 2)]
    # decode with split KV and the cross-warp merge (group 1: four warps walk KV blocks), and the
    # tensor-core prefill beside it
    problem = paged_problem(rng, [300, 17, 90], [1, 1, 70], 2, 2, 64, 16, "f16", poison=True)
    outs = [check_attention(problem, None, 2, seed) for seed in (0, 1, 2)]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    # group 8: decode on tensor cores, split in 3 partitions
    problem = paged_problem(rng, [300, 90], [1, 1], 16, 2, 64, 16, "f16", poison=True)
    outs = [check_attention(problem, None, 3, seed) for seed in (0, 1)]
    assert np.array_equal(outs[0], outs[1])
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    x = rng.standard_normal((3, 300)).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    norms = [ops(seed).rms_norm(x, w, 1e-6) for seed in (0, 3)]
    assert np.array_equal(norms[0], norms[1])


@pytest.mark.parametrize("defines", [("KVC_BREAK_SYNC",), ("KVC_BREAK_GQA",)])
def test_broken_decode_kernel_fails(defines: tuple[str, ...]) -> None:
    rng = np.random.default_rng()
    # group 2: two warps walk different KV blocks and merge through shared memory, so a missing
    # barrier lets one read the other's partial state before it is written
    problem = paged_problem(rng, [70, 41], [1, 1], 4, 2, 32, 8, "f32-f16")
    expected = reference.paged_attention(**problem)
    good = ops().paged_attention(**problem)
    np.testing.assert_allclose(good, expected, rtol=2e-5, atol=2e-5)
    for seed in (0, 1):
        broken = ops(seed, defines).paged_attention(**problem)
        assert not np.allclose(broken, expected, rtol=1e-3, atol=1e-3, equal_nan=False)


@pytest.mark.parametrize("defines", [("KVC_BREAK_WAIT",), ("KVC_BREAK_SYNC",),
                                     ("KVC_BREAK_FRAGMENT",), ("KVC_BREAK_GQA",),
                                     ("KVC_BREAK_LDMATRIX",), ("KVC_BREAK_TRANS",)])
def test_broken_register_tile_decode_fails(defines: tuple[str, ...]) -> None:
    """paged_attention_decode_tc.cu's mutants: a tile read before its cp.async wait, a buffer
    staged again without the barrier after the tile's last reader (3 tiles of 64 keys, so a
    buffer is reused), P's A fragment registers swapped, the wrong query heads, ldmatrix lanes
    addressing their neighbour's row, V loaded without .trans."""
    rng = np.random.default_rng()
    problem = paged_problem(rng, [300, 41], [1, 1], 16, 2, 32, 8, "f16", poison=True)
    expected = attention_f64(problem)
    good = ops().paged_attention(**problem)
    np.testing.assert_allclose(good.astype(np.float32), expected, rtol=2e-3, atol=2e-3)
    try:
        broken = ops(0, defines).paged_attention(**problem)
    except RuntimeError as exc:  # the emulator saw a copy land on a destination in use
        assert "cp.async" in str(exc)
        return
    assert not np.allclose(broken.astype(np.float32), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("defines", [("KVC_BREAK_WAIT",), ("KVC_BREAK_SYNC",),
                                     ("KVC_BREAK_FRAGMENT",), ("KVC_BREAK_GQA",),
                                     ("KVC_BREAK_LDMATRIX",), ("KVC_BREAK_TRANS",)])
def test_broken_register_tile_prefill_fails(defines: tuple[str, ...]) -> None:
    """paged_attention_prefill_mma.cu's mutants, on a chunk whose key span takes 3 tiles."""
    rng = np.random.default_rng()
    problem = paged_problem(rng, [150, 20], [40, 20], 4, 2, 16, 8, "f16", poison=True)
    expected = attention_f64(problem)
    try:
        broken = ops(0, defines).paged_attention(**problem)
    except RuntimeError as exc:  # the emulator saw a copy land on a destination in use
        assert "cp.async" in str(exc)
        return
    assert not np.allclose(broken.astype(np.float32), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtypes", ["f32", "f16"])  # the fp32 and the tensor-core kernel
def test_broken_prefill_kernel_fails(dtypes: str) -> None:
    rng = np.random.default_rng()
    # block size 6 (not a power of two): fp16 runs paged_attention_prefill_tc.cu
    problem = paged_problem(rng, [30, 20], [30, 8], 6, 2, 32, 6, dtypes)
    expected = attention_f64(problem)
    for defines in [("KVC_BREAK_GQA",)] + ([("KVC_BREAK_SYNC",)] if dtypes == "f16" else []):
        broken = ops(0, defines).paged_attention(**problem)
        assert not np.allclose(broken.astype(np.float32), expected, rtol=1e-2, atol=1e-2), defines


@pytest.mark.parametrize("dtypes", ["f32", "f16", "bf16", "f32-fp8", "f16-fp8", "f32-bf16"])
def test_reshape_and_cache(dtypes: str) -> None:
    act, cache_dtype = DTYPES[dtypes]
    rng = np.random.default_rng()
    key = (rng.standard_normal((7, 3, 16)) * 40).astype(act)  # fp8 / 0.1 saturates some
    value = rng.standard_normal((7, 3, 16)).astype(act)
    slots = rng.permutation(6 * 4)[:7].astype(np.int64)
    slots[[1, 4]] = -1  # padding rows are skipped
    scales = (0.1, 0.5) if cache_dtype == FP8 else (1.0, 1.0)
    garbage = rng.standard_normal((6, 4, 3, 16)).astype(np.float32).astype(cache_dtype)
    caches = [garbage.copy() for _ in range(4)]
    ops().reshape_and_cache(key, value, caches[0], caches[1], slots, *scales)
    reference.reshape_and_cache(key, value, caches[2], caches[3], slots, *scales)
    assert caches[0].view(np.uint8).tobytes() == caches[2].view(np.uint8).tobytes()
    assert caches[1].view(np.uint8).tobytes() == caches[3].view(np.uint8).tobytes()


@pytest.mark.parametrize("shape,dtype", [((9, 4, 2, 8), np.float16), ((7, 3, 1, 5), FP8)])
def test_copy_blocks(shape: tuple[int, ...], dtype: np.dtype) -> None:
    rng = np.random.default_rng()
    caches = [rng.standard_normal(shape).astype(np.float32).astype(dtype) for _ in range(4)]
    expected = [c.copy() for c in caches]
    mapping = np.array([[0, 5], [2, 3], [2, 6]], dtype=np.int64)
    ops().copy_blocks(caches[:2], caches[2:], mapping)
    reference.copy_blocks(expected[:2], expected[2:], mapping)
    for got, want in zip(caches, expected, strict=True):
        assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()
    with pytest.raises(ValueError, match="never a source"):
        ops().copy_blocks(caches[:2], caches[2:], np.array([[0, 1], [1, 2]], dtype=np.int64))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
def test_fused_layers(dtype: np.dtype) -> None:
    rng = np.random.default_rng()
    tol = TOL[np.dtype(dtype)]
    x = rng.standard_normal((5, 300)).astype(dtype)
    weight = rng.standard_normal(300).astype(dtype)
    want = reference.rms_norm(x.astype(np.float32), weight.astype(np.float32), 1e-5)
    got = ops().rms_norm(x, weight, 1e-5)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=tol * 2, atol=tol * 2)
    gate_up = rng.standard_normal((4, 2 * 40)).astype(dtype)
    want = reference.silu_and_mul(gate_up.astype(np.float32))
    got = ops().silu_and_mul(gate_up)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=tol, atol=tol)
    cos, sin = reference.rope_cos_sin(reference.rope_inv_freq(16, 10000.0), 64)
    qkv = rng.standard_normal((6, 5 * 16)).astype(dtype)
    q = qkv[:, 16:64].reshape(6, 3, 16)  # tokens strided, as a slice of the fused projection
    positions = rng.integers(0, 64, size=6).astype(np.int64)
    want = reference.rope(q.astype(np.float32), positions, cos, sin)
    got = ops().rope(q, positions, cos, sin)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=tol, atol=tol)


def test_wrappers_check_arguments() -> None:
    rng = np.random.default_rng()
    problem = paged_problem(rng, [9], [1], 4, 2, 16, 4, "f32")
    bad = dict(problem, block_tables=problem["block_tables"].astype(np.int64))
    with pytest.raises(ValueError, match="block_tables must be int32"):
        ops().paged_attention(**bad)
    bad = dict(problem, query=np.ascontiguousarray(
        np.repeat(problem["query"], 2, axis=2))[:, :, ::2])
    with pytest.raises(ValueError, match="query must be C-contiguous"):
        ops().paged_attention(**bad)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        p = paged_problem(rng, [9], [1], 4, 2, 24, 4, "f32")
        ops().paged_attention(**p)
    with pytest.raises(ValueError, match="slot_mapping holds a slot outside"):
        ops().reshape_and_cache(problem["query"][:, :2].copy(), problem["query"][:, :2].copy(),
                                problem["k_cache"], problem["v_cache"],
                                np.array([problem["k_cache"].shape[0] * 4], np.int64))
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        ops().reshape_and_cache(problem["query"][:, :2], problem["query"][:, :2],
                                problem["k_cache"], problem["v_cache"], np.zeros(1, np.int32))


@pytest.mark.parametrize("dtypes,heads", [("f16", 16), ("f32", 4)])  # decode_tc; CUDA-core
def test_decode_bits_do_not_depend_on_the_batch(dtypes: str, heads: int) -> None:
    """Same request, same answer: a sequence's decode output bits are the same alone, in a
    batch of longer and shorter contexts (which widen the grid's partitions), and beside a
    prefill chunk; its own partitions (of 48 tokens here, to split short contexts) are fixed by
    its span alone."""
    rng = np.random.default_rng()
    problem = paged_problem(rng, [300, 700, 5, 90], [1, 1, 1, 20], heads, 2, 64, 16, dtypes,
                            poison=True)

    def row0(problem: dict) -> np.ndarray:
        return ops().paged_attention(**problem, partition_tokens=48)[0]

    batch = row0(problem)
    alone = row0(dict(problem, query=problem["query"][:1].copy(),
                      block_tables=problem["block_tables"][:1].copy(),
                      context_lens=problem["context_lens"][:1].copy(),
                      query_start_loc=problem["query_start_loc"][:2].copy()))
    assert np.array_equal(batch.view(np.uint8), alone.view(np.uint8))
