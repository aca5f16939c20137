// The int4 KV cache's writes (kvcore.cache.int4 is the byte layout and the reference):
// reshape_and_cache_int4_* puts this step's K/V rows into the fp16 window slot of their block,
// seal_blocks_int4 quantizes whole window slots into sealed blocks' K and V rows.
//
// Per layer: k_rows / v_rows (num_blocks, row bytes) uint8, k_window / v_window
// (num_slots, block_size, Hkv, D) fp16, window_slot (num_blocks,) int32: -1 = sealed, else the
// window slot whose fp16 tokens the block holds.
#include "common.cuh"

#define KVC_FP16_MAX 65504.0f

// One block per token; a token whose block is sealed (or padding, slot -1) is skipped: the
// wrapper refuses host slot mappings into sealed blocks.
template <typename scalar_t>
__device__ void reshape_and_cache_int4_row(
    const scalar_t* __restrict__ key,            // (T, Hkv, D)
    const scalar_t* __restrict__ value,          // (T, Hkv, D)
    __half* __restrict__ k_window,               // (num_slots, block_size, Hkv, D)
    __half* __restrict__ v_window,
    const int* __restrict__ window_slot,         // (num_blocks,)
    const long long* __restrict__ slot_mapping,  // (T,), -1 = padding
    int block_size, int row_len) {
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const int window = window_slot[slot / block_size];
  if (window < 0) return;
  const long long row = ((long long)window * block_size + slot % block_size) * row_len;
  const scalar_t* k_src = key + (long long)blockIdx.x * row_len;
  const scalar_t* v_src = value + (long long)blockIdx.x * row_len;
  for (int i = threadIdx.x; i < row_len; i += blockDim.x) {
    k_window[row + i] = __float2half_rn(to_float(k_src[i]));
    v_window[row + i] = __float2half_rn(to_float(v_src[i]));
  }
}

#define KVC_RESHAPE_AND_CACHE_INT4(suffix, scalar_t)                                           \
  extern "C" __global__ void reshape_and_cache_int4_##suffix(                                  \
      const scalar_t* key, const scalar_t* value, __half* k_window, __half* v_window,          \
      const int* window_slot, const long long* slot_mapping, int block_size, int row_len) {    \
    reshape_and_cache_int4_row<scalar_t>(key, value, k_window, v_window, window_slot,          \
                                         slot_mapping, block_size, row_len);                   \
  }

KVC_RESHAPE_AND_CACHE_INT4(f32, float)
KVC_RESHAPE_AND_CACHE_INT4(f16, __half)
KVC_RESHAPE_AND_CACHE_INT4(bf16, __nv_bfloat16)

// NaN -> 0, +-inf and |x| > 65504 -> +-65504 (fmaxf / fminf would also map NaN, but keep it
// explicit).
__device__ __forceinline__ float int4_saturate(float x) {
  if (x != x) return 0.0f;
  return fminf(fmaxf(x, -KVC_FP16_MAX), KVC_FP16_MAX);
}

// The reference's parameters of one group: zero = fp16(min), scale = fp16((max - min) / 15).
__device__ __forceinline__ void int4_params(float lo, float hi, __half* scale, __half* zero) {
  *zero = __float2half_rn(lo);
  *scale = __float2half_rn((hi - lo) / 15.0f);  // IEEE division, as NumPy's
}

// q = clip(floor((x - zero) / scale + 0.5), 0, 15); 0 where scale == 0.
__device__ __forceinline__ unsigned int4_code(float x, __half scale, __half zero) {
  const float s = __half2float(scale), z = __half2float(zero);
  if (s == 0.0f) return 0u;
  const float q = floorf((x - z) / s + 0.5f);
  return (unsigned)fminf(fmaxf(q, 0.0f), 15.0f);
}

