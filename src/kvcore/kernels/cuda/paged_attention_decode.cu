// Paged attention for decode: one query token per sequence against its paged K/V cache.
//
// One compiled variant per (head_dim, GQA group, activation dtype, cache dtype): KVC_HEAD_DIM,
// KVC_GROUP, KVC_SCALAR and KVC_CACHE are -D options chosen by the launcher, so every loop over
// a row or a group unrolls, the accumulators live in registers, and a module holds one variant.
//
// grid (num_kv_heads, num_seqs, num_partitions), 128 threads (4 warps; 8 for groups over 4, so
// that a warp holds the state of one query head up to groups of 8, ceil(G / 8) above). A block owns one KV head
// of one sequence and one partition: a run of whole KV blocks (kv_split: fixed by the sequence's
// own span, never by the batch; blocks past the sequence's partitions return at once). Warp w serves the query heads
// g = w % HW + HW * j (HW = head warps) and walks every (warps / HW)-th KV block of the partition:
// it translates the block-table entry once per KV block, then reads the K and V rows of the block
// with coalesced 16-byte loads, lane = (token sub-row, 16-byte chunk), all loads of U steps issued
// before any is used. Scores and values are consumed in the same pass with an online softmax
// (fp32), each token sub-row keeping its own running max / sum / output; those partial states are
// merged at the end in a fixed order (shuffles, then shared memory), so results do not depend on
// scheduling. With more than one partition, the block writes its normalized output with its max
// logit and exp-sum, and paged_attention_reduce merges the partitions (log-sum-exp weights).
// Sequences whose query_start_loc span is not 1 token are left to the prefill kernel.
#include "common.cuh"
#include "split_kv_reduce.cuh"

#ifndef KVC_HEAD_DIM
#define KVC_HEAD_DIM 128
#endif
#ifndef KVC_GROUP
#define KVC_GROUP 1
#endif
#ifndef KVC_SCALAR
#define KVC_SCALAR __half
#endif
#ifndef KVC_CACHE
#define KVC_CACHE __half
#endif

#define KVC_DECODE_THREADS (KVC_GROUP > 4 ? 256 : 128)
#define KVC_DECODE_WARPS (KVC_DECODE_THREADS / KVC_WARP)

constexpr int kD = KVC_HEAD_DIM;
constexpr int kG = KVC_GROUP;
// head warps: the warps split the group's query heads among them, one head each up to 8 heads
// (every warp reads the KV blocks of its heads, the re-reads hit L1); a group smaller than the
// block's warps leaves warps over, which walk other KV blocks (or idle: 1 of 4 for a group of 3)
// (two heads per warp for groups of 5-8 would double the distinct bytes in flight per block, but
// takes 110-116 registers on sm_90: over the 96 budget)
constexpr int kHW = kG < KVC_DECODE_WARPS ? kG : KVC_DECODE_WARPS;
constexpr int kGW = (kG + kHW - 1) / kHW;  // query heads per warp
constexpr int kTW = KVC_DECODE_WARPS / kHW;  // warps walking different KV blocks
static_assert(kD >= 16 && kD <= 256 && (kD & (kD - 1)) == 0, "head_dim: power of two in [16, 256]");

// One lane's 16-byte chunk of a cache row: raw bits first (so all loads of a step are in flight
// before any conversion), floats second. fp32 caches use two 16-byte loads per chunk.
template <typename cache_t> struct Chunk {
  static constexpr int kElems = 8;
  static constexpr int kWords = 1;  // uint4 loads per chunk
};
template <> struct Chunk<float> {
  static constexpr int kElems = 8;
  static constexpr int kWords = 2;
};
template <> struct Chunk<__nv_fp8_e4m3> {
  static constexpr int kElems = 16;
  static constexpr int kWords = 1;
};

