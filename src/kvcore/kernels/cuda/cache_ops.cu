// KV cache writes: reshape_and_cache (this step's K/V rows into their slots) and copy_blocks
// (copy-on-write of whole blocks in every layer).
#include "common.cuh"

// One block per token. A slot's row (Hkv, D) is contiguous in a (num_blocks, block_size, Hkv, D)
// cache, so the destination row starts at slot * Hkv * D.
template <typename scalar_t, typename cache_t>
__device__ void reshape_and_cache_row(
    const scalar_t* __restrict__ key,        // (T, Hkv, D)
    const scalar_t* __restrict__ value,      // (T, Hkv, D)
    cache_t* __restrict__ k_cache,           // (num_blocks, block_size, Hkv, D)
    cache_t* __restrict__ v_cache,
    const long long* __restrict__ slot_mapping,  // (T,), -1 = padding, skipped
    int row_len, float k_scale, float v_scale) {
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const scalar_t* k_src = key + (long long)blockIdx.x * row_len;
  const scalar_t* v_src = value + (long long)blockIdx.x * row_len;
  cache_t* k_dst = k_cache + slot * row_len;
  cache_t* v_dst = v_cache + slot * row_len;
  for (int i = threadIdx.x; i < row_len; i += blockDim.x) {
    // stored = x / scale, divided (not multiplied by 1/scale) to round as the reference does
    k_dst[i] = from_float<cache_t>(to_float(k_src[i]) / k_scale);
    v_dst[i] = from_float<cache_t>(to_float(v_src[i]) / v_scale);
  }
}

#define KVC_RESHAPE_AND_CACHE(suffix, scalar_t, cache_t)                                        \
  extern "C" __global__ void reshape_and_cache_##suffix(                                        \
      const scalar_t* key, const scalar_t* value, cache_t* k_cache, cache_t* v_cache,          \
      const long long* slot_mapping, int row_len, float k_scale, float v_scale) {              \
    reshape_and_cache_row<scalar_t, cache_t>(key, value, k_cache, v_cache, slot_mapping,       \
                                             row_len, k_scale, v_scale);                       \
  }

KVC_RESHAPE_AND_CACHE(f32_f32, float, float)
KVC_RESHAPE_AND_CACHE(f16_f16, __half, __half)
KVC_RESHAPE_AND_CACHE(bf16_bf16, __nv_bfloat16, __nv_bfloat16)
KVC_RESHAPE_AND_CACHE(f32_f16, float, __half)
KVC_RESHAPE_AND_CACHE(f32_bf16, float, __nv_bfloat16)
KVC_RESHAPE_AND_CACHE(f32_fp8, float, __nv_fp8_e4m3)
KVC_RESHAPE_AND_CACHE(f16_fp8, __half, __nv_fp8_e4m3)
KVC_RESHAPE_AND_CACHE(bf16_fp8, __nv_bfloat16, __nv_fp8_e4m3)

// grid (num_layers, num_pairs): block (l, m) copies pair m of layer l in the K and the V cache.
// No destination may also be a source (the wrapper checks), so blocks never race.
extern "C" __global__ void copy_blocks(
    const long long* __restrict__ k_ptrs,         // (L,) device addresses of the K caches
    const long long* __restrict__ v_ptrs,         // (L,)
    const long long* __restrict__ block_mapping,  // (M, 2) src, dst
    long long bytes_per_block) {
  const long long src = block_mapping[2 * blockIdx.y];
  const long long dst = block_mapping[2 * blockIdx.y + 1];
  unsigned char* k = reinterpret_cast<unsigned char*>(k_ptrs[blockIdx.x]);
  unsigned char* v = reinterpret_cast<unsigned char*>(v_ptrs[blockIdx.x]);
  if (bytes_per_block % 16 == 0) {
    // 16-byte words: allocations are 256-byte aligned, so every block start is 16-byte aligned
    const long long words = bytes_per_block / 16;
    uint4* k4 = reinterpret_cast<uint4*>(k);
    uint4* v4 = reinterpret_cast<uint4*>(v);
    for (long long i = threadIdx.x; i < words; i += blockDim.x) {
      k4[dst * words + i] = k4[src * words + i];
      v4[dst * words + i] = v4[src * words + i];
    }
  } else {
    for (long long i = threadIdx.x; i < bytes_per_block; i += blockDim.x) {
      k[dst * bytes_per_block + i] = k[src * bytes_per_block + i];
      v[dst * bytes_per_block + i] = v[src * bytes_per_block + i];
    }
  }
}