// grid (num_pairs, Hkv, num_layers), 128 threads; dynamic shared memory: block_size x D floats
// (the window slot's head, saturated) and block_size x D bytes (the codes). Pair m seals window
// slot pairs[m][1] into block pairs[m][0] of layer blockIdx.z; the window is left as it is.
extern "C" __global__ void seal_blocks_int4(
    const long long* __restrict__ k_row_ptrs,     // (L,) addresses of the K rows arrays
    const long long* __restrict__ v_row_ptrs,     // (L,)
    const long long* __restrict__ k_window_ptrs,  // (L,) addresses of the fp16 windows
    const long long* __restrict__ v_window_ptrs,  // (L,)
    const long long* __restrict__ pairs,          // (M, 2) block_id, window slot
    int block_size, int num_kv_heads, int head_dim, int group, long long key_row_bytes,
    long long value_row_bytes) {
  extern __shared__ __align__(16) unsigned char kvc_seal_smem[];
  float* x = reinterpret_cast<float*>(kvc_seal_smem);                        // (bs, D)
  unsigned char* q = kvc_seal_smem + (long long)block_size * head_dim * 4;  // (bs, D)
  const long long block = pairs[2 * blockIdx.x], window = pairs[2 * blockIdx.x + 1];
  const int h = blockIdx.y, layer = blockIdx.z, D = head_dim, n = D / group;
  const long long nibbles = (long long)block_size * num_kv_heads * D / 2;  // params follow
  for (int side = 0; side < 2; ++side) {  // K, then V
    const __half* win = reinterpret_cast<const __half*>(
        (side == 0 ? k_window_ptrs : v_window_ptrs)[layer]);
    unsigned char* row = reinterpret_cast<unsigned char*>(
        (side == 0 ? k_row_ptrs : v_row_ptrs)[layer]) +
        block * (side == 0 ? key_row_bytes : value_row_bytes);
    __half* params = reinterpret_cast<__half*>(row + nibbles);
    for (int i = threadIdx.x; i < block_size * D; i += blockDim.x) {
      const int p = i / D, c = i % D;
      x[i] = int4_saturate(__half2float(
          win[((window * block_size + p) * num_kv_heads + h) * (long long)D + c]));
    }
    __syncthreads();
    if (side == 0) {  // keys: per channel over the block's tokens; params (2, Hkv, D)
      for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float lo = x[c], hi = x[c];
        for (int p = 1; p < block_size; ++p) {
          lo = fminf(lo, x[p * D + c]);
          hi = fmaxf(hi, x[p * D + c]);
        }
        __half scale, zero;
        int4_params(lo, hi, &scale, &zero);
        params[h * D + c] = scale;
        params[(num_kv_heads + h) * D + c] = zero;
        for (int p = 0; p < block_size; ++p) q[p * D + c] = int4_code(x[p * D + c], scale, zero);
      }
    } else {  // values: per token in groups of `group` channels; params (2, bs, Hkv, D / group)
      for (int i = threadIdx.x; i < block_size * n; i += blockDim.x) {
        const int p = i / n, c0 = (i % n) * group;
        float lo = x[p * D + c0], hi = lo;
        for (int c = 1; c < group; ++c) {
          lo = fminf(lo, x[p * D + c0 + c]);
          hi = fmaxf(hi, x[p * D + c0 + c]);
        }
        __half scale, zero;
        int4_params(lo, hi, &scale, &zero);
        const long long at = ((long long)p * num_kv_heads + h) * n + i % n;
        params[at] = scale;
        params[(long long)block_size * num_kv_heads * n + at] = zero;
        for (int c = 0; c < group; ++c) {
          q[p * D + c0 + c] = int4_code(x[p * D + c0 + c], scale, zero);
        }
      }
    }
    __syncthreads();
    // nibbles (bs, Hkv, D / 2): channel 2c low, 2c + 1 high
    for (int i = threadIdx.x; i < block_size * D / 2; i += blockDim.x) {
      const int p = i / (D / 2), c = i % (D / 2);
      row[((long long)p * num_kv_heads + h) * (D / 2) + c] =
          (unsigned char)(q[p * D + 2 * c] | (q[p * D + 2 * c + 1] << 4));
    }
    __syncthreads();  // x and q are reused by the next side
  }
}
