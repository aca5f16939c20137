// Paged attention for decode on tensor cores (fp16 / bf16 activations, GQA groups of 4 to 32):
// one query token per sequence, the G query heads of a KV head as the rows of mma.sync tiles.
//
// One compiled variant per (head_dim, group, activation dtype, cache dtype): KVC_HEAD_DIM,
// KVC_GROUP, KVC_SCALAR, KVC_CACHE are -D options. grid (num_kv_heads, num_seqs, num_partitions),
// 128 threads (4 warps). A block owns one KV head of one sequence and one partition (a run of
// whole KV blocks: kv_split, fixed by the sequence's own span). The group's heads form kRB 16-row
// blocks (padding rows are zero queries, never written out); warp w serves row block w % kRB and
// the w / kRB-th slice of kKW keys of every 64-key tile.
//
// Everything a warp accumulates stays in registers across key tiles (PTX mma.sync m16n8k16,
// fp32 accumulate, fragment layouts as ptx_ops.cuh states them): the Q fragments (loaded once),
// S = Q K^T, P (S's accumulator registers are P's A fragments: no shared memory), and O.
// The online softmax runs on the accumulators; the rescale of O is skipped when no row's running
// max grew (a warp vote). K/V tiles are staged raw (fp8 stays 1 byte) by cp.async 16-byte copies
// through the block table into two buffers, the next tile in flight while the current one is
// computed; the copies zero-fill keys past the span (free slots may hold NaN). Shared rows are
// padded by 16 bytes, so the fragment loads of 8 rows x 4 lanes hit 32 distinct banks. The block
// table is read with shifts (block sizes are powers of two). Per 64-key tile a block moves
// through shared memory the tile's bytes twice (cp.async in, fragments out) for groups up to 16
// (two row blocks read K/V twice). At the end the key slices of a row block merge through shared
// memory in a fixed order; with several partitions a block writes its normalized partial output,
// max logit and exp-sum for paged_attention_reduce.
// With -DKVC_INT4 (and KVC_INT4_GROUP) the cache is kvcore.cache.int4's: sealed int4 rows and fp16
// window rows chosen per block by window_slot, staged packed and unpacked into the same 16-bit
// tiles by kv_int4_stage.cuh (every other variant compiles as before).
#include "common.cuh"
#include "mma_tile.cuh"  // mma.sync / cp.async through <ptx_ops.cuh> (the kernel dir is on the path)
#include "online_softmax.cuh"
#include "split_kv_reduce.cuh"

#ifndef KVC_HEAD_DIM
#define KVC_HEAD_DIM 128
#endif
#ifndef KVC_GROUP
#define KVC_GROUP 8
#endif
#ifndef KVC_SCALAR
#define KVC_SCALAR __half
#endif
#ifdef KVC_INT4  // an int4 cache (KVC_INT4_GROUP value channels per scale): kv_int4_stage.cuh
#include "kv_int4_stage.cuh"
#define KVC_CACHE KVC_SCALAR  // the tiles hold activations: window rows and dequantized keys
#endif
#ifndef KVC_CACHE
#define KVC_CACHE __half
#endif

#define KVC_DECODE_TC_THREADS 128

constexpr int kD = KVC_HEAD_DIM;
constexpr int kG = KVC_GROUP;
constexpr int kWarps = KVC_DECODE_TC_THREADS / KVC_WARP;
constexpr int kRB = (kG + 15) / 16;          // 16-row blocks of query heads
constexpr int kSlices = kWarps / kRB;        // warps sharing a row block: key slices
constexpr int kKT = 64;                      // keys per staged tile
constexpr int kKW = kKT / kSlices;           // keys per warp per tile (16 or 32)
constexpr int kRowBytes = kD * (int)sizeof(KVC_CACHE);  // one KV head's row of the cache
constexpr int kPitch = kRowBytes + 16;       // padded shared row: 8 rows start 4 banks apart
using Rows = SmemRows<kRowBytes, false>;     // (its kPitch: the fragment loads' row layout)
constexpr int kChunks = kRowBytes / 16;      // 16-byte chunks per row
// staging: a thread copies a run of kStageRun chunks of one row (one block-table read and one
// address per run); runs of 8 at head_dim 256, where one address per chunk would spill
constexpr int kStageRun = kD > 128 ? (kChunks < 8 ? kChunks : 8) : 1;
constexpr int kTileBytes = kKT * kPitch;
constexpr int kStageBytes = 2 * 2 * kTileBytes;  // (2 buffers) x (K, V)
constexpr int kLdO = kD + 4;                 // merge record: o[kD], m, l, padding
constexpr int kMergeBytes = kWarps * 16 * kLdO * 4;
#ifdef KVC_INT4
using Int4Stage = Int4Tile<kKT, KVC_DECODE_TC_THREADS, kD, kPitch, KVC_INT4_GROUP>;
constexpr int kRawBytes = 2 * Int4Stage::kBytes;  // the packed rows' two buffers, after the tiles
#else
constexpr int kRawBytes = 0;
#endif
constexpr int kSmemBytes = kStageBytes + kRawBytes > kMergeBytes ? kStageBytes + kRawBytes
                                                                  : kMergeBytes;
