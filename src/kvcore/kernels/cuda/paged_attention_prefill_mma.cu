// Paged attention for prefill chunks with register tiles (fp16 / bf16 activations, head_dim up
// to 128, power-of-two block sizes), FlashAttention-2 style: a chunk's queries against the cached
// prefix and causally within the chunk, honouring a sliding window.
//
// One compiled variant per (head_dim, activation dtype, cache dtype): KVC_HEAD_DIM, KVC_SCALAR,
// KVC_CACHE are -D options. grid (num_kv_heads, num_seqs, query tiles), 256 threads (8 warps).
// A block's Q tile has 128 rows: 128 / G query positions times the G query heads of one KV head
// (row r = position r / G, head r % G), so the group shares every K/V tile. Warp w owns rows
// 16w..16w+15 and keeps in registers, across all key tiles: its Q fragments (loaded once), S for
// the 64 keys of a tile, P (S's accumulators are P's A fragments) and O (fp32), with the online
// softmax on the accumulators (the rescale of O skipped when no row's max grew: a warp vote).
// K/V tiles of 64 keys are staged raw (fp8 dequantized in the fragment loads) by cp.async into
// two buffers through the block table (mma_tile.cuh), the next tile in flight while the current
// one is computed; the copies zero-fill keys past the span. A warp skips the tiles wholly after
// its last query position (causal). Sequences with a single query token are left to decode.
// With -DKVC_INT4 (and KVC_INT4_GROUP) the cache is kvcore.cache.int4's: sealed int4 rows and fp16
// window rows chosen per block by window_slot, staged packed and unpacked into the same 16-bit
// tiles by kv_int4_stage.cuh (every other variant compiles as before).
#include "common.cuh"
#include "mma_tile.cuh"  // mma.sync / cp.async through <ptx_ops.cuh> (the kernel dir is on the path)
#include "online_softmax.cuh"

#ifndef KVC_HEAD_DIM
#define KVC_HEAD_DIM 128
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

#define KVC_PREFILL_MMA_THREADS 256

constexpr int kD = KVC_HEAD_DIM;
constexpr int kRows = KVC_PREFILL_MMA_THREADS / KVC_WARP * 16;  // query rows per block (128)
constexpr int kKT = 64;                                           // keys per staged tile
constexpr int kRowBytes = kD * (int)sizeof(KVC_CACHE);
constexpr int kPitch = kRowBytes + 16;  // padded shared row: 8 rows start 4 banks apart
using Rows = SmemRows<kRowBytes, false>;  // (its kPitch: the fragment loads' row layout)
constexpr int kTileBytes = kKT * kPitch;
#ifdef KVC_INT4
// P V in passes of 4 n-tile pairs: all 8 at once spill with the int4 staging's registers
constexpr int kPvUnroll = 4;
#else
constexpr int kPvUnroll = kD / 16;
#endif
#ifdef KVC_INT4
using Int4Stage = Int4Tile<kKT, KVC_PREFILL_MMA_THREADS, kD, kPitch, KVC_INT4_GROUP>;
constexpr int kRawBytes = 2 * Int4Stage::kBytes;  // the packed rows' two buffers, after the tiles
#else
constexpr int kRawBytes = 0;
#endif
constexpr int kSmemBytes = 2 * 2 * kTileBytes + kRawBytes;  // (2 buffers) x (K, V) (+ packed)
static_assert(kD >= 16 && kD <= 128 && (kD & (kD - 1)) == 0, "head_dim: power of two, 16-128");