__device__ __forceinline__ void chunk_to_float(const float*, const uint4 (&r)[2], float (&v)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(&r[0]);
  const float4 b = *reinterpret_cast<const float4*>(&r[1]);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void chunk_to_float(const __half*, const uint4 (&r)[1], float (&v)[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&r[0]);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void chunk_to_float(const __nv_bfloat16*, const uint4 (&r)[1],
                                               float (&v)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&r[0]);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void chunk_to_float(const __nv_fp8_e4m3*, const uint4 (&r)[1],
                                               float (&v)[16]) {
  const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&r[0]);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3));
    const float2 f = __half22float2(h);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

// Online-softmax merge of a partial state (m2, l2, o2) into (m, l, o); symmetric in its two
// operands, so a butterfly gives both lanes bitwise the same result. An empty state has m = -inf.
template <int E>
__device__ __forceinline__ void merge_state(float& m, float& l, float (&o)[E], float m2, float l2,
                                            const float (&o2)[E]) {
  const float mx = fmaxf(m, m2);
  const float a = m == kvc_neg_inf() ? 0.0f : __expf(m - mx);
  const float b = m2 == kvc_neg_inf() ? 0.0f : __expf(m2 - mx);
  l = l * a + l2 * b;
#pragma unroll
  for (int e = 0; e < E; ++e) o[e] = o[e] * a + o2[e] * b;
  m = mx;
}

struct DecodeArgs {
  int num_heads, num_kv_heads, block_size, max_blocks, num_partitions, partition_tokens,
      sliding_window;
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
  using C = Chunk<cache_t>;
  constexpr int E = C::kElems;                  // elements per lane per row
  constexpr int kLanesPerRow = kD / E < KVC_WARP ? kD / E : KVC_WARP;
  constexpr int kRowsPerStep = KVC_WARP / kLanesPerRow;  // token rows one warp load covers
  // steps whose K and V loads are all in flight at once: 8 x 16 bytes per lane for 16-bit
  // caches, 6 for fp8 (16 elements per lane: its q and o take more registers), 4 (of 32 bytes)
  // for fp32
  constexpr int kUnroll = sizeof(cache_t) == 2 ? 4 : (sizeof(cache_t) == 1 ? 3 : 2);
  static_assert(kD / E <= KVC_WARP, "a row must fit one warp");

  const int kvh = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
  const int q_row = query_start_loc[seq];
  if (query_start_loc[seq + 1] - q_row != 1) return;
  const int ctx = context_lens[seq];
  const int first = a.sliding_window > 0 ? max(0, ctx - a.sliding_window) : 0;
  const int bs = a.block_size;
  const int kb_first = first / bs, kb_end = (ctx + bs - 1) / bs;
  const KvSplit split = kv_split(kb_first, kb_end, bs, a.partition_tokens, part);
  if (part >= split.count) return;  // past this sequence's partitions (block-uniform)
  const int kb_lo = split.lo, kb_hi = split.hi;

  const int lane = threadIdx.x % KVC_WARP, warp = threadIdx.x / KVC_WARP;
  const int hs = warp % kHW, tw = warp / kHW;
  const bool active = tw < kTW;  // false for the warp a group of 3 leaves over
  const int sub = lane / kLanesPerRow, c = lane % kLanesPerRow;
  const bool lane_has_chunk = c * E < kD;  // false only if a row is narrower than the warp

  // this lane's chunk of each of its query heads, scaled (k_scale folds the fp8 dequant in)
  float q[kGW][E];
#pragma unroll
  for (int j = 0; j < kGW; ++j) {
    const int g = hs + kHW * j;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      q[j][e] = g < kG && lane_has_chunk
          ? to_float(query[((long long)q_row * a.num_heads + KVC_QHEAD(kvh, g, kG, a.num_kv_heads))
                           * kD + c * E + e]) * a.scale * a.k_scale
          : 0.0f;
    }
  }
  float m[kGW], l[kGW], o[kGW][E];