// resident blocks asked of ptxas: 3 (170 registers) up to head_dim 128, where O takes 64; 2
// (255) for two row blocks (groups over 16) and int4 (whose shared memory allows 2 anyway at
// head_dim 128): 170 registers would spill there
#ifdef KVC_INT4
constexpr bool kInt4 = true;
#else
constexpr bool kInt4 = false;
#endif
constexpr int kMinBlocks = kD > 128 ? 1 : (kG > 16 || (kInt4 && kD > 64)) ? 2 : 3;
static_assert(kG >= 1 && kG <= 32, "group: 1 to 32 query heads per KV head");
static_assert(kD >= 16 && kD <= 256 && (kD & (kD - 1)) == 0, "head_dim: power of two in [16, 256]");
static_assert(kKW % 16 == 0, "a warp's key slice is whole 16-key mma steps");

// The channel of O's accumulator element (n-tile n, register e & 1) in lane column t: the
// fragment order, or with KVC_INT4 Int4Tile::v_frags' (n-tile 8 q + m, column c: 64 q + 8 c + m).
__device__ __forceinline__ int out_channel(int n, int t, int e) {
#ifdef KVC_INT4
  return 64 * (n / 8) + 8 * (2 * t + e) + n % 8;
#else
  return 8 * n + 2 * t + e;
#endif
}

template <typename scalar_t, typename cache_t>
__device__ void decode_tc_partition(
    scalar_t* __restrict__ out,                 // (T, H, D)
    float* __restrict__ tmp_out,                // (S, H, P, D), used when P > 1
    float* __restrict__ max_logits,             // (S, H, P)
    float* __restrict__ exp_sums,               // (S, H, P)
    const scalar_t* __restrict__ query,         // (T, H, D)
#ifdef KVC_INT4
    const Int4Cache int4_cache,                 // sealed rows and the fp16 window
#else
    const cache_t* __restrict__ k_cache,        // (num_blocks, block_size, Hkv, D)
    const cache_t* __restrict__ v_cache,
#endif
    const int* __restrict__ block_tables,       // (S, max_blocks)
    const int* __restrict__ context_lens,       // (S,)
    const int* __restrict__ query_start_loc,    // (S + 1,)
    int num_heads, int num_kv_heads, int block_shift, int max_blocks, int num_partitions,
    int partition_tokens, int sliding_window, float scale, float v_scale, unsigned char* smem) {
  const int kvh = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
  const int q_row = query_start_loc[seq];
  if (query_start_loc[seq + 1] - q_row != 1) return;
  const int ctx = context_lens[seq];
  const int first = sliding_window > 0 ? max(0, ctx - sliding_window) : 0;
  const int bs = 1 << block_shift;
  const int kb_first = first >> block_shift, kb_end = (ctx + bs - 1) >> block_shift;
  const KvSplit split = kv_split(kb_first, kb_end, bs, partition_tokens, part);
  if (part >= split.count) return;  // past this sequence's partitions (block-uniform)
  const int k_lo = max(first, split.lo << block_shift);
  const int k_hi = min(ctx, split.hi << block_shift);
#ifdef KVC_INT4  // tiles start at a multiple of 8 keys: an 8-key fragment group is one block
  const int k_start = k_lo & ~7;
#else
  const int k_start = k_lo;
#endif
  const int num_tiles = k_hi > k_lo ? (k_hi - k_start + kKT - 1) / kKT : 0;

  const int tid = threadIdx.x, lane = tid % KVC_WARP, warp = tid / KVC_WARP;
  const int g = lane >> 2, t = lane & 3;       // the fragment coordinates of this lane
  const int rb = warp % kRB, slice = warp / kRB;
  const int key0 = slice * kKW;                // the warp's first key of every tile

  // Q fragments of the warp's row block, once: rows rb * 16 + g and + 8 (zero past the group)
  unsigned qf[kD / 16][4];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int gi = rb * 16 + g + 8 * r;
    const unsigned* q32 = reinterpret_cast<const unsigned*>(
        query + ((long long)q_row * num_heads + KVC_QHEAD(kvh, gi, kG, num_kv_heads)) * kD);
#ifdef KVC_INT4  // channels 32 c + 8 t + 2 i and + 1 per register (Int4Tile::k_frags' order)
#pragma unroll
    for (int c = 0; c < kD / 32; ++c) {
      const uint4 h = gi < kG ? reinterpret_cast<const uint4*>(q32 + 16 * c + 4 * t)[0]
                              : make_uint4(0u, 0u, 0u, 0u);
      qf[2 * c][r] = h.x;
      qf[2 * c][r + 2] = h.y;
      qf[2 * c + 1][r] = h.z;
      qf[2 * c + 1][r + 2] = h.w;
    }
#else
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      qf[kk][r] = gi < kG ? q32[kk * 8 + t] : 0u;
      qf[kk][r + 2] = gi < kG ? q32[kk * 8 + t + 4] : 0u;
    }
