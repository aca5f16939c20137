// Paged attention for prefill chunks: a chunk's queries against the cached prefix and causally
// within the chunk, honouring a sliding window.
//
// grid (num_kv_heads, num_seqs, query tiles), 128 threads. A block takes q_tile query tokens of
// one sequence times the G query heads of one KV head (rows = q_tile * G), walks the allowed keys
// in tiles of k_tile staged in shared memory as fp32, and keeps a flash-attention style online
// softmax per row (running max, running sum, rescaled accumulator), all in fp32.
// Sequences with a single query token are left to the decode kernel.
#include "common.cuh"

#define KVC_PREFILL_THREADS 128

struct PrefillArgs {
  int num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_tile, k_tile;
  int sliding_window;  // 0 = none
  float scale, k_scale, v_scale;
};

template <typename scalar_t, typename cache_t>
__device__ void prefill_tile(
    scalar_t* __restrict__ out,                // (T, H, D)
    const scalar_t* __restrict__ query,        // (T, H, D)
    const cache_t* __restrict__ k_cache,       // (num_blocks, block_size, Hkv, D)
    const cache_t* __restrict__ v_cache,
    const int* __restrict__ block_tables,      // (S, max_blocks)
    const int* __restrict__ context_lens,      // (S,)
    const int* __restrict__ query_start_loc,   // (S + 1,)
    const PrefillArgs a, float* smem) {
  const int kvh = blockIdx.x, seq = blockIdx.y;
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  const int i0 = blockIdx.z * a.q_tile;
  if (q_len <= 1 || i0 >= q_len) return;
  const int nq = min(a.q_tile, q_len - i0);
  const int ctx = context_lens[seq];
  const int pos0 = ctx - q_len + i0;  // position of the tile's first query
  const int D = a.head_dim, G = a.num_heads / a.num_kv_heads, rows = nq * G;
  const int kt = a.k_tile, tid = threadIdx.x;

  const int max_rows = a.q_tile * G;
  float* q_s = smem;                         // (rows, D) queries * scale * k_scale
  float* acc = q_s + max_rows * D;           // (rows, D) unnormalized outputs
  float* k_s = acc + max_rows * D;           // (k_tile, D + 1), padded against bank conflicts
  float* v_s = k_s + kt * (D + 1);           // (k_tile, D)
  float* p_s = v_s + kt * D;                 // (rows, k_tile) scores, then probabilities
  float* m_s = p_s + max_rows * kt;          // (rows,) running max
  float* l_s = m_s + max_rows;               // (rows,) running sum
  float* alpha_s = l_s + max_rows;           // (rows,) rescale factor of this key tile

  for (int i = tid; i < rows * D; i += KVC_PREFILL_THREADS) {
    const int r = i / D, d = i % D;
    const int h = KVC_QHEAD(kvh, r % G, G, a.num_kv_heads);
    const long long row = (long long)(q_start + i0 + r / G) * a.num_heads + h;
    q_s[i] = to_float(query[row * D + d]) * a.scale * a.k_scale;
    acc[i] = 0.0f;
  }
  for (int r = tid; r < rows; r += KVC_PREFILL_THREADS) {
    m_s[r] = kvc_neg_inf();
    l_s[r] = 0.0f;
  }

  const int* table = block_tables + (long long)seq * a.max_blocks;
  const long long row_stride = (long long)a.num_kv_heads * D;
  const int k_begin = a.sliding_window > 0 ? max(0, pos0 - a.sliding_window + 1) : 0;
  const int k_end = pos0 + nq;  // the last query sees keys up to its own position
  for (int kb = k_begin; kb < k_end; kb += kt) {
    const int nk = min(kt, k_end - kb);
    __syncthreads();  // the previous tile's k_s / v_s / p_s are no longer read
    for (int i = tid; i < nk * D; i += KVC_PREFILL_THREADS) {
      const int t = i / D, d = i % D, pos = kb + t;
      const long long slot = (long long)table[pos / a.block_size] * a.block_size + pos % a.block_size;
      const long long src = slot * row_stride + (long long)kvh * D + d;
      k_s[t * (D + 1) + d] = to_float(k_cache[src]);
      v_s[t * D + d] = to_float(v_cache[src]);
    }
    __syncthreads();
    for (int i = tid; i < rows * kt; i += KVC_PREFILL_THREADS) {
      const int r = i / kt, t = i % kt;
      const int q_pos = pos0 + r / G, k_pos = kb + t;
      const bool allowed = t < nk && k_pos <= q_pos &&
                           (a.sliding_window <= 0 || k_pos > q_pos - a.sliding_window);
      float s = kvc_neg_inf();
      if (allowed) {
        s = 0.0f;
        const float* q = q_s + r * D;
        const float* k = k_s + t * (D + 1);
        for (int d = 0; d < D; ++d) s += q[d] * k[d];
      }
      p_s[i] = s;
    }
    __syncthreads();
    for (int r = tid; r < rows; r += KVC_PREFILL_THREADS) {
      float* p = p_s + r * kt;
      const float m_old = m_s[r];
      float m_new = m_old;
      for (int t = 0; t < nk; ++t) m_new = fmaxf(m_new, p[t]);
      float sum = 0.0f;
      if (m_new == kvc_neg_inf()) {  // nothing allowed yet: keep the row empty
        for (int t = 0; t < kt; ++t) p[t] = 0.0f;
        alpha_s[r] = 1.0f;
      } else {
        for (int t = 0; t < kt; ++t) {
          const float e = t < nk ? __expf(p[t] - m_new) : 0.0f;
          p[t] = e;
          sum += e;
        }
        alpha_s[r] = __expf(m_old - m_new);  // exp(-inf) = 0 on the first allowed tile
      }
      l_s[r] = l_s[r] * alpha_s[r] + sum;
      m_s[r] = m_new;
    }
#ifndef KVC_BREAK_SYNC
    __syncthreads();
#endif
    for (int i = tid; i < rows * D; i += KVC_PREFILL_THREADS) {
      const int r = i / D, d = i % D;
      const float* p = p_s + r * kt;
      float o = acc[i] * alpha_s[r];
      for (int t = 0; t < nk; ++t) o += p[t] * v_s[t * D + d];
      acc[i] = o;
    }
  }
  __syncthreads();
  for (int i = tid; i < rows * D; i += KVC_PREFILL_THREADS) {
    const int r = i / D, d = i % D;
    const int h = KVC_QHEAD(kvh, r % G, G, a.num_kv_heads);
    const long long row = (long long)(q_start + i0 + r / G) * a.num_heads + h;
    out[row * D + d] = from_float<scalar_t>(acc[i] * a.v_scale / l_s[r]);
  }
}

