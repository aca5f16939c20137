// Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache, on tensor cores, in
// the absorbed form: decode rows (and prefill chunks) of queries already moved into latent space.
//
// Per token the cache holds one row of kW = kv_lora_rank + qk_rope_head_dim elements, the
// normalized latent c and the rotated rope key k_r, shared by every query head: it is both the
// key and (its first kv_lora_rank columns) the value of an MQA with a single "KV head". So the
// query heads of a sequence are the rows of the tensor-core tiles, and each cache tile staged in
// shared memory serves every head of the block. query (T, H, kW) holds [q_nope W_UK, q_rope] per
// head; out (T, H, kv_lora_rank) is the latent-space output, before W_UV.
//
// One compiled variant per (kv_lora_rank, rope dim, activation dtype, cache dtype):
// KVC_LORA_RANK, KVC_ROPE_DIM, KVC_SCALAR, KVC_CACHE are -D options. grid (row tiles, num_seqs,
// partitions), 256 threads (8 warps). A sequence's rows are its (position, head) pairs in the
// query's own order (row g = position g / H, head g % H: contiguous in memory), kRows = 64 per
// block (4 row blocks of 16): a decode sequence of 64 heads is one block, of 128 two.
//
// Q (64 rows) is staged once; latent tiles of kKT keys (KVC_MLA_KEYS: 64, 32, or 16) are
// staged raw (fp8 stays 1 byte) by cp.async 16-byte copies through the block table into two
// buffers, the next tile in flight while the current one computes; the copies zero-fill keys
// past the span (free slots may hold NaN). Per tile, with PTX mma.sync m16n8k16 (fp32
// accumulate, fragment layouts as ptx_ops.cuh states them):
//   S: warp w computes row block w % 4 against key half w / 4 (S in registers, Q and K
//      fragments from shared memory), masks and scales it, and the two key halves of a row
//      exchange their maxima through shared memory;
//   P: exp(S - m) rounded to the activation type, written once to shared memory (every warp
//      needs all of P), with each row's rescale factor alpha;
//   O: warp w owns latent columns [w kR / 8, (w + 1) kR / 8) of O for all 64 rows, in
//      registers across tiles (128 fp32 at kR = 512); it rescales them by alpha only when some
//      row's max grew (a warp vote), then O += P V with each V fragment loaded once (the latent
//      columns of the same staged tile: K and V are one copy).
// Shared rows are padded by 16 bytes, or XOR-swizzled by 16-byte chunk for the 64-key tiles of a
// 16-bit cache (SmemRows), so fragment loads of 8 rows x 4 lanes hit distinct banks. The dynamic
// shared memory is kSmemBytes: at DeepSeek's 512 + 64 with a 16-bit cache 225.75 KB with 64-key
// tiles (sm_90) or 151.75 KB with 32-key tiles (sm_80), 156.75 KB with fp8's 64-key tiles.
//
// Split-KV (num_partitions > 1) applies to one-token sequences: blockIdx.z is a run of whole KV
// blocks, and each block writes its normalized partial output, max logit and exp-sum for
// mla_reduce (split_kv_reduce.cuh). Prefill chunks always run whole, in partition 0.
#include "common.cuh"
#include "mma_tile.cuh"  // mma.sync / cp.async through <ptx_ops.cuh> (the kernel dir is on the path)
#include "split_kv_reduce.cuh"

#ifndef KVC_LORA_RANK
#define KVC_LORA_RANK 512
#endif
#ifndef KVC_ROPE_DIM
#define KVC_ROPE_DIM 64
#endif
#ifndef KVC_SCALAR
#define KVC_SCALAR __half
#endif
#ifndef KVC_CACHE
#define KVC_CACHE __half
#endif

#define KVC_MLA_THREADS 256

