// Paged attention for prefill chunks on tensor cores (fp16 / bf16 activations), FlashAttention-2
// style: a chunk's queries against the cached prefix and causally within the chunk, honouring a
// sliding window.
//
// One compiled variant per (head_dim, activation dtype, cache dtype): KVC_HEAD_DIM, KVC_SCALAR,
// KVC_CACHE are -D options. grid (num_kv_heads, num_seqs, query tiles), 128 threads (4 warps).
// A block's Q tile has 64 rows: 64 / G query positions times the G query heads of one KV head
// (row r = position r / G, head r % G), so the group shares every K/V tile it reads. Key tiles of
// kKT keys (64; 32 for head_dim 256) are gathered through the block table into shared memory
// with 16-byte loads, dequantized (fp8) to the activation type while staged; keys outside the
// tile's span are zero-filled (free slots may hold NaN). Warp w owns rows 16w..16w+15:
// S = Q K^T by nvcuda::wmma (m16n16k16, fp32 accumulate) into shared memory, an online softmax
// in fp32 by two lanes per row (scale, causal / window mask, running max and sum in registers),
// P written back as fp16 / bf16, then O += P V by wmma on an fp32 O tile kept in shared memory
// (rescaled by the running max's change before each tile: WMMA's fragment layout is opaque, so
// rows cannot be scaled inside a fragment). Shared memory exceeds 48 KB at head_dim >= 64: the
// launcher opts in. Sequences with a single query token are skipped.
//
// Decode mode (num_partitions >= 1, used for GQA groups of 4+ when the block size is not a power
// of two; paged_attention_decode_tc.cu serves the others): only one-token sequences, the
// grid's z is the split-KV partition (a run of whole KV blocks, as paged_attention_decode.cu
// splits), the Q tile holds the group's heads; with up to 16 heads the four warps split each key
// tile instead of the rows and merge their states at the end. With several partitions a block
// writes its normalized partial output, max logit and exp-sum for paged_attention_reduce.
#include <mma.h>

#include "common.cuh"
#include "split_kv_reduce.cuh"
#include "tc_stage.cuh"

#ifndef KVC_HEAD_DIM
#define KVC_HEAD_DIM 128
#endif
#ifndef KVC_SCALAR
#define KVC_SCALAR __half
#endif
#ifndef KVC_CACHE
#define KVC_CACHE __half
#endif

#define KVC_PREFILL_TC_THREADS 128

namespace wmma = nvcuda::wmma;

constexpr int kD = KVC_HEAD_DIM;
constexpr int kQT = 64;                     // query rows per block
constexpr int kKT = kD > 128 ? 32 : 64;     // keys per tile
constexpr int kLdQ = kD + 8;                // padded leading dimensions (elements): rows start
constexpr int kLdS = kKT + 4;               // on different banks, every fragment pointer stays
constexpr int kLdP = kKT + 8;               // 32-byte aligned
constexpr int kLdO = kD + 4;
static_assert(kD % 16 == 0 && kD <= 256, "head_dim: a multiple of 16 up to 256");

// Byte offsets of the shared-memory regions (all multiples of 32 bytes).
constexpr int kOffK = kQT * kLdQ * 2;
constexpr int kOffV = kOffK + kKT * kLdQ * 2;
constexpr int kOffS = kOffV + kKT * kLdQ * 2;
constexpr int kOffP = kOffS + kQT * kLdS * 4;
constexpr int kOffO = kOffP + kQT * kLdP * 2;
constexpr int kSmemBytes = kOffO + kQT * kLdO * 4;

