// Emulated nvcuda::wmma (shadows CUDA's <mma.h>: the harness puts this directory first).
//
// A fragment's layout across the lanes of a warp is opaque in CUDA, so the emulation is free to
// give every lane the whole tile: each lane loads, multiplies and stores all of it. Stores of a
// warp write the same values from every lane, so they never conflict. As CUDA documents for
// load_matrix_sync, store_matrix_sync and mma_sync ("waits until all warp lanes have arrived"),
// each is a warp rendezvous (__syncwarp) before it touches memory: so every lane has read a tile
// before any lane stores over it (load O, O += P V, store O), and a lane's plain stores before
// the call are seen by the others. Products are exact in fp32 and summed in fp32, as the tensor
// cores' fp32 accumulation (up to summation order).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {
inline float as_float(float x) { return x; }
inline float as_float(__half x) { return __half2float(x); }
inline float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }
}  // namespace detail

// Only the 16x16x16 shape; every fragment holds its tile as floats (inputs are exact in fp32).
template <typename Use, int M, int N, int K, typename T, typename Layout = void>
class fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulation implements m16n16k16 only");

 public:
  static constexpr int num_elements = 256;
  float x[256];  // (row, col) at x[row * 16 + col]
};

template <typename T, typename L>
void load_matrix_sync(fragment<matrix_a, 16, 16, 16, T, L>& a, const T* p, unsigned ldm) {
  // a is (m = 16) x (k = 16): row_major (i, k) at p[i * ldm + k]
  constexpr bool row = std::is_same<L, row_major>::value;
  __syncwarp();
  for (int i = 0; i < 16; ++i)
    for (int k = 0; k < 16; ++k) a.x[i * 16 + k] = detail::as_float(row ? p[i * ldm + k] : p[i + k * ldm]);
}

template <typename T, typename L>
void load_matrix_sync(fragment<matrix_b, 16, 16, 16, T, L>& b, const T* p, unsigned ldm) {
  // b is (k = 16) x (n = 16): row_major (k, j) at p[k * ldm + j]
  constexpr bool row = std::is_same<L, row_major>::value;
  __syncwarp();
  for (int k = 0; k < 16; ++k)
    for (int j = 0; j < 16; ++j) b.x[k * 16 + j] = detail::as_float(row ? p[k * ldm + j] : p[k + j * ldm]);
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& c, const float* p,
                             unsigned ldm, layout_t layout) {
  __syncwarp();
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) c.x[i * 16 + j] = layout == mem_row_major ? p[i * ldm + j] : p[i + j * ldm];
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& c,
                              unsigned ldm, layout_t layout) {
  __syncwarp();
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) (layout == mem_row_major ? p[i * ldm + j] : p[i + j * ldm]) = c.x[i * 16 + j];
}

template <typename Use, typename T, typename L, typename V>
void fill_fragment(fragment<Use, 16, 16, 16, T, L>& f, const V& value) {
  const float v = detail::as_float(static_cast<T>(value));
  for (int i = 0; i < 256; ++i) f.x[i] = v;
}

template <typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, T, LA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  __syncwarp();
  float out[256];
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 16; ++j) {
      float s = c.x[i * 16 + j];
      for (int k = 0; k < 16; ++k) s += a.x[i * 16 + k] * b.x[k * 16 + j];
      out[i * 16 + j] = s;
    }
  }
  for (int i = 0; i < 256; ++i) d.x[i] = out[i];
}

}  // namespace wmma
}  // namespace nvcuda