#pragma unroll
  for (int j = 0; j < kGW; ++j) {
    m[j] = kvc_neg_inf();
    l[j] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) o[j][e] = 0.0f;
  }

  const int* table = block_tables + (long long)seq * a.max_blocks;
  const long long row_stride = (long long)a.num_kv_heads * kD;  // elements between two slots
  const long long head_off = (long long)kvh * kD + c * E;
  for (int kb = kb_lo + tw; active && kb < kb_hi; kb += kTW) {
    const long long base = (long long)table[kb] * bs;  // one translation per KV block
    const int pos0 = kb * bs;
    for (int t0 = 0; t0 < bs; t0 += kUnroll * kRowsPerStep) {
      uint4 kr[kUnroll][C::kWords], vr[kUnroll][C::kWords];
      bool valid[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int t = t0 + u * kRowsPerStep + sub;
        const int pos = pos0 + t;
        valid[u] = t < bs && pos >= first && pos < ctx && lane_has_chunk;
        if (valid[u]) {  // unused slots may hold NaN: never read them
          const uint4* kp = reinterpret_cast<const uint4*>(k_cache + (base + t) * row_stride + head_off);
          const uint4* vp = reinterpret_cast<const uint4*>(v_cache + (base + t) * row_stride + head_off);
#pragma unroll
          for (int w = 0; w < C::kWords; ++w) {
            kr[u][w] = kp[w];
            vr[u][w] = vp[w];
          }
        } else {  // zeros keep the masked score finite without a select per element
#pragma unroll
          for (int w = 0; w < C::kWords; ++w) kr[u][w] = uint4{0u, 0u, 0u, 0u};
        }
      }
      float s[kUnroll][kGW];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float kf[E];
        chunk_to_float(k_cache, kr[u], kf);
#pragma unroll
        for (int j = 0; j < kGW; ++j) {
          float acc = 0.0f;
#pragma unroll
          for (int e = 0; e < E; ++e) acc += q[j][e] * kf[e];
          // the lanes of one row are adjacent: a butterfly over them gives all the row's score
#pragma unroll
          for (int off = 1; off < kLanesPerRow; off <<= 1) {
            acc += __shfl_xor_sync(KVC_FULL_MASK, acc, off);
          }
          s[u][j] = valid[u] ? acc : kvc_neg_inf();
        }
      }
#pragma unroll
      for (int j = 0; j < kGW; ++j) {
        float mx = m[j];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) mx = fmaxf(mx, s[u][j]);
        if (mx == kvc_neg_inf()) continue;  // nothing valid yet in this sub-row
        const float alpha = m[j] == kvc_neg_inf() ? 0.0f : __expf(m[j] - mx);
        l[j] *= alpha;
#pragma unroll
        for (int e = 0; e < E; ++e) o[j][e] *= alpha;
        m[j] = mx;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (!valid[u]) continue;
        float vf[E];
        chunk_to_float(v_cache, vr[u], vf);
#pragma unroll
        for (int j = 0; j < kGW; ++j) {
          const float p = __expf(s[u][j] - m[j]);
          l[j] += p;
#pragma unroll
          for (int e = 0; e < E; ++e) o[j][e] += p * vf[e];
        }
      }
    }
  }

  // merge the token sub-rows of the warp (butterfly over lanes with the same chunk)
#pragma unroll
  for (int off = kLanesPerRow; off < KVC_WARP; off <<= 1) {
#pragma unroll
    for (int j = 0; j < kGW; ++j) {
      float o2[E];
#pragma unroll
      for (int e = 0; e < E; ++e) o2[e] = __shfl_xor_sync(KVC_FULL_MASK, o[j][e], off);
      const float m2 = __shfl_xor_sync(KVC_FULL_MASK, m[j], off);
      const float l2 = __shfl_xor_sync(KVC_FULL_MASK, l[j], off);
      merge_state<E>(m[j], l[j], o[j], m2, l2, o2);
    }
  }
  // then the warps that walked different KV blocks, in a fixed order, through shared memory
  constexpr int kStride = kD + 2;  // one (o, m, l) record per (warp, head)
  if (kTW > 1) {
    if (sub == 0 && lane_has_chunk && tw > 0 && active) {
#pragma unroll
      for (int j = 0; j < kGW; ++j) {
        float* rec = smem + (warp * kGW + j) * kStride;
#pragma unroll
        for (int e = 0; e < E; ++e) rec[c * E + e] = o[j][e];
        if (c == 0) {
          rec[kD] = m[j];
          rec[kD + 1] = l[j];
        }
      }
    }
#ifndef KVC_BREAK_SYNC
    __syncthreads();
#endif
    if (tw > 0) return;  // no barrier follows
    for (int t = 1; t < kTW; ++t) {
#pragma unroll
      for (int j = 0; j < kGW; ++j) {
        const float* rec = smem + ((t * kHW + hs) * kGW + j) * kStride;
        float o2[E];
#pragma unroll
        for (int e = 0; e < E; ++e) o2[e] = lane_has_chunk ? rec[c * E + e] : 0.0f;
        merge_state<E>(m[j], l[j], o[j], rec[kD], rec[kD + 1], o2);
      }
    }
  }
  if (sub != 0 || !lane_has_chunk || !active) return;
