// Helpers of the register-tile (mma.sync) attention kernels: fragment elements read from
// staged cache rows (16-bit as is, fp8 dequantized exactly to the activation type) and the
// cp.async staging of K/V tiles through the block table.
#pragma once
#include <ptx_ops.cuh>

#include "common.cuh"

// Two consecutive cache elements of a shared row as one .b32 of two activation values.
template <typename scalar_t>
__device__ __forceinline__ unsigned pair_at(const unsigned char* row, int col, const scalar_t*) {
  return *reinterpret_cast<const unsigned*>(row + col * 2);
}
__device__ __forceinline__ unsigned short bits16(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ unsigned short bits16(__nv_bfloat16 x) {
  return __bfloat16_as_ushort(x);
}
template <typename scalar_t>
__device__ __forceinline__ unsigned pack2(scalar_t lo, scalar_t hi) {
  return (unsigned)bits16(lo) | ((unsigned)bits16(hi) << 16);
}
template <typename scalar_t>
__device__ __forceinline__ unsigned pair_at(const unsigned char* row, int col,
                                            const __nv_fp8_e4m3*) {
  const __nv_fp8x2_storage_t two = *reinterpret_cast<const __nv_fp8x2_storage_t*>(row + col);
  const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3));  // exact
  return pack2(from_float<scalar_t>(__low2float(h)), from_float<scalar_t>(__high2float(h)));
}
// One 16-bit cache element (V's B fragments pair elements of two different rows).
template <typename scalar_t>
__device__ __forceinline__ unsigned short elem_at(const unsigned char* row, int col,
                                                  const scalar_t*) {
  return *reinterpret_cast<const unsigned short*>(row + col * 2);
}
template <typename scalar_t>
__device__ __forceinline__ unsigned short elem_at(const unsigned char* row, int col,
                                                  const __nv_fp8_e4m3*) {
  __nv_fp8_e4m3 v;
  v.__x = row[col];
  return bits16(from_float<scalar_t>(static_cast<float>(v)));  // exact
}

// Stages keys [k0, k0 + kKeys) of one KV head into k_s / v_s (rows of kPitch bytes) with 16-byte
// cp.async copies, a thread taking runs of kRun chunks of one row (one block-table read and one
// address per run); keys at or past k_hi are zero-filled by the copies (nothing is read).
// Block sizes are powers of two: the table is read with shifts.
template <int kKeys, int kThreads, int kRowBytes, int kPitch, int kRun>
__device__ __forceinline__ void stage_kv_tile(unsigned char* k_s, unsigned char* v_s,
                                              const unsigned char* k_base,
                                              const unsigned char* v_base, long long slot_bytes,
                                              const int* table, int block_shift, int k0,
                                              int k_hi, int tid) {
  constexpr int kLanes = kRowBytes / 16 / kRun;  // threads per row
  constexpr int kRounds = (kKeys * kLanes + kThreads - 1) / kThreads;
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    const int i = tid + round * kThreads;
    if (kKeys * kLanes % kThreads != 0 && i >= kKeys * kLanes) break;
    const int key = i / kLanes, c0 = (i % kLanes) * kRun;  // shifts: powers of two
    const int pos = k0 + key;
    const bool valid = pos < k_hi;
    const long long slot = valid ? ((long long)table[pos >> block_shift] << block_shift) +
                                   (pos & ((1 << block_shift) - 1)) : 0;
    const unsigned char* k_src = k_base + slot * slot_bytes + c0 * 16;
    const unsigned char* v_src = v_base + slot * slot_bytes + c0 * 16;
#pragma unroll
    for (int c = 0; c < kRun; ++c) {
      cp_async16_zfill(k_s + key * kPitch + (c0 + c) * 16, k_src + c * 16, valid);
      cp_async16_zfill(v_s + key * kPitch + (c0 + c) * 16, v_src + c * 16, valid);
    }
  }
}

// Shared-memory rows of kBytes bytes for fragment loads: padded by 16 bytes, or (kSwizzle,
// rows of whole 128-byte groups) XOR-swizzled by 16-byte chunk within each 128-byte group
// (chunk ^ (row & 7), no padding: for tiles that must fit); either way a fragment load of 8
// rows x 4 lanes hits distinct banks.
template <int kBytes, bool kSwizzle>
struct SmemRows {
  static_assert(!kSwizzle || kBytes % 128 == 0, "swizzled rows are whole 128-byte groups");
  static constexpr int kPitch = kSwizzle ? kBytes : kBytes + 16;
  __device__ __forceinline__ static int at(int row, int byte) {
    return row * kPitch + (kSwizzle ? byte ^ ((row & 7) << 4) : byte);
  }
};

