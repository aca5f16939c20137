// Shared device helpers of the kvcore kernels: element conversions, vector loads, reductions.
//
// Element types: float, __half, __nv_bfloat16 for activations; the same or __nv_fp8_e4m3
// (stored value = x / scale, saturating at +-448 like the NumPy reference) for the KV cache.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#define KVC_FULL_MASK 0xffffffffu
#define KVC_WARP 32

// Query head of group member g of KV head kvh. Query heads h = kvh * G .. kvh * G + G - 1 share
// KV head kvh (HF repeat_kv). KVC_BREAK_GQA swaps in a wrong (strided) mapping so the tests can
// show that the emulated comparison catches it.
#ifdef KVC_BREAK_GQA
#define KVC_QHEAD(kvh, g, group, num_kv_heads) ((g) * (num_kv_heads) + (kvh))
#else
#define KVC_QHEAD(kvh, g, group, num_kv_heads) ((kvh) * (group) + (g))
#endif

__device__ __forceinline__ float kvc_neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float x) {
  __nv_fp8_e4m3 out;
  out.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  return out;
}

// Eight consecutive elements as floats in one (or two, for fp32) vector load. `p` must be
// aligned to 8 elements: the kernels only call it at offsets that are multiples of 8 inside rows
// whose length is a multiple of 8.
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ void load8(const __half* p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void load8(const __nv_fp8_e4m3* p, float (&v)[8]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // one packed e4m3x2 -> f16x2 conversion per pair (a single instruction on sm_89+)
    const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3));
    const float2 f = __half22float2(h);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

// Butterfly reductions: every lane ends with the same, bitwise identical result.
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    x = fmaxf(x, __shfl_xor_sync(KVC_FULL_MASK, x, offset));
  }
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(KVC_FULL_MASK, x, offset);
  return x;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). `scratch` holds 32
// floats of shared memory; the trailing barrier lets the caller reuse it at once.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  const int lane = threadIdx.x % KVC_WARP;
  const int warp = threadIdx.x / KVC_WARP;
  const int num_warps = blockDim.x / KVC_WARP;
  x = warp_sum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < num_warps; ++w) total += scratch[w];  // same order in every thread
  __syncthreads();
  return total;
}
