"""The CUDA emulation harness itself: barriers, warp collectives, races, crashes, bad arguments."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cupy", reason="cupy's CCCL headers provide <nv/target> for cuda_fp16.h")
if shutil.which("g++") is None:
    pytest.skip("the emulation harness needs g++", allow_module_level=True)

from cuda_emu import EmuModule  # noqa: E402

SOURCE = r"""
#include <cuda_fp16.h>
#include <mma.h>
// warp 1 publishes values in shared memory that warp 0 reads; SYNC decides whether it waits
extern "C" __global__ void publish(float* out, int sync) {
  extern __shared__ float buf[];
  const int t = threadIdx.x;
  if (t >= 32) buf[t - 32] = 10.0f * t;
  if (sync) __syncthreads();
  if (t < 32) out[blockIdx.x * 32 + t] = buf[t];
}
extern "C" __global__ void collectives(float* out, unsigned* votes, const __half* x) {
  const int t = threadIdx.x;
  const float v = __half2float(x[t]);
  out[t] = __shfl_xor_sync(0xffffffffu, v, 5);
  out[64 + t] = __shfl_down_sync(0xffffffffu, v, 3);
  out[128 + t] = __shfl_sync(0xffffffffu, v, 7, 16);
  const unsigned vote = __ballot_sync(0xffffffffu, v > 0.0f);
  if (t % 32 == 0) votes[t / 32] = vote;
  __shared__ float total;
  if (t == 0) total = 0.0f;
  __syncthreads();
  atomicAdd(&total, 1.0f);
  __syncthreads();
  out[192 + t] = total;
}
extern "C" __global__ void wild(float* out, long long address) {
  *reinterpret_cast<float*>(address) = out[0];
}
// c (16 x 16, row-major, ld 20) += a (16 x 32, row-major) b (32 x 16, b stored column-major);
// then the result is stored column-major to out2; each warp of the block does the same
extern "C" __global__ void wmma_gemm(float* c, float* out2, const __half* a, const __half* b) {
  namespace w = nvcuda::wmma;
  w::fragment<w::accumulator, 16, 16, 16, float> acc;
  w::load_matrix_sync(acc, c, 20, w::mem_row_major);
  for (int k0 = 0; k0 < 32; k0 += 16) {
    w::fragment<w::matrix_a, 16, 16, 16, __half, w::row_major> fa;
    w::fragment<w::matrix_b, 16, 16, 16, __half, w::col_major> fb;
    w::load_matrix_sync(fa, a + k0, 32);
    w::load_matrix_sync(fb, b + k0, 32);
    w::mma_sync(acc, fa, fb, acc);
  }
  if (threadIdx.x < 32) w::store_matrix_sync(c, acc, 20, w::mem_row_major);
  w::fragment<w::accumulator, 16, 16, 16, float> ones;
  w::fill_fragment(ones, 1.0f);
  if (threadIdx.x < 32) w::store_matrix_sync(out2, ones, 16, w::mem_col_major);
}
extern "C" __global__ void divergent(float* out) {
  if (threadIdx.x < 16) out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}