template <typename scalar_t, typename cache_t>
__device__ void prefill_mma_tile(
    scalar_t* __restrict__ out,                // (T, H, D)
    const scalar_t* __restrict__ query,        // (T, H, D)
#ifdef KVC_INT4
    const Int4Cache int4_cache,                // sealed rows and the fp16 window
#else
    const cache_t* __restrict__ k_cache,       // (num_blocks, block_size, Hkv, D)
    const cache_t* __restrict__ v_cache,
#endif
    const int* __restrict__ block_tables,      // (S, max_blocks)
    const int* __restrict__ context_lens,      // (S,)
    const int* __restrict__ query_start_loc,   // (S + 1,)
    int num_heads, int num_kv_heads, int block_shift, int max_blocks, int sliding_window,
    float scale, float v_scale, unsigned char* smem) {
  const int kvh = blockIdx.x, seq = blockIdx.y;
  const int G = num_heads / num_kv_heads, positions = kRows / G;  // query positions per tile
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  // the grid's z runs from the last query tile down: blocks launch in z order, so the tiles
  // with the most keys (causal: the latest positions) start first and the short ones fill in
  const int i0 = (gridDim.z - 1 - blockIdx.z) * positions;
  if (q_len <= 1 || i0 >= q_len) return;
  const int nq = min(positions, q_len - i0);
  const int rows = nq * G;
  const int ctx = context_lens[seq];
  const int pos0 = ctx - q_len + i0;  // position of the tile's first query
  const int k_begin = sliding_window > 0 ? max(0, pos0 - sliding_window + 1) : 0;
  const int k_end = pos0 + nq;  // the last query sees keys up to its own position
  const int num_tiles = (k_end - k_begin + kKT - 1) / kKT;

  const int tid = threadIdx.x, lane = tid % KVC_WARP, warp = tid / KVC_WARP;
  const int g = lane >> 2, t = lane & 3;  // the fragment coordinates of this lane
  // this lane's rows 16 w + g and + 8: their query positions (rows past `rows` see nothing)
  int q_pos[2];
  bool row_valid[2];
  unsigned qf[kD / 16][4];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + g + 8 * r;
    row_valid[r] = row < rows;
    q_pos[r] = pos0 + row / G;
    const unsigned* q32 = reinterpret_cast<const unsigned*>(
        query + ((long long)(q_start + i0 + row / G) * num_heads +
                 KVC_QHEAD(kvh, row % G, G, num_kv_heads)) * kD);
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      qf[kk][r] = row_valid[r] ? q32[kk * 8 + t] : 0u;
      qf[kk][r + 2] = row_valid[r] ? q32[kk * 8 + t + 4] : 0u;
    }
  }
  // the warp's last query position: tiles starting after it are masked for all its rows
  const int warp_last = warp * 16 < rows ? pos0 + (min(rows, warp * 16 + 16) - 1) / G : -1;
  float o[kD / 8][4];
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {kvc_neg_inf(), kvc_neg_inf()}, l[2] = {0.0f, 0.0f};

  const int* table = block_tables + (long long)seq * max_blocks;
#ifdef KVC_INT4
  const Int4Stage int4(int4_cache, num_kv_heads, block_shift, kvh);
  unsigned char* raw = smem + 2 * 2 * kTileBytes;
  auto stage = [&](int k0, int b) {  // keys [k0, k0 + kKT) into buffer b
    int4.stage(smem + b * 2 * kTileBytes, smem + b * 2 * kTileBytes + kTileBytes,
               raw + b * Int4Stage::kBytes, table, k0, k_end, tid);
  };
#else
  const unsigned char* k_base = reinterpret_cast<const unsigned char*>(k_cache) +
                                (long long)kvh * kRowBytes;
  const unsigned char* v_base = reinterpret_cast<const unsigned char*>(v_cache) +
                                (long long)kvh * kRowBytes;
  const long long slot_bytes = (long long)num_kv_heads * kRowBytes;
  auto stage = [&](int k0, int b) {  // keys [k0, k0 + kKT) into buffer b
    stage_kv_tile<kKT, KVC_PREFILL_MMA_THREADS, kRowBytes, kPitch, 1>(
        smem + b * 2 * kTileBytes, smem + b * 2 * kTileBytes + kTileBytes, k_base, v_base,
        slot_bytes, table, block_shift, k0, k_end, tid);
  };