template <typename scalar_t, typename cache_t>
__device__ void prefill_tc_tile(
    scalar_t* __restrict__ out,                // (T, H, D)
    const scalar_t* __restrict__ query,        // (T, H, D)
    const cache_t* __restrict__ k_cache,       // (num_blocks, block_size, Hkv, D)
    const cache_t* __restrict__ v_cache,
    const int* __restrict__ block_tables,      // (S, max_blocks)
    const int* __restrict__ context_lens,      // (S,)
    const int* __restrict__ query_start_loc,   // (S + 1,)
    float* __restrict__ tmp_out,               // (S, H, P, D) decode partials, P > 1
    float* __restrict__ max_logits,            // (S, H, P)
    float* __restrict__ exp_sums,              // (S, H, P)
    int num_heads, int num_kv_heads, int block_size, int max_blocks, int sliding_window,
    int num_partitions, int partition_tokens, float scale, float v_scale, unsigned char* smem) {
  const int kvh = blockIdx.x, seq = blockIdx.y;
  const int G = num_heads / num_kv_heads, positions = kQT / G;  // query positions per tile
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  // decode mode (num_partitions >= 1): one-token sequences only, blockIdx.z = KV partition
  const bool decode = num_partitions > 0;
  const int part = blockIdx.z;
  const int i0 = decode ? 0 : blockIdx.z * positions;
  if (decode ? q_len != 1 : (q_len <= 1 || i0 >= q_len)) return;
  const int nq = min(positions, q_len - i0);
  const int rows = nq * G;
  const int ctx = context_lens[seq];
  const int pos0 = ctx - q_len + i0;  // position of the tile's first query
  const int tid = threadIdx.x, lane = tid % KVC_WARP, warp = tid / KVC_WARP;

  scalar_t* q_s = reinterpret_cast<scalar_t*>(smem);           // (64, kLdQ)
  scalar_t* k_s = reinterpret_cast<scalar_t*>(smem + kOffK);   // (kKT, kLdQ)
  scalar_t* v_s = reinterpret_cast<scalar_t*>(smem + kOffV);   // (kKT, kLdQ)
  float* s_s = reinterpret_cast<float*>(smem + kOffS);         // (64, kLdS) scores
  scalar_t* p_s = reinterpret_cast<scalar_t*>(smem + kOffP);   // (64, kLdP) probabilities
  float* o_s = reinterpret_cast<float*>(smem + kOffO);         // (64, kLdO) unnormalized output

  constexpr int kChunks = kD / 8;  // 16-byte chunks of a 16-bit row
  for (int i = tid; i < kQT * kChunks; i += KVC_PREFILL_TC_THREADS) {
    const int r = i / kChunks, c = i % kChunks;
    scalar_t* dst = q_s + r * kLdQ + c * 8;
    if (r < rows) {
      const int h = KVC_QHEAD(kvh, r % G, G, num_kv_heads);
      stage8(query + ((long long)(q_start + i0 + r / G) * num_heads + h) * kD + c * 8, dst);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = from_float<scalar_t>(0.0f);
    }
  }
  for (int i = tid; i < kQT * kD; i += KVC_PREFILL_TC_THREADS) o_s[(i / kD) * kLdO + i % kD] = 0.0f;

  // Decode of a group of at most 16 heads: one 16-row tile holds every query, so the four
  // warps split each key tile instead (16 keys each, own softmax state and O rows in shared
  // memory, merged after the last tile). Otherwise warp w owns query rows 16w..16w+15.
  const bool split_keys = decode && rows <= 16;
  const int q_row0 = split_keys ? 0 : warp * 16;          // the warp's first query row
  const int key0 = split_keys ? warp * 16 : 0;            // the warp's first key of a tile
  const int keys = split_keys ? 16 : kKT;                 // its keys per tile
  const int cols = keys / 2;                              // of which each lane takes half
  const bool warp_works = split_keys ? key0 < kKT : warp * 16 < rows;
  // softmax state of query row `row`, kept in smem row `srow_i` of S / P / O
  const int row = q_row0 + lane / 2, srow_i = warp * 16 + lane / 2, half = lane % 2;
  const int q_pos = pos0 + row / G;
  const bool row_valid = row < rows;
  float m = kvc_neg_inf(), l = 0.0f;

  const int* table = block_tables + (long long)seq * max_blocks;
  const long long row_stride = (long long)num_kv_heads * kD;
  int k_begin = sliding_window > 0 ? max(0, pos0 - sliding_window + 1) : 0;
  int k_end = pos0 + nq;  // the last query sees keys up to its own position
  int count = 1;  // the sequence's decode partitions (kv_split: fixed by its own span)
  if (decode) {  // this partition's run of whole KV blocks, as paged_attention_decode splits
    const int kb_first = k_begin / block_size, kb_end = (k_end + block_size - 1) / block_size;
    const KvSplit split = kv_split(kb_first, kb_end, block_size, partition_tokens, part);
    if (part >= split.count) return;  // block-uniform, before any barrier
    count = split.count;
    k_begin = max(k_begin, split.lo * block_size);
    k_end = min(k_end, split.hi * block_size);
  }
  for (int kb = k_begin; kb < k_end; kb += kKT) {
    __syncthreads();  // the previous tile's K / V are no longer read (and Q / O are staged)
    // unrolled: all of a thread's 16-byte K and V loads of the tile are in flight at once
    constexpr int kCE = StageChunk<cache_t>::kElems;
    constexpr int kCacheChunks = kD / kCE;  // 16-byte chunks of a cache row
    constexpr int kRounds = (kKT * kCacheChunks + KVC_PREFILL_TC_THREADS - 1) /
                            KVC_PREFILL_TC_THREADS;
#pragma unroll
    for (int round = 0; round < kRounds; ++round) {
      const int i = tid + round * KVC_PREFILL_TC_THREADS;
      if (kKT * kCacheChunks % KVC_PREFILL_TC_THREADS != 0 && i >= kKT * kCacheChunks) break;
      const int t = i / kCacheChunks, c = i % kCacheChunks, pos = kb + t;
      scalar_t* kd = k_s + t * kLdQ + c * kCE;
      scalar_t* vd = v_s + t * kLdQ + c * kCE;
      if (pos < k_end) {
        const long long slot = (long long)table[pos / block_size] * block_size + pos % block_size;
        const long long src = slot * row_stride + (long long)kvh * kD + c * kCE;
        stage_chunk(k_cache + src, kd);
        stage_chunk(v_cache + src, vd);
      } else {  // past the span: zeros, never the slot's contents (0 x NaN would poison P V)
#pragma unroll
        for (int e = 0; e < kCE; ++e) kd[e] = vd[e] = from_float<scalar_t>(0.0f);
      }
    }
#ifndef KVC_BREAK_SYNC  // the tests' mutant: warps read K / V tiles before they are staged
    __syncthreads();
#endif

    if (!warp_works) continue;  // a warp past the last row (or key) only stages tiles
    // S (16 x keys per warp) = Q K^T: K staged as (keys, D) row-major is K^T column-major
    for (int n0 = key0; n0 < key0 + keys; n0 += 16) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int k0 = 0; k0 < kD; k0 += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, scalar_t, wmma::row_major> qa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, scalar_t, wmma::col_major> kb_frag;
        wmma::load_matrix_sync(qa, q_s + q_row0 * kLdQ + k0, kLdQ);
        wmma::load_matrix_sync(kb_frag, k_s + n0 * kLdQ + k0, kLdQ);
        wmma::mma_sync(acc, qa, kb_frag, acc);
      }
      wmma::store_matrix_sync(s_s + warp * 16 * kLdS + n0 - key0, acc, kLdS,
                              wmma::mem_row_major);
    }
    __syncwarp();

    // online softmax of this lane's half row, in fp32
    const float* srow = s_s + srow_i * kLdS + half * cols;
    scalar_t* prow = p_s + srow_i * kLdP + half * cols;
    float tile_max = kvc_neg_inf();
    for (int j = 0; j < cols; ++j) {
      const int k_pos = kb + key0 + half * cols + j;
      const bool allowed = row_valid && k_pos <= q_pos && k_pos < k_end &&
                           (sliding_window <= 0 || k_pos > q_pos - sliding_window);
      if (allowed) tile_max = fmaxf(tile_max, srow[j] * scale);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(KVC_FULL_MASK, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    const float alpha = m == kvc_neg_inf() ? 0.0f : __expf(m - m_new);
    float sum = 0.0f;
    for (int j = 0; j < cols; ++j) {
      const int k_pos = kb + key0 + half * cols + j;
      const bool allowed = row_valid && k_pos <= q_pos && k_pos < k_end &&
                           (sliding_window <= 0 || k_pos > q_pos - sliding_window);
      const float p = allowed ? __expf(srow[j] * scale - m_new) : 0.0f;
      // P V sums the probabilities as rounded to the activation type: so does l
      const scalar_t p16 = from_float<scalar_t>(p);
      prow[j] = p16;
      sum += to_float(p16);
    }
    l = l * alpha + sum;  // this lane's columns; the two halves are added at the end
    m = m_new;
    float* orow = o_s + srow_i * kLdO + half * (kD / 2);
    for (int d = 0; d < kD / 2; ++d) orow[d] *= alpha;
    __syncwarp();

    // O (16 x D per warp) += P V
    for (int n0 = 0; n0 < kD; n0 += 16) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, o_s + warp * 16 * kLdO + n0, kLdO, wmma::mem_row_major);
#pragma unroll
      for (int k0 = 0; k0 < keys; k0 += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, scalar_t, wmma::row_major> pa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, scalar_t, wmma::row_major> vb;
        wmma::load_matrix_sync(pa, p_s + warp * 16 * kLdP + k0, kLdP);
        wmma::load_matrix_sync(vb, v_s + (key0 + k0) * kLdQ + n0, kLdQ);
        wmma::mma_sync(acc, pa, vb, acc);
      }
      wmma::store_matrix_sync(o_s + warp * 16 * kLdO + n0, acc, kLdO, wmma::mem_row_major);
    }
    __syncwarp();
  }

  l += __shfl_xor_sync(KVC_FULL_MASK, l, 1);
  if (split_keys) {
    // merge the warps' states per row, in a fixed order; the scores are no longer needed, so
    // their buffer holds the (m, l) of every (warp, row)
    float* stats = s_s;  // (4 warps, 16 rows, 2)
    __syncthreads();     // every warp is done reading its scores
    if (half == 0) {
      stats[(warp * 16 + row) * 2] = m;
      stats[(warp * 16 + row) * 2 + 1] = l;
    }
    __syncthreads();
    if (warp != 0 || !row_valid) return;
    float mx = kvc_neg_inf();
    for (int w = 0; w < KVC_PREFILL_TC_THREADS / KVC_WARP; ++w) {
      mx = fmaxf(mx, stats[(w * 16 + row) * 2]);
    }
    float weight[KVC_PREFILL_TC_THREADS / KVC_WARP];
    float total = 0.0f;
    for (int w = 0; w < KVC_PREFILL_TC_THREADS / KVC_WARP; ++w) {
      const float mw = stats[(w * 16 + row) * 2];
      weight[w] = mw == kvc_neg_inf() ? 0.0f : __expf(mw - mx);
      total += weight[w] * stats[(w * 16 + row) * 2 + 1];
    }
    for (int d = half * (kD / 2); d < (half + 1) * (kD / 2); ++d) {
      float acc = 0.0f;
      for (int w = 0; w < KVC_PREFILL_TC_THREADS / KVC_WARP; ++w) {
        acc += weight[w] * o_s[(w * 16 + row) * kLdO + d];
      }
      o_s[row * kLdO + d] = acc;  // warp 0's own rows: each lane rewrites only what it read
    }
    m = mx;
    l = total;
  }
  if (!row_valid) return;
  const int h = KVC_QHEAD(kvh, row % G, G, num_kv_heads);
  // l = 0 only for an empty decode partition: zeros and a zero weight for the reduction
  const float inv = l > 0.0f ? v_scale / l : 0.0f;
  if (count > 1) {
    const long long idx = ((long long)seq * num_heads + h) * num_partitions + part;
    for (int d = half * (kD / 2); d < (half + 1) * (kD / 2); ++d) {
      tmp_out[idx * kD + d] = o_s[row * kLdO + d] * inv;
    }
    if (half == 0) {
      max_logits[idx] = m;
      exp_sums[idx] = l;
    }
    return;
  }
  scalar_t* dst = out + ((long long)(q_start + i0 + row / G) * num_heads + h) * kD;
  for (int d = half * (kD / 2); d < (half + 1) * (kD / 2); ++d) {
    dst[d] = from_float<scalar_t>(o_s[row * kLdO + d] * inv);
  }
}

extern "C" __global__ void __launch_bounds__(KVC_PREFILL_TC_THREADS, 1) paged_attention_prefill_tc(
    KVC_SCALAR* out, const KVC_SCALAR* query, const KVC_CACHE* k_cache, const KVC_CACHE* v_cache,
    const int* block_tables, const int* context_lens, const int* query_start_loc, float* tmp_out,
    float* max_logits, float* exp_sums, int num_heads, int num_kv_heads, int block_size,
    int max_blocks, int sliding_window, int num_partitions, int partition_tokens, float scale,
    float k_scale, float v_scale) {
  extern __shared__ __align__(128) unsigned char kvc_tc_smem[];
  prefill_tc_tile<KVC_SCALAR, KVC_CACHE>(out, query, k_cache, v_cache, block_tables,
                                         context_lens, query_start_loc, tmp_out, max_logits,
                                         exp_sums, num_heads, num_kv_heads, block_size,
                                         max_blocks, sliding_window, num_partitions,
                                         partition_tokens, scale * k_scale, v_scale,
                                         kvc_tc_smem);
}
