// Paged attention for decode: one query token per sequence against its paged K/V cache.
//
// grid (num_kv_heads, num_seqs, max_partitions), 128 threads. A block owns one KV head of one
// sequence and one partition of its context, and serves all G query heads of that KV head, so
// each K/V row is read once for the whole group (GQA). Scores of the partition live in shared
// memory (exact softmax inside the partition, in fp32); with more than one partition the block
// writes its normalized partial output with its max logit and exp-sum, and
// paged_attention_reduce merges the partitions (log-sum-exp rescaling, fp32).
// Sequences whose query_start_loc span is not 1 token are left to the prefill kernel.
#include "common.cuh"

#define KVC_DECODE_THREADS 128
#define KVC_DECODE_WARPS (KVC_DECODE_THREADS / KVC_WARP)
#define KVC_GCHUNK 8  // query heads whose accumulators are held in registers at once

struct DecodeArgs {
  int num_heads, num_kv_heads, head_dim, block_size, max_blocks, partition_size, max_partitions;
  int sliding_window;  // 0 = none
  float scale, k_scale, v_scale;
};

template <typename scalar_t, typename cache_t>
__device__ void decode_partition(
    scalar_t* __restrict__ out,                 // (T, H, D)
    float* __restrict__ tmp_out,                // (S, H, P, D), used when P > 1
    float* __restrict__ max_logits,             // (S, H, P)
    float* __restrict__ exp_sums,               // (S, H, P)
    const scalar_t* __restrict__ query,         // (T, H, D)
    const cache_t* __restrict__ k_cache,        // (num_blocks, block_size, Hkv, D)
    const cache_t* __restrict__ v_cache,
    const int* __restrict__ block_tables,       // (S, max_blocks)
    const int* __restrict__ context_lens,       // (S,)
    const int* __restrict__ query_start_loc,    // (S + 1,)
    const DecodeArgs a, float* smem) {
  const int kvh = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
  const int q_row = query_start_loc[seq];
  if (query_start_loc[seq + 1] - q_row != 1) return;
  const int ctx = context_lens[seq];
  const int first = a.sliding_window > 0 ? max(0, ctx - a.sliding_window) : 0;
  const int num_parts = (ctx - first + a.partition_size - 1) / a.partition_size;
  if (part >= num_parts) return;
  const int t0 = first + part * a.partition_size;
  const int n = min(a.partition_size, ctx - t0);  // tokens of this partition

  const int tid = threadIdx.x, lane = tid % KVC_WARP, warp = tid / KVC_WARP;
  const int D = a.head_dim, G = a.num_heads / a.num_kv_heads;
  float* q_s = smem;                          // (G, D) scaled queries
  float* logits = q_s + G * D;                // (G, partition_size) scores, then exp(score - max)
  float* red = logits + G * a.partition_size; // (GCHUNK, D) cross-warp output sums
  float* stats = red + KVC_GCHUNK * D;        // (2, G) max logit, exp-sum

  for (int i = tid; i < G * D; i += KVC_DECODE_THREADS) {
    const int h = KVC_QHEAD(kvh, i / D, G, a.num_kv_heads);
    q_s[i] = to_float(query[((long long)q_row * a.num_heads + h) * D + i % D]) * a.scale * a.k_scale;
  }
  __syncthreads();

  const int* table = block_tables + (long long)seq * a.max_blocks;
  const long long row_stride = (long long)a.num_kv_heads * D;  // elements between two slots
  const int num_chunks = D / 8;

  // Scores: one thread per token, the query rows are broadcast from shared memory.
  for (int g0 = 0; g0 < G; g0 += KVC_GCHUNK) {
    const int gc = min(KVC_GCHUNK, G - g0);
    for (int i = tid; i < n; i += KVC_DECODE_THREADS) {
      const int pos = t0 + i;
      const long long slot = (long long)table[pos / a.block_size] * a.block_size + pos % a.block_size;
      const cache_t* k = k_cache + slot * row_stride + (long long)kvh * D;
      float acc[KVC_GCHUNK];
#pragma unroll
      for (int g = 0; g < KVC_GCHUNK; ++g) acc[g] = 0.0f;
      for (int c = 0; c < num_chunks; ++c) {
        float kv[8];
        load8(k + c * 8, kv);
#pragma unroll
        for (int g = 0; g < KVC_GCHUNK; ++g) {
          if (g < gc) {
            // every lane reads the same query chunk: two broadcast 16-byte shared loads
            const float4* q = reinterpret_cast<const float4*>(q_s + (g0 + g) * D + c * 8);
            const float4 qa = q[0], qb = q[1];
            acc[g] += qa.x * kv[0] + qa.y * kv[1] + qa.z * kv[2] + qa.w * kv[3] +
                      qb.x * kv[4] + qb.y * kv[5] + qb.z * kv[6] + qb.w * kv[7];
          }
        }
      }
#pragma unroll
      for (int g = 0; g < KVC_GCHUNK; ++g) {
        if (g < gc) logits[(g0 + g) * a.partition_size + i] = acc[g];
      }
    }
  }
#ifndef KVC_BREAK_SYNC
  __syncthreads();
#endif

  // Softmax statistics: one warp per query head.
  for (int g = warp; g < G; g += KVC_DECODE_WARPS) {
    float* row = logits + g * a.partition_size;
    float m = kvc_neg_inf();
    for (int i = lane; i < n; i += KVC_WARP) m = fmaxf(m, row[i]);
    m = warp_max(m);
    float sum = 0.0f;
    for (int i = lane; i < n; i += KVC_WARP) {
      const float p = __expf(row[i] - m);
      row[i] = p;
      sum += p;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      stats[g] = m;
      stats[G + g] = sum;
    }
  }
  __syncthreads();

  // Weighted values: lane = (token slot, 8-element chunk); D is a power of two <= 256.
  const int chunk = lane % num_chunks, sub = lane / num_chunks;
  const int subs = KVC_WARP / num_chunks;
  for (int g0 = 0; g0 < G; g0 += KVC_GCHUNK) {
    const int gc = min(KVC_GCHUNK, G - g0);
    float acc[KVC_GCHUNK][8];
#pragma unroll
    for (int g = 0; g < KVC_GCHUNK; ++g) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[g][j] = 0.0f;
    }
    for (int i = warp * subs + sub; i < n; i += KVC_DECODE_WARPS * subs) {
      const int pos = t0 + i;
      const long long slot = (long long)table[pos / a.block_size] * a.block_size + pos % a.block_size;
      float vv[8];
      load8(v_cache + slot * row_stride + (long long)kvh * D + chunk * 8, vv);
#pragma unroll
      for (int g = 0; g < KVC_GCHUNK; ++g) {
        if (g < gc) {
          const float p = logits[(g0 + g) * a.partition_size + i];
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[g][j] += p * vv[j];
        }
      }
    }
    for (int offset = num_chunks; offset < KVC_WARP; offset <<= 1) {
#pragma unroll
      for (int g = 0; g < KVC_GCHUNK; ++g) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] += __shfl_xor_sync(KVC_FULL_MASK, acc[g][j], offset);
      }
    }
    // Warps add their sums in a fixed order, so the result does not depend on scheduling.
    for (int w = 0; w < KVC_DECODE_WARPS; ++w) {
      if (warp == w && sub == 0) {
#pragma unroll
        for (int g = 0; g < KVC_GCHUNK; ++g) {
          if (g < gc) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              float* r = red + g * D + chunk * 8 + j;
              *r = (w == 0 ? 0.0f : *r) + acc[g][j];
            }
          }
        }
      }
      __syncthreads();
    }
    for (int i = tid; i < gc * D; i += KVC_DECODE_THREADS) {
      const int g = g0 + i / D, d = i % D;
      const int h = KVC_QHEAD(kvh, g, G, a.num_kv_heads);
      const float o = red[i] * a.v_scale / stats[G + g];
      if (a.max_partitions == 1) {
        out[((long long)q_row * a.num_heads + h) * D + d] = from_float<scalar_t>(o);
      } else {
        tmp_out[(((long long)seq * a.num_heads + h) * a.max_partitions + part) * D + d] = o;
      }
    }
    __syncthreads();  // red is rewritten by the next group chunk
  }
  if (a.max_partitions > 1) {
    for (int g = tid; g < G; g += KVC_DECODE_THREADS) {
      const int h = KVC_QHEAD(kvh, g, G, a.num_kv_heads);
      const long long idx = ((long long)seq * a.num_heads + h) * a.max_partitions + part;
      max_logits[idx] = stats[g];
      exp_sums[idx] = stats[G + g];
    }
  }
}