#endif

  stage(k_begin, 0);
  cp_async_commit();
  for (int it = 0; it < num_tiles; ++it) {
    if (it + 1 < num_tiles) stage(k_begin + (it + 1) * kKT, (it + 1) & 1);
    cp_async_commit();
#ifndef KVC_BREAK_WAIT  // the tests' mutant: the tile is read before its copies complete
    cp_async_wait<1>();
#endif
    __syncthreads();  // every thread's copies of this tile have landed
    const int tile0 = k_begin + it * kKT;
#ifdef KVC_INT4
    int4.template dequant<scalar_t>(smem + (it & 1) * 2 * kTileBytes,
                                    smem + (it & 1) * 2 * kTileBytes + kTileBytes,
                                    raw + (it & 1) * Int4Stage::kBytes, tile0, tid);
    __syncthreads();  // the tile's sealed keys are activations now
#endif
    if (tile0 <= warp_last) {  // warp-uniform: no collective is skipped by part of a warp
      const unsigned char* k_s = smem + (it & 1) * 2 * kTileBytes;
      const unsigned char* v_s = k_s + kTileBytes;
      float s[kKT / 8][4];  // S (16 rows x 64 keys); a 16-bit tile's K by ldmatrix.x4
#pragma unroll
      for (int j = 0; j < kKT / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
      qk_tile<scalar_t, cache_t, Rows, kD, kKT / 8>(s, qf, k_s, 0, lane);
      // scale and mask (span, causal, window); element e: row g + 8 (e >> 1), key 2t + (e & 1)
      float mx[2] = {m[0], m[1]};
#pragma unroll
      for (int j = 0; j < kKT / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1, k_pos = tile0 + j * 8 + 2 * t + (e & 1);
          const bool allowed = row_valid[r] && k_pos < k_end && k_pos <= q_pos[r] &&
                               (sliding_window <= 0 || k_pos > q_pos[r] - sliding_window);
          s[j][e] = allowed ? s[j][e] * scale : kvc_neg_inf();
          mx[r] = fmaxf(mx[r], s[j][e]);
        }
      }
      quad_max(mx);
      rescale_if_grew<kD / 8>(o, m, l, mx);
      unsigned pf[kKT / 16][4];  // P as A fragments straight from S's registers
      p_fragments<scalar_t, kKT / 8>(pf, s, m, l);
#pragma unroll
      for (int ks = 0; ks < kKT / 16; ++ks) {  // O (16 x D) += P V
        pv_tile<scalar_t, cache_t, Rows, kD, kPvUnroll>(o, pf[ks], v_s, ks * 16, lane);
      }
    }
#ifndef KVC_BREAK_SYNC  // the tests' mutant: a buffer is staged again while warps still read it
    __syncthreads();
#endif
  }
  cp_async_wait<0>();  // (nothing is left in flight: the last tile was waited for)

  quad_sum(l);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!row_valid[r]) continue;
    const int row = warp * 16 + g + 8 * r;
    const int h = KVC_QHEAD(kvh, row % G, G, num_kv_heads);
    const float inv = l[r] > 0.0f ? v_scale / l[r] : 0.0f;
    scalar_t* dst = out + ((long long)(q_start + i0 + row / G) * num_heads + h) * kD + 2 * t;
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      dst[n * 8] = from_float<scalar_t>(o[n][2 * r] * inv);
      dst[n * 8 + 1] = from_float<scalar_t>(o[n][2 * r + 1] * inv);
    }
  }
}

#ifdef KVC_INT4  // the cache arguments as the tile function takes them
#define KVC_PM_KV_ARGS Int4Cache{k_cache, v_cache, k_window, v_window, window_slot}
#else
#define KVC_PM_KV_ARGS k_cache, v_cache
#endif
extern "C" __global__ void __launch_bounds__(KVC_PREFILL_MMA_THREADS, 1)
    paged_attention_prefill_mma(KVC_SCALAR* out, const KVC_SCALAR* query,
#ifdef KVC_INT4
                                const unsigned char* k_cache, const unsigned char* v_cache,
                                const __half* k_window, const __half* v_window,
                                const int* window_slot,
#else
                                const KVC_CACHE* k_cache, const KVC_CACHE* v_cache,
#endif
                                const int* block_tables, const int* context_lens,
                                const int* query_start_loc, int num_heads, int num_kv_heads,
                                int block_shift, int max_blocks, int sliding_window, float scale,
                                float k_scale, float v_scale) {
  extern __shared__ __align__(128) unsigned char kvc_pm_smem[];
  prefill_mma_tile<KVC_SCALAR, KVC_CACHE>(out, query, KVC_PM_KV_ARGS, block_tables,
                                          context_lens, query_start_loc, num_heads, num_kv_heads,
                                          block_shift, max_blocks, sliding_window,
                                          scale * k_scale, v_scale, kvc_pm_smem);
}
