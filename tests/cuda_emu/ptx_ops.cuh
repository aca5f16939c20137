// Emulated <ptx_ops.cuh> (shadows the kernels' inline-PTX wrappers: the harness puts this
// directory first on the include path).
//
// mma_m16n8k16 models the PTX ISA's per-lane fragment layout exactly: each lane deposits its own
// A and B registers, the warp meets (mma.sync.aligned: every lane takes part), and each lane
// computes its four accumulator elements from the registers of the lanes that hold the row of A
// and the column of B the layout assigns; a kernel indexing a fragment wrongly gets wrong
// numbers. Products of 16-bit inputs are exact in fp32 and summed in fp32.
//
// ldmatrix (PTX ISA 9.7.14.5.15) is a warp rendezvous (.sync.aligned: all 32 lanes, the same
// form): lanes 8 i .. 8 i + 7 give the row addresses of matrix i, each 16-byte aligned inside the
// launch's dynamic shared memory (anything else fails the launch); register i of lane l gets
// row l / 4, elements 2 (l % 4), 2 (l % 4) + 1 of matrix i, or with .trans elements
// (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4). Rows are read when the last lane arrives.
//
// cp.async copies are deferred (emu_runtime.cpp): the destination reads as NaN (0xff bytes) until
// a cp_async_wait covering the copy's group completes it, so a tile read before its wait, or a
// buffer re-staged while another warp still reads it (a missing barrier), poisons the result;
// a write into a destination still in flight, or a thread exiting with copies never waited for,
// fails the launch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

namespace emu {
void cp_async(void* dst, const void* src, int bytes);
void ldmatrix(unsigned* out, const void* row, int num, bool trans);
void cp_async_commit();
void cp_async_wait(int allowed_in_flight);

struct MmaLane {
  unsigned a[4];
  unsigned b[2];
};
inline MmaLane mma_lanes[32][32];  // [warp][lane]: the registers a warp's lanes deposit

template <typename T>
float mma_element(unsigned reg, int high) {
  const uint16_t bits = static_cast<uint16_t>(high ? reg >> 16 : reg & 0xffffu);
  T value;
  memcpy(&value, &bits, sizeof bits);
  if constexpr (std::is_same<T, __half>::value) return __half2float(value);
  else return __bfloat162float(value);
}
}  // namespace emu

template <typename T>
void mma_m16n8k16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value,
                "mma.sync m16n8k16 takes f16 or bf16 inputs");
  const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int warp = tid / 32, lane = tid % 32;
  emu::MmaLane* lanes = emu::mma_lanes[warp];
  memcpy(lanes[lane].a, a, sizeof lanes[lane].a);
  memcpy(lanes[lane].b, b, sizeof lanes[lane].b);
  __syncwarp();  // every lane has deposited its fragments
  const int g = lane >> 2, t = lane & 3;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) {
      // A (row, k): lane (row % 8) * 4 + (k % 8) / 2, register (row >= 8) + 2 (k >= 8)
      const emu::MmaLane& ha = lanes[(row % 8) * 4 + (k % 8) / 2];
      const float av = emu::mma_element<T>(ha.a[(row >= 8) + 2 * (k >= 8)], k & 1);
      // B (k, col): lane col * 4 + (k % 8) / 2, register (k >= 8)
      const emu::MmaLane& hb = lanes[col * 4 + (k % 8) / 2];
      const float bv = emu::mma_element<T>(hb.b[k >= 8], k & 1);
      sum += av * bv;
    }
    out[i] = acc[i] + sum;
  }
  __syncwarp();  // every lane has read the deposits before any lane's next mma overwrites them
  for (int i = 0; i < 4; ++i) acc[i] = out[i];
}

inline void cp_async16(void* smem, const void* gmem) { emu::cp_async(smem, gmem, 16); }
inline void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  emu::cp_async(smem, valid ? gmem : nullptr, 16);  // null: zeros, the source is not read
}
inline void cp_async4_zfill(void* smem, const void* gmem, bool valid) {
  emu::cp_async(smem, valid ? gmem : nullptr, 4);
}
inline void cp_async_commit() { emu::cp_async_commit(); }
template <int N>
void cp_async_wait() {
  emu::cp_async_wait(N);
}
inline void ldmatrix_x4(unsigned (&r)[4], const void* smem) { emu::ldmatrix(r, smem, 4, false); }
inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
  emu::ldmatrix(r, smem, 4, true);
}
inline void ldmatrix_x2(unsigned (&r)[2], const void* smem) { emu::ldmatrix(r, smem, 2, false); }
inline void ldmatrix_x2_trans(unsigned (&r)[2], const void* smem) {
  emu::ldmatrix(r, smem, 2, true);
}

// fma.rn.f16x2 / sub.rn.f16x2 per 16-bit lane (the fp16 product is exact in double, the sum
// rounded once to fp16 unless it needs more than double's 53 bits); prmt.b32's default mode.
namespace emu {
inline __half half_lane(unsigned r, int hi) {
  const uint16_t bits = static_cast<uint16_t>(hi ? r >> 16 : r & 0xffffu);
  __half h;
  memcpy(&h, &bits, sizeof bits);
  return h;
}
inline unsigned half_bits(__half h) {
  uint16_t bits;
  memcpy(&bits, &h, sizeof bits);
  return bits;
}
}  // namespace emu
inline unsigned hfma2_bits(unsigned a, unsigned b, unsigned c) {
  unsigned d = 0;
  for (int hi = 0; hi < 2; ++hi) {
    const double r = static_cast<double>(__half2float(emu::half_lane(a, hi))) *
                         static_cast<double>(__half2float(emu::half_lane(b, hi))) +
                     static_cast<double>(__half2float(emu::half_lane(c, hi)));
    d |= emu::half_bits(__double2half(r)) << (16 * hi);
  }
  return d;
}
inline unsigned hsub2_bits(unsigned a, unsigned b) {
  unsigned d = 0;
  for (int hi = 0; hi < 2; ++hi) {
    const double r = static_cast<double>(__half2float(emu::half_lane(a, hi))) -
                     static_cast<double>(__half2float(emu::half_lane(b, hi)));
    d |= emu::half_bits(__double2half(r)) << (16 * hi);
  }
  return d;
}
inline unsigned prmt(unsigned a, unsigned b, unsigned sel) {
  const unsigned long long bytes = a | static_cast<unsigned long long>(b) << 32;
  unsigned d = 0;
  for (int i = 0; i < 4; ++i) d |= static_cast<unsigned>(bytes >> (8 * ((sel >> (4 * i)) & 7)) & 0xff) << (8 * i);
  return d;
}
