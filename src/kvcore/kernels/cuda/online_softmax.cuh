// The online softmax of the register-tile kernels (decode_tc, prefill_mma) on mma.sync
// accumulators, in the fragment layout ptx_ops.cuh states: a lane holds rows g and g + 8 (index
// r = e >> 1 of an accumulator element e), the 4 lanes of a row (t) share it by shuffles.
#pragma once
#include "common.cuh"
#include "mma_tile.cuh"

// Row maxima over the 4 lanes of each row.
__device__ __forceinline__ void quad_max(float (&mx)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(KVC_FULL_MASK, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(KVC_FULL_MASK, mx[r], 2));
  }
}
// Row sums over the 4 lanes of each row.
__device__ __forceinline__ void quad_sum(float (&l)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(KVC_FULL_MASK, l[r], 1);
    l[r] += __shfl_xor_sync(KVC_FULL_MASK, l[r], 2);
  }
}
// The running max m becomes mx; O and l are rescaled by exp(m - mx), skipped (a warp vote)
// when no row's max grew.
template <int kON>
__device__ __forceinline__ void rescale_if_grew(float (&o)[kON][4], float (&m)[2], float (&l)[2],
                                                const float (&mx)[2]) {
  if (__any_sync(KVC_FULL_MASK, mx[0] != m[0] || mx[1] != m[1])) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float alpha = m[r] == kvc_neg_inf() ? 0.0f : __expf(m[r] - mx[r]);
      l[r] *= alpha;
#pragma unroll
      for (int n = 0; n < kON; ++n) {
        o[n][2 * r] *= alpha;
        o[n][2 * r + 1] *= alpha;
      }
      m[r] = mx[r];
    }
  }
}
// P = exp(S - m) rounded to the activation type, as the A fragments of P V straight from S's
// registers (n-tile 2 ks holds keys 0-7 of step ks: A columns 2t, 2t+1; 2 ks + 1 keys 8-15);
// l sums P as rounded, as P V uses it. KVC_BREAK_FRAGMENT (a test mutant) swaps two registers.
template <typename scalar_t, int kN>
__device__ __forceinline__ void p_fragments(unsigned (&pf)[kN / 2][4], const float (&s)[kN][4],
                                            const float (&m)[2], float (&l)[2]) {
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    scalar_t p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p[e] = from_float<scalar_t>(s[j][e] == kvc_neg_inf() ? 0.0f : __expf(s[j][e] - m[e >> 1]));
      l[e >> 1] += to_float(p[e]);
    }
    pf[j / 2][2 * (j & 1)] = pack2(p[0], p[1]);      // row g
    pf[j / 2][2 * (j & 1) + 1] = pack2(p[2], p[3]);  // row g + 8
  }
#ifdef KVC_BREAK_FRAGMENT  // rows g + 8 and keys 8-15 trade places
  for (int ks = 0; ks < kN / 2; ++ks) {
    const unsigned swap = pf[ks][1];
    pf[ks][1] = pf[ks][2];
    pf[ks][2] = swap;
  }
#endif
}