"""


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory) -> EmuModule:
    path = Path(tmp_path_factory.mktemp("emu")) / "harness.cu"
    path.write_text(SOURCE)
    return EmuModule(path)


def test_missing_barrier_is_a_visible_race(module: EmuModule) -> None:
    expected = np.tile(10.0 * np.arange(32, 64, dtype=np.float32), 2)
    out = np.zeros(64, dtype=np.float32)
    module.get_function("publish")((2,), (64,), (out, np.int32(1)), shared_mem=32 * 4)
    np.testing.assert_array_equal(out, expected)
    for seed in (0, 5):  # warp 0 runs first in natural order: it reads unwritten memory
        module.order_seed = seed
        out = np.zeros(64, dtype=np.float32)
        module.get_function("publish")((2,), (64,), (out, np.int32(0)), shared_mem=32 * 4)
        if seed == 0:
            assert np.isnan(out).all()
    module.order_seed = 0


def test_warp_collectives(module: EmuModule) -> None:
    rng = np.random.default_rng()
    x = rng.standard_normal(64).astype(np.float16)
    v = x.astype(np.float32)
    out = np.zeros(256, dtype=np.float32)
    votes = np.zeros(2, dtype=np.uint32)
    for seed in (0, 3):
        module.order_seed = seed
        module.get_function("collectives")((1,), (64,), (out, votes, x))
        lane = np.arange(64) % 32
        base = np.arange(64) - lane
        np.testing.assert_array_equal(out[:64], v[base + (lane ^ 5)])
        np.testing.assert_array_equal(out[64:128], np.where(lane + 3 < 32, v[np.minimum(
            np.arange(64) + 3, 63)], v))
        np.testing.assert_array_equal(out[128:192], v[(np.arange(64) // 16) * 16 + 7])
        for w in range(2):
            expected = sum(1 << i for i in range(32) if v[32 * w + i] > 0)
            assert int(votes[w]) == expected
        np.testing.assert_array_equal(out[192:], np.full(64, 64.0))
    module.order_seed = 0


def test_wild_pointer_kills_only_the_worker(module: EmuModule) -> None:
    out = np.ones(4, dtype=np.float32)
    with pytest.raises(RuntimeError, match="crashed the worker"):
        module.get_function("wild")((1,), (1,), (out, np.int64(16)))
    again = np.zeros(32, dtype=np.float32)
    module.get_function("publish")((1,), (64,), (again, np.int32(1)), shared_mem=128)
    np.testing.assert_array_equal(again, 10.0 * np.arange(32, 64))


def test_argument_types_are_checked(module: EmuModule) -> None:
    out = np.zeros(64, dtype=np.float32)
    with pytest.raises(RuntimeError, match="expects 'i', got int64"):
        module.get_function("publish")((1,), (64,), (out, 1), shared_mem=128)  # Python int: int64
    with pytest.raises(RuntimeError, match="takes 2 arguments"):
        module.get_function("publish")((1,), (64,), (out,), shared_mem=128)


def test_wmma_is_a_warp_collective_gemm(module: EmuModule) -> None:
    """load / mma / store read and write whole tiles, once per warp (a lane's load happens
    before any lane of its warp stores the result: c += a b, not 32 times)."""
    rng = np.random.default_rng()
    a = rng.standard_normal((16, 32)).astype(np.float16)
    b = rng.standard_normal((32, 16)).astype(np.float16)
    c = rng.standard_normal((16, 20)).astype(np.float32)
    want = c[:, :16].astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
    ones = np.zeros((16, 16), np.float32)
    module.get_function("wmma_gemm")((1,), (32,), (c, ones, a, np.ascontiguousarray(b.T)))
    np.testing.assert_allclose(c[:, :16], want, rtol=1e-5, atol=1e-5)
    assert np.all(ones == 1.0)


def test_divergent_collective_and_smem_limit_are_errors(module: EmuModule) -> None:
    out = np.zeros(32, dtype=np.float32)
    with pytest.raises(RuntimeError, match="deadlocked|exited"):
        module.get_function("divergent")((1,), (32,), (out,))
    with pytest.raises(RuntimeError, match="48 KiB"):
        module.get_function("publish")((1,), (64,), (out, np.int32(1)), shared_mem=64 * 1024)


PTX_SOURCE = r"""
#include <ptx_ops.cuh>
// d (16 x 8) = a (16 x 16, row-major) b + c, with b given transposed (8 x 16, row-major) and c, d
// (16 x 8, row-major): the fragments gathered as the PTX ISA lays them out. BREAK_FRAGMENT swaps
// two registers of A (rows g + 8 and columns 2t + 8 trade places).
template <typename T>
__device__ void mma_tile(float* d, const T* a, const T* bt, const float* c) {
  const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const uint32_t* a32 = reinterpret_cast<const uint32_t*>(a);   // (16, 8) pairs
  const uint32_t* b32 = reinterpret_cast<const uint32_t*>(bt);  // (8, 8) pairs
  uint32_t af[4] = {a32[g * 8 + t], a32[(g + 8) * 8 + t], a32[g * 8 + t + 4],
                    a32[(g + 8) * 8 + t + 4]};
#ifdef BREAK_FRAGMENT
  const uint32_t swap = af[1]; af[1] = af[2]; af[2] = swap;
#endif
  const uint32_t bf[2] = {b32[g * 8 + t], b32[g * 8 + t + 4]};
  float acc[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t],
                  c[(g + 8) * 8 + 2 * t + 1]};
  mma_m16n8k16<T>(acc, af, bf);
  d[g * 8 + 2 * t] = acc[0];
  d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2];
  d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}