// grid (H, S), 128 threads: out = sum_p w_p * partial_p / sum_p w_p with
// w_p = exp_sum_p * exp(max_p - max over partitions).
template <typename scalar_t>
__device__ void decode_reduce(
    scalar_t* __restrict__ out, const float* __restrict__ tmp_out,
    const float* __restrict__ max_logits, const float* __restrict__ exp_sums,
    const int* __restrict__ context_lens, const int* __restrict__ query_start_loc,
    int num_heads, int head_dim, int partition_size, int max_partitions, int sliding_window,
    float* weights) {
  const int h = blockIdx.x, seq = blockIdx.y;
  const int q_row = query_start_loc[seq];
  if (query_start_loc[seq + 1] - q_row != 1) return;
  const int ctx = context_lens[seq];
  const int first = sliding_window > 0 ? max(0, ctx - sliding_window) : 0;
  const int num_parts = (ctx - first + partition_size - 1) / partition_size;
  const long long base = ((long long)seq * num_heads + h) * max_partitions;
  if (threadIdx.x < KVC_WARP) {
    const int lane = threadIdx.x;
    float m = kvc_neg_inf();
    for (int p = lane; p < num_parts; p += KVC_WARP) m = fmaxf(m, max_logits[base + p]);
    m = warp_max(m);
    float total = 0.0f;
    for (int p = lane; p < num_parts; p += KVC_WARP) {
      const float w = exp_sums[base + p] * __expf(max_logits[base + p] - m);
      weights[p] = w;
      total += w;
    }
    total = warp_sum(total);
    if (lane == 0) weights[max_partitions] = total;
  }
  __syncthreads();
  const float inv_total = 1.0f / weights[max_partitions];
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.0f;
    for (int p = 0; p < num_parts; ++p) acc += weights[p] * tmp_out[(base + p) * head_dim + d];
    out[((long long)q_row * num_heads + h) * head_dim + d] = from_float<scalar_t>(acc * inv_total);
  }
}