#endif
  }
  float o[kD / 8][4];
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {kvc_neg_inf(), kvc_neg_inf()}, l[2] = {0.0f, 0.0f};  // rows g, g + 8

  const int* table = block_tables + (long long)seq * max_blocks;
#ifdef KVC_INT4
  const Int4Stage int4(int4_cache, num_kv_heads, block_shift, kvh);
  auto stage = [&](int k0, int b) {  // keys [k0, k0 + kKT) into buffer b
    int4.stage(smem + b * 2 * kTileBytes, smem + b * 2 * kTileBytes + kTileBytes,
               smem + kStageBytes + b * Int4Stage::kBytes, table, k0, k_hi, tid);
  };
#else
  const unsigned char* k_base = reinterpret_cast<const unsigned char*>(k_cache) +
                                (long long)kvh * kRowBytes;
  const unsigned char* v_base = reinterpret_cast<const unsigned char*>(v_cache) +
                                (long long)kvh * kRowBytes;
  const long long slot_bytes = (long long)num_kv_heads * kRowBytes;
  auto stage = [&](int k0, int b) {  // keys [k0, k0 + kKT) into buffer b
    stage_kv_tile<kKT, KVC_DECODE_TC_THREADS, kRowBytes, kPitch, kStageRun>(
        smem + b * 2 * kTileBytes, smem + b * 2 * kTileBytes + kTileBytes, k_base, v_base,
        slot_bytes, table, block_shift, k0, k_hi, tid);
  };
#endif

  if (num_tiles > 0) stage(k_start, 0);
  cp_async_commit();
  for (int it = 0; it < num_tiles; ++it) {
    if (it + 1 < num_tiles) stage(k_start + (it + 1) * kKT, (it + 1) & 1);  // next in flight
    cp_async_commit();
#ifndef KVC_BREAK_WAIT  // the tests' mutant: the tile is read before its copies complete
    cp_async_wait<1>();
#endif
    __syncthreads();  // every thread's copies of this tile have landed
    const unsigned char* k_s = smem + (it & 1) * 2 * kTileBytes;
    const unsigned char* v_s = k_s + kTileBytes;
    const int tile0 = k_start + it * kKT;
#ifdef KVC_INT4
    const unsigned char* raw = smem + kStageBytes + (it & 1) * Int4Stage::kBytes;
#endif

    // S (16 rows x kKW keys) = Q K^T: K rows are B's columns, two elements per .b32; a 16-bit
    // tile by ldmatrix.x4 (two 16-channel steps of 8 keys each), fp8 converted per element
    float s[kKW / 8][4];
#pragma unroll
    for (int j = 0; j < kKW / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#ifdef KVC_INT4  // sealed 8-key groups from their codes, window ones from their fp16 rows
    int4.template qk<scalar_t, kKW / 8>(s, qf, k_s, raw, key0, tile0, g, t);
#else
    qk_tile<scalar_t, cache_t, Rows, kD, kKW / 8>(s, qf, k_s, key0, lane);
#endif
    // online softmax on the accumulators: element e of n-tile j is row g + 8 (e >> 1),
    // key key0 + 8 j + 2 t + (e & 1); the 4 lanes of a row (t) reduce by shuffles
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < kKW / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k_pos = tile0 + key0 + j * 8 + 2 * t + (e & 1);
        const bool valid = k_pos >= k_lo && k_pos < k_hi;
        s[j][e] = valid ? s[j][e] * scale : kvc_neg_inf();
        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
      }
    }
    quad_max(mx);
    rescale_if_grew<kD / 8>(o, m, l, mx);
    unsigned pf[kKW / 16][4];  // P as A fragments straight from S's registers
    p_fragments<scalar_t, kKW / 8>(pf, s, m, l);
    // O (16 x D) += P V: B (keys x 8 columns) pairs the elements of rows 2t, 2t + 1
#pragma unroll
    for (int ks = 0; ks < kKW / 16; ++ks) {
#ifdef KVC_INT4
      int4.template pv<scalar_t>(o, pf[ks], v_s, raw, key0 + ks * 16, tile0, g, t);
#else
      pv_tile<scalar_t, cache_t, Rows, kD>(o, pf[ks], v_s, key0 + ks * 16, lane);
#endif
    }
