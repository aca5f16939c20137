// Fused element-wise layers: RMSNorm (one pass for the reduction and the scaling), rotate-half
// RoPE (both halves in one kernel) and SwiGLU's silu(gate) * up. One block per token row; math
// in fp32, results in the activation dtype.
#include "common.cuh"

// out = x / sqrt(mean(x^2) + eps) * weight; grid (T,), blockDim a multiple of 32.
template <typename T>
__device__ void rms_norm_row(T* __restrict__ out, const T* __restrict__ x,
                             const T* __restrict__ weight, float eps, int hidden) {
  __shared__ float scratch[KVC_WARP];
  const T* row = x + (long long)blockIdx.x * hidden;
  float sum_sq = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = to_float(row[i]);
    sum_sq += v * v;
  }
  sum_sq = block_sum(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / hidden + eps);
  T* dst = out + (long long)blockIdx.x * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    dst[i] = from_float<T>(to_float(row[i]) * inv_rms * to_float(weight[i]));
  }
}

// x (T, 2I) = [gate | up] -> out (T, I) = silu(gate) * up; grid (T,).
template <typename T>
__device__ void silu_and_mul_row(T* __restrict__ out, const T* __restrict__ x, int inter) {
  const T* row = x + (long long)blockIdx.x * 2 * inter;
  T* dst = out + (long long)blockIdx.x * inter;
  for (int i = threadIdx.x; i < inter; i += blockDim.x) {
    const float gate = to_float(row[i]);
    dst[i] = from_float<T>(gate / (1.0f + __expf(-gate)) * to_float(row[inter + i]));
  }
}

// x (T, H, D) -> out (T, H, D) contiguous, rotate-half (HF) with cos/sin (max_pos, D/2) fp32;
// grid (T,). x's tokens may lie `x_stride` elements apart (q/k as column slices of the fused
// qkv projection), each token's (H, D) contiguous.
template <typename T>
__device__ void rope_row(T* __restrict__ out, const T* __restrict__ x,
                         const long long* __restrict__ positions, const float* __restrict__ cos,
                         const float* __restrict__ sin, int num_heads, int head_dim,
                         long long x_stride) {
  const int half = head_dim / 2;
  const long long pos = positions[blockIdx.x];
  const T* src = x + blockIdx.x * x_stride;
  T* dst = out + (long long)blockIdx.x * num_heads * head_dim;
  for (int i = threadIdx.x; i < num_heads * half; i += blockDim.x) {
    const int h = i / half, j = i % half;
    const float c = cos[pos * half + j], s = sin[pos * half + j];
    const int lo = h * head_dim + j;
    const float x1 = to_float(src[lo]), x2 = to_float(src[lo + half]);
    dst[lo] = from_float<T>(x1 * c - x2 * s);
    dst[lo + half] = from_float<T>(x2 * c + x1 * s);
  }
}

#define KVC_LAYERS(suffix, T)                                                                    \
  extern "C" __global__ void rms_norm_##suffix(T* out, const T* x, const T* weight, float eps,  \
                                               int hidden) {                                    \
    rms_norm_row<T>(out, x, weight, eps, hidden);                                               \
  }                                                                                              \
  extern "C" __global__ void silu_and_mul_##suffix(T* out, const T* x, int inter) {             \
    silu_and_mul_row<T>(out, x, inter);                                                          \
  }                                                                                              \
  extern "C" __global__ void rope_##suffix(T* out, const T* x, const long long* positions,      \
                                           const float* cos, const float* sin, int num_heads,   \
                                           int head_dim, long long x_stride) {                   \
    rope_row<T>(out, x, positions, cos, sin, num_heads, head_dim, x_stride);                    \
  }

KVC_LAYERS(f32, float)
KVC_LAYERS(f16, __half)
KVC_LAYERS(bf16, __nv_bfloat16)