constexpr int kR = KVC_LORA_RANK;
constexpr int kW = KVC_LORA_RANK + KVC_ROPE_DIM;  // one cached row: latent, then rope key
constexpr int kRows = 64;                          // query rows per block
constexpr int kRB = kRows / 16;                    // row blocks (4)
constexpr int kWarps = KVC_MLA_THREADS / KVC_WARP; // 8
// keys per staged tile (KVC_MLA_KEYS, chosen by the launcher): 64 where the tiles fit the
// device's shared memory (Q's fragment reads per key halve), else 32; 16 past 576 wide
#ifndef KVC_MLA_KEYS
#define KVC_MLA_KEYS (kW > 576 ? 16 : sizeof(KVC_CACHE) == 1 ? 64 : 32)
#endif
constexpr int kKT = KVC_MLA_KEYS;
constexpr int kSN = kKT / 2 / 8;                   // S n-tiles per warp (its key half)
constexpr int kON = (kR / 8 + kWarps - 1) / kWarps;  // O n-tiles (8 columns) per warp
constexpr int kRowBytes = kW * (int)sizeof(KVC_CACHE);
// shared rows: padded; swizzled for Q and the tiles where 64-key tiles of a 16-bit cache must
// fit sm_90's 227 KB (DeepSeek's 576: 225.75 KB; padded rows, 228.75 KB, would not)
constexpr bool kSwizzle = kKT == 64 && sizeof(KVC_CACHE) == 2 && kW % 64 == 0;
using TileRows = SmemRows<kRowBytes, kSwizzle>;
using QRows = SmemRows<kW * 2, kSwizzle>;
using PRows = SmemRows<kKT * 2, false>;
constexpr int kChunks = kRowBytes / 16;
// staging: up to 8 threads per row, each a run of consecutive 16-byte chunks
constexpr int kStageLanes = kChunks % 8 == 0 ? 8 : kChunks % 4 == 0 ? 4 : kChunks % 2 == 0 ? 2 : 1;
constexpr int kStageRun = kChunks / kStageLanes;
constexpr int kTileBytes = kKT * TileRows::kPitch;
// Byte offsets of the shared-memory regions: Q, two tile buffers, P, row statistics
constexpr int kOffTile = kRows * QRows::kPitch;
constexpr int kOffP = kOffTile + 2 * kTileBytes;
constexpr int kOffStats = kOffP + kRows * PRows::kPitch;  // (2, kRows) maxima / sums, (kRows) alpha
constexpr int kSmemBytes = kOffStats + 3 * kRows * 4;
static_assert(kR % 16 == 0 && KVC_ROPE_DIM % 16 == 0 && kW <= 1024,
              "kv_lora_rank and the rope dim: multiples of 16");
static_assert(kWarps == 2 * kRB && (kKT == 16 || kKT == 32 || kKT == 64),
              "the warp layout: 4 row blocks x 2 key halves of 8, 16 or 32 keys");

// Two activation values at (even) element col of row r of a laid-out shared tile, and one.
template <class Rows, typename scalar_t, typename elem_t>
__device__ __forceinline__ unsigned pair_in(const unsigned char* tile, int r, int col,
                                            const elem_t* tag) {
  return pair_at<scalar_t>(tile + Rows::at(r, col * (int)sizeof(elem_t)), 0, tag);
}
template <class Rows, typename scalar_t, typename elem_t>
__device__ __forceinline__ unsigned elem_in(const unsigned char* tile, int r, int col,
                                            const elem_t* tag) {
  return elem_at<scalar_t>(tile + Rows::at(r, col * (int)sizeof(elem_t)), 0, tag);
}