#ifndef KVC_BREAK_SYNC  // the tests' mutant: a buffer is staged again while warps still read it
    __syncthreads();
#endif
  }
  cp_async_wait<0>();  // (nothing is left in flight: the last tile was waited for)
  __syncthreads();     // the staging buffers become the merge records

  // each row's sum over its 4 lanes, then the key slices of a row block merge in slice order
  quad_sum(l);
  float* rec = reinterpret_cast<float*>(smem);  // (warps, 16 rows, kLdO)
  if (slice > 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float* row = rec + (warp * 16 + g + 8 * r) * kLdO;
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        row[n * 8 + 2 * t] = o[n][2 * r];
        row[n * 8 + 2 * t + 1] = o[n][2 * r + 1];
      }
      if (t == 0) {
        row[kD] = m[r];
        row[kD + 1] = l[r];
      }
    }
  }
  __syncthreads();
  if (slice > 0) return;  // no barrier follows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = m[r];
    for (int sl = 1; sl < kSlices; ++sl) {
      mx = fmaxf(mx, rec[((rb + kRB * sl) * 16 + g + 8 * r) * kLdO + kD]);
    }
    const float a = m[r] == kvc_neg_inf() ? 0.0f : __expf(m[r] - mx);
    l[r] *= a;
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      o[n][2 * r] *= a;
      o[n][2 * r + 1] *= a;
    }
    for (int sl = 1; sl < kSlices; ++sl) {
      const float* row = rec + ((rb + kRB * sl) * 16 + g + 8 * r) * kLdO;
      const float b = row[kD] == kvc_neg_inf() ? 0.0f : __expf(row[kD] - mx);
      l[r] += b * row[kD + 1];
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        o[n][2 * r] += b * row[n * 8 + 2 * t];
        o[n][2 * r + 1] += b * row[n * 8 + 2 * t + 1];
      }
    }
    m[r] = mx;
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int gi = rb * 16 + g + 8 * r;
    if (gi >= kG) continue;
    const int h = KVC_QHEAD(kvh, gi, kG, num_kv_heads);
    // an empty partition (l = 0) writes zeros and a zero weight
    const float inv = l[r] > 0.0f ? v_scale / l[r] : 0.0f;
    if (split.count == 1) {
      scalar_t* dst = out + ((long long)q_row * num_heads + h) * kD;
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        dst[out_channel(n, t, 0)] = from_float<scalar_t>(o[n][2 * r] * inv);
        dst[out_channel(n, t, 1)] = from_float<scalar_t>(o[n][2 * r + 1] * inv);
      }
    } else {
      const long long idx = ((long long)seq * num_heads + h) * num_partitions + part;
      float* dst = tmp_out + idx * kD;
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        dst[out_channel(n, t, 0)] = o[n][2 * r] * inv;
        dst[out_channel(n, t, 1)] = o[n][2 * r + 1] * inv;
      }
      if (t == 0) {
        max_logits[idx] = m[r];
        exp_sums[idx] = l[r];
      }
    }
  }
}

#ifdef KVC_INT4  // the cache arguments as the partition takes them
#define KVC_DTC_KV_ARGS Int4Cache{k_cache, v_cache, k_window, v_window, window_slot}
#else
#define KVC_DTC_KV_ARGS k_cache, v_cache
#endif
extern "C" __global__ void __launch_bounds__(KVC_DECODE_TC_THREADS, kMinBlocks) paged_attention_decode_tc(
    KVC_SCALAR* out, float* tmp_out, float* max_logits, float* exp_sums, const KVC_SCALAR* query,
#ifdef KVC_INT4
    const unsigned char* k_cache, const unsigned char* v_cache, const __half* k_window,
    const __half* v_window, const int* window_slot,
#else
    const KVC_CACHE* k_cache, const KVC_CACHE* v_cache,
#endif
    const int* block_tables,
    const int* context_lens, const int* query_start_loc, int num_heads, int num_kv_heads,
    int block_shift, int max_blocks, int num_partitions, int partition_tokens,
    int sliding_window, float scale, float k_scale, float v_scale) {
  extern __shared__ __align__(128) unsigned char kvc_dtc_smem[];
  decode_tc_partition<KVC_SCALAR, KVC_CACHE>(out, tmp_out, max_logits, exp_sums, query,
                                             KVC_DTC_KV_ARGS,
                                             block_tables, context_lens,
                                             query_start_loc, num_heads, num_kv_heads,
                                             block_shift, max_blocks, num_partitions,
                                             partition_tokens, sliding_window, scale * k_scale,
                                             v_scale,
                                             kvc_dtc_smem);
}