extern "C" __global__ void mma_f16(float* d, const __half* a, const __half* bt, const float* c) {
  mma_tile(d, a, bt, c);
}
extern "C" __global__ void mma_bf16(float* d, const __nv_bfloat16* a, const __nv_bfloat16* bt,
                                    const float* c) {
  mma_tile(d, a, bt, c);
}
// Double-buffered staging of 256-float tiles (each of 64 threads copies 16 bytes); each thread
// then sums the chunk another warp staged. SKIP_WAIT reads before the wait; SKIP_SWAP_BARRIER
// re-stages a buffer while the other warp may still read it.
extern "C" __global__ void staged(float* out, const float* x, int num_tiles) {
  __shared__ __align__(16) float buf[2][256];
  const int tid = threadIdx.x, peer = (tid + 32) % 64;
  cp_async16(&buf[0][tid * 4], x + tid * 4);
  cp_async_commit();
  for (int i = 0; i < num_tiles; ++i) {
    if (i + 1 < num_tiles) cp_async16(&buf[(i + 1) & 1][tid * 4], x + (i + 1) * 256 + tid * 4);
    cp_async_commit();
#ifndef SKIP_WAIT
    cp_async_wait<1>();
#endif
    __syncthreads();
    const float* v = &buf[i & 1][peer * 4];
    out[i * 64 + tid] = v[0] + v[1] + v[2] + v[3];
#ifndef SKIP_SWAP_BARRIER
    __syncthreads();
#endif
  }
  cp_async_wait<0>();
}
// A 16 x 16 16-bit matrix (rows of 24 elements in shared memory) through ldmatrix.x4 (TRANS:
// .trans): lane l addresses row l % 8 (+ 8 for odd l / 8) at column 8 (l / 16), as a fragment
// loader of an A operand would; out (32 lanes, 4 registers). SHIFT moves every address by
// `shift` bytes (misaligned or outside shared memory); MIXED: lane 0 alone uses the other form.
extern "C" __global__ void load_matrix(unsigned* out, const unsigned short* x, int trans,
                                       int shift, int mixed) {
  extern __shared__ __align__(16) unsigned short tile[];  // (16, 24)
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) tile[(i / 16) * 24 + i % 16] = x[i];
  __syncthreads();
  const int m = lane / 8;
  const unsigned char* row = reinterpret_cast<const unsigned char*>(
      tile + (8 * (m & 1) + lane % 8) * 24 + 8 * (m >> 1)) + shift;
  unsigned r[4];
  if ((trans != 0) != (mixed != 0 && lane == 0)) ldmatrix_x4_trans(r, row);
  else ldmatrix_x4(r, row);
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}
extern "C" __global__ void never_waits(const float* x) {
  __shared__ __align__(16) float buf[4];
  cp_async16(buf, x);
  cp_async_commit();
}
"""


@pytest.fixture(scope="module")
def ptx_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("emu_ptx")) / "ptx.cu"
    path.write_text(PTX_SOURCE)
    return path


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_mma_m16n8k16_follows_the_ptx_fragment_layout(ptx_path: Path, dtype: str) -> None:
    from kernel_problems import BF16

    np_dtype = np.float16 if dtype == "f16" else BF16
    rng = np.random.default_rng()
    a = rng.standard_normal((16, 16)).astype(np_dtype)
    b = rng.standard_normal((16, 8)).astype(np_dtype)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    want = c + a.astype(np.float64) @ b.astype(np.float64)
    d = np.zeros((16, 8), np.float32)
    EmuModule(ptx_path).get_function(f"mma_{dtype}")((1,), (32,),
                                                     (d, a, np.ascontiguousarray(b.T), c))
    np.testing.assert_allclose(d, want, rtol=1e-5, atol=1e-5)
    broken = np.zeros((16, 8), np.float32)
    EmuModule(ptx_path, ("BREAK_FRAGMENT",)).get_function(f"mma_{dtype}")(
        (1,), (32,), (broken, a, np.ascontiguousarray(b.T), c))
    assert not np.allclose(broken, want, rtol=1e-2, atol=1e-2)


def test_cp_async_hazards_are_caught(ptx_path: Path) -> None:
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 64, 4)).astype(np.float32)  # 3 tiles of 64 chunks of 16 bytes
    want = x.sum(axis=2)[:, (np.arange(64) + 32) % 64]
    for seed in (0, 2):
        out = np.zeros((3, 64), np.float32)
        EmuModule(ptx_path, order_seed=seed).get_function("staged")(
            (1,), (64,), (out, x, np.int32(3)))
        np.testing.assert_allclose(out, want, rtol=1e-6)
    # read before the wait: the chunks have not arrived (NaN), or the next copy lands on one
    # still in flight
    out = np.zeros((3, 64), np.float32)
    try:
        EmuModule(ptx_path, ("SKIP_WAIT",)).get_function("staged")(
            (1,), (64,), (out, x, np.int32(3)))
        assert np.isnan(out).any()
    except RuntimeError as exc:
        assert "in flight" in str(exc)
    # no barrier before a buffer is staged again: the lagging warp reads chunks in flight
    out = np.zeros((3, 64), np.float32)
    EmuModule(ptx_path, ("SKIP_SWAP_BARRIER",)).get_function("staged")(
        (1,), (64,), (out, x, np.int32(3)))
    assert np.isnan(out).any()
    with pytest.raises(RuntimeError, match="never waited for"):
        EmuModule(ptx_path).get_function("never_waits")((1,), (32,), (x,))


def test_ldmatrix_follows_the_ptx_lane_mapping(ptx_path: Path) -> None:
    """ldmatrix.x4 and .x4.trans hand each lane the elements PTX ISA 9.7.14.5.15 assigns it; a
    misaligned or out-of-bounds row address, or lanes using different forms, fail the launch."""
    rng = np.random.default_rng()
    x = rng.integers(0, 1 << 16, (16, 16), dtype=np.uint16)
    # matrices m = 0..3: rows 8 (m % 2) .. + 7, columns 8 (m // 2) .. + 7
    mats = [x[8 * (m % 2):8 * (m % 2) + 8, 8 * (m // 2):8 * (m // 2) + 8] for m in range(4)]
    kernel = EmuModule(ptx_path).get_function("load_matrix")
    for trans in (0, 1):
        out = np.zeros((32, 4), np.uint32)
        kernel((1,), (32,), (out, x, np.int32(trans), np.int32(0), np.int32(0)), shared_mem=768)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for m, mat in enumerate(mats):
                lo, hi = ((mat[2 * t, g], mat[2 * t + 1, g]) if trans
                          else (mat[g, 2 * t], mat[g, 2 * t + 1]))
                assert out[lane, m] == int(lo) | int(hi) << 16, (trans, lane, m)
    for shift, message in ((4, "16-byte aligned"), (768, "outside the launch's dynamic shared")):
        with pytest.raises(RuntimeError, match=message):
            kernel((1,), (32,), (np.zeros((32, 4), np.uint32), x, np.int32(0), np.int32(shift),
                                 np.int32(0)), shared_mem=768)
    with pytest.raises(RuntimeError, match="different warp collectives"):
        kernel((1,), (32,), (np.zeros((32, 4), np.uint32), x, np.int32(0), np.int32(0),
                             np.int32(1)), shared_mem=768)
