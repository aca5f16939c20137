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