#pragma unroll
  for (int j = 0; j < kGW; ++j) {
    const int g = hs + kHW * j;
    if (g >= kG) continue;
    const int h = KVC_QHEAD(kvh, g, kG, a.num_kv_heads);
    // an empty partition (l = 0) writes zeros and a zero weight
    const float inv = l[j] > 0.0f ? a.v_scale / l[j] : 0.0f;
    if (split.count == 1) {
      scalar_t* dst = out + ((long long)q_row * a.num_heads + h) * kD + c * E;
#pragma unroll
      for (int e = 0; e < E; ++e) dst[e] = from_float<scalar_t>(o[j][e] * inv);
    } else {
      const long long idx = ((long long)seq * a.num_heads + h) * a.num_partitions + part;
      float* dst = tmp_out + idx * kD + c * E;
#pragma unroll
      for (int e = 0; e < E; ++e) dst[e] = o[j][e] * inv;
      if (c == 0) {
        max_logits[idx] = m[j];
        exp_sums[idx] = l[j];
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(KVC_DECODE_THREADS, 1) paged_attention_decode(
    KVC_SCALAR* out, float* tmp_out, float* max_logits, float* exp_sums, const KVC_SCALAR* query,
    const KVC_CACHE* k_cache, const KVC_CACHE* v_cache, const int* block_tables,
    const int* context_lens, const int* query_start_loc, int num_heads, int num_kv_heads,
    int block_size, int max_blocks, int num_partitions, int partition_tokens,
    int sliding_window, float scale, float k_scale, float v_scale) {
  extern __shared__ __align__(16) float kvc_smem[];
  const DecodeArgs a = {num_heads, num_kv_heads, block_size, max_blocks, num_partitions,
                        partition_tokens, sliding_window, scale, k_scale, v_scale};
  decode_partition<KVC_SCALAR, KVC_CACHE>(out, tmp_out, max_logits, exp_sums, query, k_cache,
                                          v_cache, block_tables, context_lens, query_start_loc, a,
                                          kvc_smem);
}

// grid (H, S): merges the partitions of each one-token sequence (its count recomputed from its
// span by kv_split, as the decode kernels cut it); scratch rows hold num_partitions entries.
extern "C" __global__ void paged_attention_reduce(
    KVC_SCALAR* out, const float* tmp_out, const float* max_logits, const float* exp_sums,
    const int* query_start_loc, const int* context_lens, int num_heads, int head_dim,
    int num_partitions, int block_size, int sliding_window, int partition_tokens) {
  extern __shared__ __align__(16) float kvc_smem[];
  const int ctx = context_lens[blockIdx.y];
  const int first = sliding_window > 0 ? max(0, ctx - sliding_window) : 0;
  const int count = kv_split(first / block_size, (ctx + block_size - 1) / block_size, block_size,
                             partition_tokens, 0).count;
  decode_reduce<KVC_SCALAR>(out, tmp_out, max_logits, exp_sums, query_start_loc, num_heads,
                            head_dim, num_partitions, count, kvc_smem);
}
