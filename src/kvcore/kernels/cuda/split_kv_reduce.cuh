// The merge of split-KV partitions shared by the decode kernels: each partition wrote its
// normalized partial output, max logit and exp-sum; decode_reduce weights them by log-sum-exp.
#pragma once
#include "common.cuh"

// grid (H, S), 128 threads: out = sum_p w_p * partial_p / sum_p w_p with
// w_p = exp_sum_p * exp(max_p - max over partitions); empty partitions have w_p = 0.
template <typename scalar_t>
__device__ void decode_reduce(
    scalar_t* __restrict__ out, const float* __restrict__ tmp_out,
    const float* __restrict__ max_logits, const float* __restrict__ exp_sums,
    const int* __restrict__ query_start_loc, int num_heads, int head_dim, int num_partitions,
    float* weights) {
  const int h = blockIdx.x, seq = blockIdx.y;
  const int q_row = query_start_loc[seq];
  if (query_start_loc[seq + 1] - q_row != 1) return;
  const long long base = ((long long)seq * num_heads + h) * num_partitions;
  if (threadIdx.x < KVC_WARP) {
    const int lane = threadIdx.x;
    float m = kvc_neg_inf();
    for (int p = lane; p < num_partitions; p += KVC_WARP) {
      if (exp_sums[base + p] > 0.0f) m = fmaxf(m, max_logits[base + p]);
    }
    m = warp_max(m);
    float total = 0.0f;
    for (int p = lane; p < num_partitions; p += KVC_WARP) {
      const float l = exp_sums[base + p];
      const float w = l > 0.0f ? l * __expf(max_logits[base + p] - m) : 0.0f;
      weights[p] = w;
      total += w;
    }
    total = warp_sum(total);
    if (lane == 0) weights[num_partitions] = total;
  }
  __syncthreads();
  const float inv_total = 1.0f / weights[num_partitions];
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.0f;
    for (int p = 0; p < num_partitions; ++p) {
      if (weights[p] > 0.0f) acc += weights[p] * tmp_out[(base + p) * head_dim + d];
    }
    out[((long long)q_row * num_heads + h) * head_dim + d] = from_float<scalar_t>(acc * inv_total);
  }
}