// Stages keys [k0, k0 + kKeys) of a single-tensor cache (MLA: the cached row is both K and V)
// into dst (rows laid out by Rows = SmemRows<kRowBytes>) with 16-byte cp.async copies, a thread
// taking a run of kRun chunks of one row; keys at or past k_hi are zero-filled (nothing is
// read). The block table is read with shifts when block_shift >= 0, else by division (one key
// per thread and round).
template <int kKeys, int kThreads, int kRowBytes, class Rows, int kRun>
__device__ __forceinline__ void stage_row_tile(unsigned char* dst, const unsigned char* base,
                                               const int* table, int block_size,
                                               int block_shift, int k0, int k_hi, int tid) {
  constexpr int kLanes = kRowBytes / 16 / kRun;  // threads per row
  static_assert(kLanes * kRun * 16 == kRowBytes, "a row is whole runs of 16-byte chunks");
  constexpr int kRounds = (kKeys * kLanes + kThreads - 1) / kThreads;
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    const int i = tid + round * kThreads;
    if (kKeys * kLanes % kThreads != 0 && i >= kKeys * kLanes) break;
    const int key = i / kLanes, c0 = (i % kLanes) * kRun;  // constants: shifts or mul-shifts
    const int pos = k0 + key;
    const bool valid = pos < k_hi;
    long long slot = 0;
    if (valid) {
      slot = block_shift >= 0
                 ? ((long long)table[pos >> block_shift] << block_shift) +
                       (pos & ((1 << block_shift) - 1))
                 : (long long)table[pos / block_size] * block_size + pos % block_size;
    }
    const unsigned char* src = base + slot * kRowBytes + c0 * 16;
#pragma unroll
    for (int c = 0; c < kRun; ++c) {
      cp_async16_zfill(dst + Rows::at(key, (c0 + c) * 16), src + c * 16, valid);
    }
  }
}

// Fragments of mma.m16n8k16 from 16-bit shared tiles by ldmatrix (ptx_ops.cuh), rows laid out by
// Rows (SmemRows: padded or swizzled, so the 8 row addresses of a matrix hit distinct banks).
// Lane l = 8 m + r addresses row r of matrix m. KVC_BREAK_LDMATRIX (a test mutant) has each lane
// address the next lane's row; KVC_BREAK_TRANS loads V without .trans.
__device__ __forceinline__ int ldmatrix_row(int lane) {
#ifdef KVC_BREAK_LDMATRIX
  return (lane + 1) & 7;
#else
  return lane & 7;
#endif
}

// B fragments of S = Q K^T for the 8 keys starting at tile row `key` and the 16-channel steps kk,
// kk + 1: b[0], b[1] for step kk, b[2], b[3] for step kk + 1 (K rows are B's columns: no .trans).
template <class Rows>
__device__ __forceinline__ void k_frags_x4(unsigned (&b)[4], const unsigned char* tile, int key,
                                           int kk, int lane) {
  const int m = lane >> 3;
  ldmatrix_x4(b, tile + Rows::at(key + ldmatrix_row(lane), (16 * (kk + (m >> 1)) + 8 * (m & 1)) * 2));
}
// The same for one step kk (b[0], b[1]); lanes 16-31 repeat valid addresses (unused by .x2).
template <class Rows>
__device__ __forceinline__ void k_frags_x2(unsigned (&b)[2], const unsigned char* tile, int key,
                                           int kk, int lane) {
  const int m = (lane >> 3) & 1;
  ldmatrix_x2(b, tile + Rows::at(key + ldmatrix_row(lane), (16 * kk + 8 * m) * 2));
}
// B fragments of O += P V for the 16 keys starting at tile row `key` and the 8-column n-tiles n,
// n + 1 (V is stored keys x channels: .trans): b[0], b[1] for n-tile n, b[2], b[3] for n + 1.
template <class Rows>
__device__ __forceinline__ void v_frags_x4(unsigned (&b)[4], const unsigned char* tile, int key,
                                           int n, int lane) {
  const int m = lane >> 3;
  const unsigned char* row = tile + Rows::at(key + 8 * (m & 1) + ldmatrix_row(lane), 16 * (n + (m >> 1)));
#ifdef KVC_BREAK_TRANS
  ldmatrix_x4(b, row);
#else
  ldmatrix_x4_trans(b, row);
#endif
}
// The same for one n-tile (b[0], b[1]).
template <class Rows>
__device__ __forceinline__ void v_frags_x2(unsigned (&b)[2], const unsigned char* tile, int key,
                                           int n, int lane) {
  const int m = (lane >> 3) & 1;
  const unsigned char* row = tile + Rows::at(key + 8 * m + ldmatrix_row(lane), 16 * n);
#ifdef KVC_BREAK_TRANS
  ldmatrix_x2(b, row);
#else
  ldmatrix_x2_trans(b, row);
#endif
}
// A fragments of the 16 x 16 block at (row, col) of a row-major 16-bit tile (Q or P): matrices
// (rows +0, cols +0), (rows +8, cols +0), (rows +0, cols +8), (rows +8, cols +8) are a[0..3].
template <class Rows>
__device__ __forceinline__ void a_frags_x4(unsigned (&a)[4], const unsigned char* tile, int row,
                                           int col, int lane) {
  const int m = lane >> 3;
  ldmatrix_x4(a, tile + Rows::at(row + 8 * (m & 1) + ldmatrix_row(lane), (col + 8 * (m >> 1)) * 2));
}