#define KVC_PREFILL(suffix, scalar_t, cache_t)                                                   \
  extern "C" __global__ void __launch_bounds__(KVC_PREFILL_THREADS)                              \
  paged_attention_prefill_##suffix(                                                              \
      scalar_t* out, const scalar_t* query, const cache_t* k_cache, const cache_t* v_cache,     \
      const int* block_tables, const int* context_lens, const int* query_start_loc,             \
      int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,            \
      int q_tile, int k_tile, int sliding_window, float scale, float k_scale, float v_scale) {  \
    extern __shared__ __align__(16) float kvc_smem[];                                           \
    const PrefillArgs a = {num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_tile,   \
                           k_tile, sliding_window, scale, k_scale, v_scale};                    \
    prefill_tile<scalar_t, cache_t>(out, query, k_cache, v_cache, block_tables, context_lens,   \
                                    query_start_loc, a, kvc_smem);                               \
  }

KVC_PREFILL(f32_f32, float, float)
KVC_PREFILL(f16_f16, __half, __half)
KVC_PREFILL(bf16_bf16, __nv_bfloat16, __nv_bfloat16)
KVC_PREFILL(f32_f16, float, __half)
KVC_PREFILL(f32_bf16, float, __nv_bfloat16)
KVC_PREFILL(f32_fp8, float, __nv_fp8_e4m3)
KVC_PREFILL(f16_fp8, __half, __nv_fp8_e4m3)
KVC_PREFILL(bf16_fp8, __nv_bfloat16, __nv_fp8_e4m3)