template <typename scalar_t, typename cache_t>
__device__ void mla_block(
    scalar_t* __restrict__ out,               // (T, H, kR)
    const scalar_t* __restrict__ query,       // (T, H, kW)
    const cache_t* __restrict__ cache,        // (num_blocks, block_size, 1, kW)
    const int* __restrict__ block_tables,     // (S, max_blocks)
    const int* __restrict__ context_lens,     // (S,)
    const int* __restrict__ query_start_loc,  // (S + 1,)
    float* __restrict__ tmp_out,              // (S, H, P, kR) decode partials, P > 1
    float* __restrict__ max_logits,           // (S, H, P)
    float* __restrict__ exp_sums,             // (S, H, P)
    int num_heads, int block_size, int block_shift, int max_blocks, int num_partitions,
    float scale, float v_scale, unsigned char* smem) {
  const int seq = blockIdx.y, part = blockIdx.z;
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  const int num_rows = q_len * num_heads;  // the sequence's (position, head) rows
  const int row0 = blockIdx.x * kRows;
  const bool split = q_len == 1 && num_partitions > 1;
  if (q_len < 1 || row0 >= num_rows || (!split && part > 0)) return;
  const int rows = min(kRows, num_rows - row0);
  const int first_pos = context_lens[seq] - q_len;  // position of the sequence's first query
  // the block's keys: up to its last row's position; a decode partition, a run of whole blocks
  int k_begin = 0;
  int k_end = first_pos + (row0 + rows - 1) / num_heads + 1;
  if (split) {
    const int per_part = ((k_end + block_size - 1) / block_size + num_partitions - 1) /
                         num_partitions;
    k_begin = min(k_end, part * per_part * block_size);
    k_end = min(k_end, (part + 1) * per_part * block_size);
  }
  const int num_tiles = (k_end - k_begin + kKT - 1) / kKT;

  const int tid = threadIdx.x, lane = tid % KVC_WARP, warp = tid / KVC_WARP;
  const int g = lane >> 2, t = lane & 3;  // the fragment coordinates of this lane
  const int srb = warp % kRB, half = warp / kRB;  // S: the warp's row block and key half
  const int skey0 = half * (kKT / 2);
  unsigned char* q_s = smem;  // (kRows, QRows) 16-bit activations
  unsigned char* p_s = smem + kOffP;  // (kRows, PRows) probabilities
  float* stats = reinterpret_cast<float*>(smem + kOffStats);  // (2, kRows): max, later sum
  float* alpha_s = stats + 2 * kRows;                          // (kRows)

  // Q rows (zero past the block's rows), in the same cp.async group as the first tile
  const unsigned char* q_src = reinterpret_cast<const unsigned char*>(
      query + ((long long)q_start * num_heads + row0) * kW);
  for (int i = tid; i < kRows * (kW / 8); i += KVC_MLA_THREADS) {
    const int r = i / (kW / 8), c = i % (kW / 8);
    cp_async16_zfill(q_s + QRows::at(r, c * 16), q_src + (r < rows ? r * kW * 2 + c * 16 : 0),
                     r < rows);
  }
  const int* table = block_tables + (long long)seq * max_blocks;
  const unsigned char* base = reinterpret_cast<const unsigned char*>(cache);
  auto stage = [&](int k0, int b) {  // keys [k0, k0 + kKT) into buffer b
    stage_row_tile<kKT, KVC_MLA_THREADS, kRowBytes, TileRows, kStageRun>(
        smem + kOffTile + b * kTileBytes, base, table, block_size, block_shift, k0, k_end, tid);
  };
  if (num_tiles > 0) stage(k_begin, 0);
  cp_async_commit();

  // S rows of this lane: srb * 16 + g and + 8; positions of invalid rows see no key
  int q_pos[2];
  float m[2] = {kvc_neg_inf(), kvc_neg_inf()}, l[2] = {0.0f, 0.0f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = srb * 16 + g + 8 * r;
    q_pos[r] = row < rows ? first_pos + (row0 + row) / num_heads : -1;
  }
  float o[kRB][kON][4];
#pragma unroll
  for (int rb = 0; rb < kRB; ++rb)
#pragma unroll
    for (int n = 0; n < kON; ++n) o[rb][n][0] = o[rb][n][1] = o[rb][n][2] = o[rb][n][3] = 0.0f;

  for (int it = 0; it < num_tiles; ++it) {
#ifndef KVC_BREAK_WAIT  // the tests' mutant: the tile is read before its copies complete
    cp_async_wait<0>();
#endif
#ifndef KVC_BREAK_SYNC  // the tests' mutant: no barrier between the buffer swaps
    __syncthreads();  // every thread's copies of tile it landed; tile it - 1 is no longer read
#endif
    if (it + 1 < num_tiles) stage(k_begin + (it + 1) * kKT, (it + 1) & 1);  // next in flight
    cp_async_commit();
    const unsigned char* kv = smem + kOffTile + (it & 1) * kTileBytes;
    const int tile0 = k_begin + it * kKT;

    // S (16 rows x kKT / 2 keys) = Q K^T: K rows are B's columns, two elements per .b32
    float s[kSN][4];
#pragma unroll
    for (int j = 0; j < kSN; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    const int q_row = srb * 16 + g;
    // a row block wholly past the block's rows (16 heads: 3 of 4) has no scores to compute
    const bool has_rows = srb * 16 < rows;  // block-uniform per warp
    const int num_k = has_rows ? kW / 16 : 0;  // 16-column steps of the warp's S
    if constexpr (sizeof(cache_t) == 2) {  // Q and K by ldmatrix.x4: two 16-column steps at once
      // 3 pairs of steps per pass (unrolled whole, the loop spills at 255 registers)
#pragma unroll 3
      for (int kk = 0; kk + 1 < kW / 16; kk += 2) {
        if (!has_rows) break;
        unsigned qa[2][4];
        a_frags_x4<QRows>(qa[0], q_s, srb * 16, kk * 16, lane);
        a_frags_x4<QRows>(qa[1], q_s, srb * 16, kk * 16 + 16, lane);
#pragma unroll
        for (int j = 0; j < kSN; ++j) {
          unsigned b[4];
          k_frags_x4<TileRows>(b, kv, skey0 + j * 8, kk, lane);
          const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          mma_m16n8k16<scalar_t>(s[j], qa[0], b0);
          mma_m16n8k16<scalar_t>(s[j], qa[1], b1);
        }
      }
      if ((kW / 16) % 2 == 1 && num_k > 0) {  // an odd last step
        unsigned qa[4];
        a_frags_x4<QRows>(qa, q_s, srb * 16, kW - 16, lane);
#pragma unroll
        for (int j = 0; j < kSN; ++j) {
          unsigned b[2];
          k_frags_x2<TileRows>(b, kv, skey0 + j * 8, kW / 16 - 1, lane);
          mma_m16n8k16<scalar_t>(s[j], qa, b);
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < num_k; ++kk) {
        const int c = kk * 16 + 2 * t;
        unsigned qa[4];
        a_frags_x4<QRows>(qa, q_s, srb * 16, kk * 16, lane);
#pragma unroll
        for (int j = 0; j < kSN; ++j) {
          const int key = skey0 + j * 8 + g;
          const unsigned kf[2] = {pair_in<TileRows, scalar_t>(kv, key, c, cache),
                                  pair_in<TileRows, scalar_t>(kv, key, c + 8, cache)};
          mma_m16n8k16<scalar_t>(s[j], qa, kf);
        }
      }
    }
    // element e of n-tile j: row g + 8 (e >> 1), key skey0 + 8 j + 2 t + (e & 1)
    float mx[2] = {kvc_neg_inf(), kvc_neg_inf()};
#pragma unroll
    for (int j = 0; j < kSN; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = tile0 + skey0 + j * 8 + 2 * t + (e & 1);
        const bool valid = key < k_end && key <= q_pos[e >> 1];
        s[j][e] = valid ? s[j][e] * scale : kvc_neg_inf();
        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(KVC_FULL_MASK, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(KVC_FULL_MASK, mx[r], 2));
      if (t == 0) stats[half * kRows + srb * 16 + g + 8 * r] = mx[r];
    }
    __syncthreads();  // both key halves' maxima
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = srb * 16 + g + 8 * r;
      const float m_new = fmaxf(m[r], fmaxf(mx[r], stats[(1 - half) * kRows + row]));
      // 1 exactly when the max did not grow (so the vote below can skip the rescale)
      const float a = m_new == m[r] ? 1.0f : m[r] == kvc_neg_inf() ? 0.0f : __expf(m[r] - m_new);
      l[r] *= a;
      m[r] = m_new;
      if (half == 0 && t == 0) alpha_s[row] = a;
    }
    // P rounded to the activation type (l sums it as rounded, as P V does), to shared memory
#pragma unroll
    for (int j = 0; j < kSN; ++j) {
      scalar_t p[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p[e] = from_float<scalar_t>(s[j][e] == kvc_neg_inf() ? 0.0f
                                                               : __expf(s[j][e] - m[e >> 1]));
        l[e >> 1] += to_float(p[e]);
      }
      const int pcol = (skey0 + j * 8 + 2 * t) * 2;
      *reinterpret_cast<unsigned*>(p_s + PRows::at(srb * 16 + g, pcol)) = pack2(p[0], p[1]);
      *reinterpret_cast<unsigned*>(p_s + PRows::at(srb * 16 + g + 8, pcol)) = pack2(p[2], p[3]);
    }
    __syncthreads();  // P and alpha of every row

    // O (64 rows x the warp's columns): rescale only when some row's max grew (warp vote)
    float alpha[kRB][2];
    bool grew = false;
#pragma unroll
    for (int rb = 0; rb < kRB; ++rb) {
      alpha[rb][0] = alpha_s[rb * 16 + g];
      alpha[rb][1] = alpha_s[rb * 16 + g + 8];
      grew |= alpha[rb][0] != 1.0f || alpha[rb][1] != 1.0f;
    }
#ifdef KVC_BREAK_VOTE  // the tests' mutant: the rescale is always skipped
    grew = false;
#endif
    if (__any_sync(KVC_FULL_MASK, grew)) {
#pragma unroll
      for (int rb = 0; rb < kRB; ++rb) {
#pragma unroll
        for (int n = 0; n < kON; ++n) {
          o[rb][n][0] *= alpha[rb][0];
          o[rb][n][1] *= alpha[rb][0];
          o[rb][n][2] *= alpha[rb][1];
          o[rb][n][3] *= alpha[rb][1];
        }
      }
    }
    // O += P V: P's A fragments for the 4 row blocks, then each V fragment once for all four
#pragma unroll
    for (int ks = 0; ks < kKT / 16; ++ks) {
      unsigned pa[kRB][4];
#pragma unroll
      for (int rb = 0; rb < kRB; ++rb) {
        a_frags_x4<PRows>(pa[rb], p_s, rb * 16, ks * 16, lane);
#ifdef KVC_BREAK_FRAGMENT  // the tests' mutant: rows g + 8 and keys 8-15 trade places
        const unsigned swap = pa[rb][1];
        pa[rb][1] = pa[rb][2];
        pa[rb][2] = swap;
#endif
      }
      const int v0 = ks * 16 + 2 * t;  // B rows (keys) v0, v0 + 1, v0 + 8, v0 + 9
#pragma unroll
      for (int n = 0; n < kON; ++n) {
        const int nt = warp * kON + n;
        if (kR % (8 * kWarps) != 0 && nt >= kR / 8) break;
        unsigned vf[2];
        if constexpr (sizeof(cache_t) == 2) {  // 16 keys x 8 columns by ldmatrix.x2.trans
          v_frags_x2<TileRows>(vf, kv, ks * 16, nt, lane);
        } else {
          const int col = nt * 8 + g;
          vf[0] = elem_in<TileRows, scalar_t>(kv, v0, col, cache) |
                  (elem_in<TileRows, scalar_t>(kv, v0 + 1, col, cache) << 16);
          vf[1] = elem_in<TileRows, scalar_t>(kv, v0 + 8, col, cache) |
                  (elem_in<TileRows, scalar_t>(kv, v0 + 9, col, cache) << 16);
        }
#pragma unroll
        for (int rb = 0; rb < kRB; ++rb) {
          if (rb * 16 < rows) mma_m16n8k16<scalar_t>(o[rb][n], pa[rb], vf);  // block-uniform
        }
      }
    }
  }
  cp_async_wait<0>();  // (nothing is left in flight but under the tests' mutants)

  // each row's sum: 4 lanes, then the two key halves through shared memory
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(KVC_FULL_MASK, l[r], 1);
    l[r] += __shfl_xor_sync(KVC_FULL_MASK, l[r], 2);
  }
  __syncthreads();  // the last tile's statistics are read
  if (t == 0) {
    stats[half * kRows + srb * 16 + g] = l[0];
    stats[half * kRows + srb * 16 + g + 8] = l[1];
  }
  __syncthreads();
  if (split && half == 0 && t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = srb * 16 + g + 8 * r;
      if (row >= rows) continue;
      const long long idx = ((long long)seq * num_heads + row0 + row) * num_partitions + part;
      max_logits[idx] = m[r];
      exp_sums[idx] = stats[row] + stats[kRows + row];
    }
  }