// S (16 rows x 8 keys per n-tile, kN n-tiles) += Q K^T over kD channels, K from a 16-bit tile by
// ldmatrix: q[kk] are Q's A fragments per 16-channel step, `key` the tile row of n-tile 0's first
// key.
template <typename scalar_t, class Rows, int kD, int kN>
__device__ __forceinline__ void qk_ldmatrix(float (&s)[kN][4], const unsigned (&q)[kD / 16][4],
                                            const unsigned char* tile, int key, int lane) {
#pragma unroll
  for (int kk = 0; kk + 1 < kD / 16; kk += 2) {
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      unsigned b[4];
      k_frags_x4<Rows>(b, tile, key + 8 * j, kk, lane);
      const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      mma_m16n8k16<scalar_t>(s[j], q[kk], b0);
      mma_m16n8k16<scalar_t>(s[j], q[kk + 1], b1);
    }
  }
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    if constexpr ((kD / 16) % 2 == 1) {
      unsigned b[2];
      k_frags_x2<Rows>(b, tile, key + 8 * j, kD / 16 - 1, lane);
      mma_m16n8k16<scalar_t>(s[j], q[kD / 16 - 1], b);
    }
  }
}
// O (16 rows x kD) += P V over 16 keys starting at tile row `key`, V from a 16-bit tile by
// ldmatrix.trans: p holds P's A fragment for those 16 keys.
// kUnroll: n-tile pairs per unrolled pass (fewer: fewer fragments in flight, fewer registers).
template <typename scalar_t, class Rows, int kD, int kUnroll = kD / 16>
__device__ __forceinline__ void pv_ldmatrix(float (&o)[kD / 8][4], const unsigned (&p)[4],
                                            const unsigned char* tile, int key, int lane) {
#pragma unroll kUnroll
  for (int n = 0; n < kD / 8; n += 2) {
    unsigned b[4];
    v_frags_x4<Rows>(b, tile, key, n, lane);
    const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
    mma_m16n8k16<scalar_t>(o[n], p, b0);
    mma_m16n8k16<scalar_t>(o[n + 1], p, b1);
  }
}

// S += Q K^T and O += P V over a staged tile of the cache's own type: 16-bit by ldmatrix, fp8
// converted element by element (exactly) as the fragments are built. `key` is the tile row of
// the first key; Rows the tile's row layout (padded).
template <typename scalar_t, typename cache_t, class Rows, int kD, int kN>
__device__ __forceinline__ void qk_tile(float (&s)[kN][4], const unsigned (&q)[kD / 16][4],
                                        const unsigned char* tile, int key, int lane) {
  if constexpr (sizeof(cache_t) == 2) {
    qk_ldmatrix<scalar_t, Rows, kD, kN>(s, q, tile, key, lane);
  } else {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        const unsigned char* krow = tile + Rows::at(key + j * 8 + g, 0);
        const unsigned kf[2] = {pair_at<scalar_t>(krow, kk * 16 + 2 * t, (const cache_t*)nullptr),
                                pair_at<scalar_t>(krow, kk * 16 + 2 * t + 8, (const cache_t*)nullptr)};
        mma_m16n8k16<scalar_t>(s[j], q[kk], kf);
      }
    }
  }
}
template <typename scalar_t, typename cache_t, class Rows, int kD, int kUnroll = kD / 16>
__device__ __forceinline__ void pv_tile(float (&o)[kD / 8][4], const unsigned (&p)[4],
                                        const unsigned char* tile, int key, int lane) {
  if constexpr (sizeof(cache_t) == 2) {
    pv_ldmatrix<scalar_t, Rows, kD, kUnroll>(o, p, tile, key, lane);
  } else {
    const int g = lane >> 2, t = lane & 3;
    const cache_t* tag = nullptr;
    const unsigned char* v0 = tile + Rows::at(key + 2 * t, 0);
    constexpr int kPitch = Rows::kPitch;
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      const int col = n * 8 + g;
      const unsigned vf[2] = {
          (unsigned)elem_at<scalar_t>(v0, col, tag) |
              ((unsigned)elem_at<scalar_t>(v0 + kPitch, col, tag) << 16),
          (unsigned)elem_at<scalar_t>(v0 + 8 * kPitch, col, tag) |
              ((unsigned)elem_at<scalar_t>(v0 + 9 * kPitch, col, tag) << 16)};
      mma_m16n8k16<scalar_t>(o[n], p, vf);
    }
  }
}