#define KVC_DECODE(suffix, scalar_t, cache_t)                                                    \
  extern "C" __global__ void __launch_bounds__(KVC_DECODE_THREADS)                               \
  paged_attention_decode_##suffix(                                                               \
      scalar_t* out, float* tmp_out, float* max_logits, float* exp_sums, const scalar_t* query,  \
      const cache_t* k_cache, const cache_t* v_cache, const int* block_tables,                  \
      const int* context_lens, const int* query_start_loc, int num_heads, int num_kv_heads,     \
      int head_dim, int block_size, int max_blocks, int partition_size, int max_partitions,     \
      int sliding_window, float scale, float k_scale, float v_scale) {                          \
    extern __shared__ __align__(16) float kvc_smem[];                                           \
    const DecodeArgs a = {num_heads, num_kv_heads, head_dim, block_size, max_blocks,            \
                          partition_size, max_partitions, sliding_window, scale, k_scale,       \
                          v_scale};                                                              \
    decode_partition<scalar_t, cache_t>(out, tmp_out, max_logits, exp_sums, query, k_cache,     \
                                        v_cache, block_tables, context_lens, query_start_loc,   \
                                        a, kvc_smem);                                            \
  }

KVC_DECODE(f32_f32, float, float)
KVC_DECODE(f16_f16, __half, __half)
KVC_DECODE(bf16_bf16, __nv_bfloat16, __nv_bfloat16)
KVC_DECODE(f32_f16, float, __half)
KVC_DECODE(f32_bf16, float, __nv_bfloat16)
KVC_DECODE(f32_fp8, float, __nv_fp8_e4m3)
KVC_DECODE(f16_fp8, __half, __nv_fp8_e4m3)
KVC_DECODE(bf16_fp8, __nv_bfloat16, __nv_fp8_e4m3)

#define KVC_REDUCE(suffix, scalar_t)                                                             \
  extern "C" __global__ void paged_attention_reduce_##suffix(                                    \
      scalar_t* out, const float* tmp_out, const float* max_logits, const float* exp_sums,      \
      const int* context_lens, const int* query_start_loc, int num_heads, int head_dim,         \
      int partition_size, int max_partitions, int sliding_window) {                             \
    extern __shared__ __align__(16) float kvc_smem[];                                           \
    decode_reduce<scalar_t>(out, tmp_out, max_logits, exp_sums, context_lens, query_start_loc,  \
                            num_heads, head_dim, partition_size, max_partitions,                \
                            sliding_window, kvc_smem);                                           \
  }

KVC_REDUCE(f32, float)
KVC_REDUCE(f16, __half)
KVC_REDUCE(bf16, __nv_bfloat16)