#pragma unroll
  for (int rb = 0; rb < kRB; ++rb) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = rb * 16 + g + 8 * r;
      if (row >= rows) continue;
      const float sum = stats[row] + stats[kRows + row];
      // l = 0 only for an empty decode partition: zeros and a zero weight for the reduction
      const float inv = sum > 0.0f ? v_scale / sum : 0.0f;
      const long long head_row = (long long)q_start * num_heads + row0 + row;
#pragma unroll
      for (int n = 0; n < kON; ++n) {
        const int nt = warp * kON + n;
        if (kR % (8 * kWarps) != 0 && nt >= kR / 8) break;
        const int col = nt * 8 + 2 * t;
        if (split) {
          const long long idx = ((long long)seq * num_heads + row0 + row) * num_partitions + part;
          tmp_out[idx * kR + col] = o[rb][n][2 * r] * inv;
          tmp_out[idx * kR + col + 1] = o[rb][n][2 * r + 1] * inv;
        } else {
          *reinterpret_cast<unsigned*>(out + head_row * kR + col) =
              pack2(from_float<scalar_t>(o[rb][n][2 * r] * inv),
                    from_float<scalar_t>(o[rb][n][2 * r + 1] * inv));
        }
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(KVC_MLA_THREADS, 1) mla_paged_attention(
    KVC_SCALAR* out, const KVC_SCALAR* query, const KVC_CACHE* cache, const int* block_tables,
    const int* context_lens, const int* query_start_loc, float* tmp_out, float* max_logits,
    float* exp_sums, int num_heads, int block_size, int block_shift, int max_blocks,
    int num_partitions, float scale, float kv_scale) {
  extern __shared__ __align__(128) unsigned char kvc_mla_smem[];
  mla_block<KVC_SCALAR, KVC_CACHE>(out, query, cache, block_tables, context_lens,
                                   query_start_loc, tmp_out, max_logits, exp_sums, num_heads,
                                   block_size, block_shift, max_blocks, num_partitions,
                                   scale * kv_scale, kv_scale, kvc_mla_smem);
}

// grid (H, S), 128 threads, 4 (P + 1) bytes of shared memory: merges the partitions of the
// one-token sequences (split_kv_reduce.cuh); out (T, H, kR).
extern "C" __global__ void mla_reduce(KVC_SCALAR* out, const float* tmp_out,
                                      const float* max_logits, const float* exp_sums,
                                      const int* query_start_loc, int num_heads,
                                      int num_partitions) {
  extern __shared__ __align__(16) float kvc_mla_weights[];
  decode_reduce<KVC_SCALAR>(out, tmp_out, max_logits, exp_sums, query_start_loc, num_heads, kR,
                            num_partitions, num_partitions, kvc_mla_weights);
}
