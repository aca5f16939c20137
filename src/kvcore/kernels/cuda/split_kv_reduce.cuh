// Split-KV decode shared by the decode kernels: how a sequence's KV span is cut into partitions,
// and the merge of the partitions (each wrote its normalized partial output, max logit and
// exp-sum; decode_reduce weights them by log-sum-exp).
#pragma once
#include "common.cuh"

#define KVC_MAX_PARTITIONS 32  // kvcore.kernels.cuda.occupancy.MAX_PARTITIONS

// The partitions of one sequence's KV span, blocks [kb_first, kb_end): runs of `per` whole
// blocks, at least partition_tokens tokens each (a constant of the planner) and at most
// KVC_MAX_PARTITIONS of them. They are fixed by the sequence's own span, never by the batch or
// the grid, so a sequence's output bits do not depend on what it is decoded with.
struct KvSplit {
  int count;  // partitions of this sequence (1: the output is written directly, no merge)
  int lo;     // first KV block of partition `part`
  int hi;     // one past its last (lo >= hi: nothing for this partition)
};
__device__ __forceinline__ KvSplit kv_split(int kb_first, int kb_end, int block_size,
                                            int partition_tokens, int part) {
  const int span = kb_end - kb_first;
  const int per = max((partition_tokens + block_size - 1) / block_size,
                      (span + KVC_MAX_PARTITIONS - 1) / KVC_MAX_PARTITIONS);
  const int lo = kb_first + part * per;
  return {max(1, (span + per - 1) / per), lo, min(kb_end, lo + per)};
}

// grid (H, S), 128 threads: out = sum_p w_p * partial_p / sum_p w_p over the sequence's `count`
// partitions (the scratch holds num_partitions per row), w_p = exp_sum_p * exp(max_p - max over
// partitions); empty partitions have w_p = 0. A sequence of one partition was written directly.
template <typename scalar_t>
__device__ void decode_reduce(
    scalar_t* __restrict__ out, const float* __restrict__ tmp_out,
    const float* __restrict__ max_logits, const float* __restrict__ exp_sums,
    const int* __restrict__ query_start_loc, int num_heads, int head_dim, int num_partitions,
    int count, float* weights) {
  const int h = blockIdx.x, seq = blockIdx.y;
  const int q_row = query_start_loc[seq];
  if (query_start_loc[seq + 1] - q_row != 1 || count <= 1) return;
  const long long base = ((long long)seq * num_heads + h) * num_partitions;
  if (threadIdx.x < KVC_WARP) {
    const int lane = threadIdx.x;
    float m = kvc_neg_inf();
    for (int p = lane; p < count; p += KVC_WARP) {
      if (exp_sums[base + p] > 0.0f) m = fmaxf(m, max_logits[base + p]);
    }
    m = warp_max(m);
    float total = 0.0f;
    for (int p = lane; p < count; p += KVC_WARP) {
      const float l = exp_sums[base + p];
      const float w = l > 0.0f ? l * __expf(max_logits[base + p] - m) : 0.0f;
      weights[p] = w;
      total += w;
    }
    total = warp_sum(total);
    if (lane == 0) weights[count] = total;
  }
  __syncthreads();
  const float inv_total = 1.0f / weights[count];
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.0f;
    for (int p = 0; p < count; ++p) {
      if (weights[p] > 0.0f) acc += weights[p] * tmp_out[(base + p) * head_dim + d];
    }
    out[((long long)q_row * num_heads + h) * head_dim + d] = from_float<scalar_t>(acc * inv_total);
  }
}
