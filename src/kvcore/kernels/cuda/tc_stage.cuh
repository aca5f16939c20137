// Staging of paged cache rows into shared-memory tiles for the tensor-core kernels: 16-byte
// loads of the cache converted (fp8: dequantized) to the 16-bit activation type.
#pragma once
#include "common.cuh"

// Eight consecutive cache elements converted to the activation type (16 bytes of output).
template <typename scalar_t, typename cache_t>
__device__ __forceinline__ void stage8(const cache_t* src, scalar_t* dst) {
  float v[8];
  load8(src, v);
#pragma unroll
  for (int i = 0; i < 8; ++i) dst[i] = from_float<scalar_t>(v[i]);
}
__device__ __forceinline__ void stage8(const __half* src, __half* dst) {
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
__device__ __forceinline__ void stage8(const __nv_bfloat16* src, __nv_bfloat16* dst) {
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}

// One 16-byte load of K or V staged as activations: 8 elements of a 16-bit cache, 16 of fp8
// (two conversions of 8: the cache dequantized while staged).
template <typename cache_t> struct StageChunk { static constexpr int kElems = 8; };
template <> struct StageChunk<__nv_fp8_e4m3> { static constexpr int kElems = 16; };

template <typename scalar_t, typename cache_t>
__device__ __forceinline__ void stage_chunk(const cache_t* src, scalar_t* dst) {
  if constexpr (StageChunk<cache_t>::kElems == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);  // 16 fp8 values
    const cache_t* e = reinterpret_cast<const cache_t*>(&raw);
    stage8(e, dst);
    stage8(e + 8, dst + 8);
  } else {
    stage8(src, dst);
  }
}
