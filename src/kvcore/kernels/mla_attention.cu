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
// partitions), 128 threads (4 warps). A sequence's rows are its (position, head) pairs in the
// query's own order (row g = position g / H, head g % H: contiguous in memory), kRows = 32 per
// block; a decode sequence has H rows. Key tiles of kKT keys (64; 32 when a row is wider than
// 320) are gathered through the block table with 16-byte loads, dequantized (fp8) while staged;
// keys past the block's span are zero-filled (free slots may hold NaN). S = Q K^T by
// nvcuda::wmma (m16n16k16, fp32 accumulate): warp w computes row tile w % 2 against key tiles
// w / 2, w / 2 + 2; the online softmax runs in fp32 with four threads per row (scale, causal
// mask, running max and sum in registers), P is written back as fp16 / bf16, then O += P V by
// wmma, V being the staged tile's first kv_lora_rank columns, on an fp32 O tile in shared memory
// (rescaled by the running max's change before each tile; warp w owns O's column tiles w, w + 4,
// ...). Shared memory is above 48 KB for every useful shape: the launcher opts in (144.5 KB at
// DeepSeek's 512 + 64).
//
// Split-KV (num_partitions > 1) applies to one-token sequences: blockIdx.z is a run of whole KV
// blocks, and each block writes its normalized partial output, max logit and exp-sum for
// mla_reduce (split_kv_reduce.cuh). Prefill chunks always run whole, in partition 0.
#include <mma.h>

#include "common.cuh"
#include "split_kv_reduce.cuh"
#include "tc_stage.cuh"

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

#define KVC_MLA_THREADS 128

namespace wmma = nvcuda::wmma;

constexpr int kR = KVC_LORA_RANK;
constexpr int kW = KVC_LORA_RANK + KVC_ROPE_DIM;  // one cached row: latent, then rope key
constexpr int kRows = 32;                          // query rows per block
constexpr int kKT = kW > 320 ? 32 : 64;            // keys per tile
constexpr int kLdQ = kW + 8;                       // padded leading dimensions (elements): rows
constexpr int kLdS = kKT + 4;                      // start on different banks, every fragment
constexpr int kLdP = kKT + 8;                      // pointer stays 32-byte aligned
constexpr int kLdO = kR + 4;
constexpr int kTPR = KVC_MLA_THREADS / kRows;      // softmax threads per row (4)
constexpr int kCols = kKT / kTPR;                  // scores per softmax thread and tile
constexpr int kWarps = KVC_MLA_THREADS / KVC_WARP;
static_assert(kR % 16 == 0 && KVC_ROPE_DIM % 16 == 0 && kW <= 1024,
              "kv_lora_rank and the rope dim: multiples of 16");
static_assert(kRows == 32 && kWarps == 4, "the warp layout below assumes 2 row tiles, 4 warps");

// Byte offsets of the shared-memory regions (all multiples of 32 bytes).
constexpr int kOffK = kRows * kLdQ * 2;
constexpr int kOffS = kOffK + kKT * kLdQ * 2;
constexpr int kOffP = kOffS + kRows * kLdS * 4;
constexpr int kOffO = kOffP + kRows * kLdP * 2;
constexpr int kSmemBytes = kOffO + kRows * kLdO * 4;

template <typename scalar_t, typename cache_t>
__device__ void mla_tile(
    scalar_t* __restrict__ out,               // (T, H, kR)
    const scalar_t* __restrict__ query,       // (T, H, kW)
    const cache_t* __restrict__ cache,        // (num_blocks, block_size, 1, kW)
    const int* __restrict__ block_tables,     // (S, max_blocks)
    const int* __restrict__ context_lens,     // (S,)
    const int* __restrict__ query_start_loc,  // (S + 1,)
    float* __restrict__ tmp_out,              // (S, H, P, kR) decode partials, P > 1
    float* __restrict__ max_logits,           // (S, H, P)
    float* __restrict__ exp_sums,             // (S, H, P)
    int num_heads, int block_size, int max_blocks, int num_partitions, float scale,
    float v_scale, unsigned char* smem) {
  const int seq = blockIdx.y, part = blockIdx.z;
  const int q_start = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_start;
  const int num_rows = q_len * num_heads;  // the sequence's (position, head) rows
  const int row0 = blockIdx.x * kRows;
  const bool split = q_len == 1 && num_partitions > 1;
  if (q_len < 1 || row0 >= num_rows || (!split && part > 0)) return;
  const int rows = min(kRows, num_rows - row0);
  const int first_pos = context_lens[seq] - q_len;  // position of the sequence's first query
  const int tid = threadIdx.x, warp = tid / KVC_WARP;

  scalar_t* q_s = reinterpret_cast<scalar_t*>(smem);          // (kRows, kLdQ)
  scalar_t* k_s = reinterpret_cast<scalar_t*>(smem + kOffK);  // (kKT, kLdQ): K, and V = :kR
  float* s_s = reinterpret_cast<float*>(smem + kOffS);        // (kRows, kLdS) scores
  scalar_t* p_s = reinterpret_cast<scalar_t*>(smem + kOffP);  // (kRows, kLdP) probabilities
  float* o_s = reinterpret_cast<float*>(smem + kOffO);        // (kRows, kLdO) unnormalized out

  constexpr int kQChunks = kW / 8;  // 16-byte chunks of a 16-bit row
  const scalar_t* q_src = query + ((long long)q_start * num_heads + row0) * kW;
  for (int i = tid; i < kRows * kQChunks; i += KVC_MLA_THREADS) {
    const int r = i / kQChunks, c = i % kQChunks;
    scalar_t* dst = q_s + r * kLdQ + c * 8;
    if (r < rows) {
      stage8(q_src + (long long)r * kW + c * 8, dst);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = from_float<scalar_t>(0.0f);
    }
  }
  for (int i = tid; i < kRows * kR; i += KVC_MLA_THREADS) o_s[(i / kR) * kLdO + i % kR] = 0.0f;

  // the block's keys: up to its last row's position; a decode partition, a run of whole blocks
  int k_begin = 0;
  int k_end = first_pos + (row0 + rows - 1) / num_heads + 1;
  if (split) {
    const int per_part = ((k_end + block_size - 1) / block_size + num_partitions - 1) /
                         num_partitions;
    k_begin = min(k_end, part * per_part * block_size);
    k_end = min(k_end, (part + 1) * per_part * block_size);
  }
  // softmax state of row `row`: four consecutive lanes share it, each taking every fourth key
  const int row = tid / kTPR, quarter = tid % kTPR;
  const bool row_valid = row < rows;
  const int q_pos = first_pos + (row0 + row) / num_heads;
  float m = kvc_neg_inf(), l = 0.0f;
  const int* table = block_tables + (long long)seq * max_blocks;

  for (int kb = k_begin; kb < k_end; kb += kKT) {
    __syncthreads();  // the previous tile's K and P are no longer read (and Q / O are staged)
    constexpr int kCE = StageChunk<cache_t>::kElems;
    constexpr int kCacheChunks = kW / kCE;  // 16-byte chunks of a cache row
    constexpr int kRounds = (kKT * kCacheChunks + KVC_MLA_THREADS - 1) / KVC_MLA_THREADS;
    // 6 rounds unrolled: 6 x 16-byte loads in flight per thread (18 rounds at 512 + 64 fully
    // unrolled take bf16 to 254 registers)
#pragma unroll 6
    for (int round = 0; round < kRounds; ++round) {
      const int i = tid + round * KVC_MLA_THREADS;
      if (kKT * kCacheChunks % KVC_MLA_THREADS != 0 && i >= kKT * kCacheChunks) break;
      const int t = i / kCacheChunks, c = i % kCacheChunks, pos = kb + t;
      scalar_t* dst = k_s + t * kLdQ + c * kCE;
      if (pos < k_end) {
        const long long slot = (long long)table[pos / block_size] * block_size + pos % block_size;
        stage_chunk(cache + slot * kW + c * kCE, dst);
      } else {  // past the span: zeros, never the slot's contents (0 x NaN would poison P V)
#pragma unroll
        for (int e = 0; e < kCE; ++e) dst[e] = from_float<scalar_t>(0.0f);
      }
    }
#ifndef KVC_BREAK_SYNC  // the tests' mutant: warps read the tile before it is staged
    __syncthreads();
#endif

    {  // S (32 x kKT) = Q K^T: K staged as (keys, kW) row-major is K^T column-major
      constexpr int kTiles = kKT / 32;  // key tiles per warp
      const int rt = warp % 2;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kTiles];
#pragma unroll
      for (int j = 0; j < kTiles; ++j) wmma::fill_fragment(acc[j], 0.0f);
      for (int k0 = 0; k0 < kW; k0 += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, scalar_t, wmma::row_major> qa;
        wmma::load_matrix_sync(qa, q_s + rt * 16 * kLdQ + k0, kLdQ);
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, scalar_t, wmma::col_major> kf;
          wmma::load_matrix_sync(kf, k_s + (warp / 2 + 2 * j) * 16 * kLdQ + k0, kLdQ);
          wmma::mma_sync(acc[j], qa, kf, acc[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        wmma::store_matrix_sync(s_s + rt * 16 * kLdS + (warp / 2 + 2 * j) * 16, acc[j], kLdS,
                                wmma::mem_row_major);
      }
    }
    __syncthreads();

    // online softmax of this thread's quarter of its row, in fp32
    const float* srow = s_s + row * kLdS;
    scalar_t* prow = p_s + row * kLdP;
    float tile_max = kvc_neg_inf();
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int k_pos = kb + quarter + kTPR * j;
      if (row_valid && k_pos < k_end && k_pos <= q_pos) {
        tile_max = fmaxf(tile_max, srow[quarter + kTPR * j] * scale);
      }
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(KVC_FULL_MASK, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(KVC_FULL_MASK, tile_max, 2));
    const float m_new = fmaxf(m, tile_max);
    const float alpha = m == kvc_neg_inf() ? 0.0f : __expf(m - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int c = quarter + kTPR * j, k_pos = kb + c;
      const bool allowed = row_valid && k_pos < k_end && k_pos <= q_pos;
      const float p = allowed ? __expf(srow[c] * scale - m_new) : 0.0f;
      // P V sums the probabilities as rounded to the activation type: so does l
      const scalar_t p16 = from_float<scalar_t>(p);
      prow[c] = p16;
      sum += to_float(p16);
    }
    l = l * alpha + sum;  // this thread's keys; the row's four parts are added at the end
    m = m_new;
    for (int d = quarter; d < kR; d += kTPR) o_s[row * kLdO + d] *= alpha;
    __syncthreads();

    // O (32 x kR) += P V, V = the tile's latent columns (keys, kR) row-major
#pragma unroll
    for (int rt = 0; rt < 2; ++rt) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, scalar_t, wmma::row_major> pa[kKT / 16];
#pragma unroll
      for (int kk = 0; kk < kKT / 16; ++kk) {
        wmma::load_matrix_sync(pa[kk], p_s + rt * 16 * kLdP + kk * 16, kLdP);
      }
      for (int ct = warp; ct < kR / 16; ct += kWarps) {
        float* o_tile = o_s + rt * 16 * kLdO + ct * 16;
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::load_matrix_sync(acc, o_tile, kLdO, wmma::mem_row_major);
#pragma unroll
        for (int kk = 0; kk < kKT / 16; ++kk) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, scalar_t, wmma::row_major> vf;
          wmma::load_matrix_sync(vf, k_s + kk * 16 * kLdQ + ct * 16, kLdQ);
          wmma::mma_sync(acc, pa[kk], vf, acc);
        }
        wmma::store_matrix_sync(o_tile, acc, kLdO, wmma::mem_row_major);
      }
    }
  }

  l += __shfl_xor_sync(KVC_FULL_MASK, l, 1);
  l += __shfl_xor_sync(KVC_FULL_MASK, l, 2);
  __syncthreads();  // every warp's last O tile is stored
  if (!row_valid) return;
  // l = 0 only for an empty decode partition: zeros and a zero weight for the reduction
  const float inv = l > 0.0f ? v_scale / l : 0.0f;
  const float* orow = o_s + row * kLdO;
  if (split) {  // one-token sequence: row = head
    const long long idx = ((long long)seq * num_heads + row0 + row) * num_partitions + part;
    for (int d = quarter; d < kR; d += kTPR) tmp_out[idx * kR + d] = orow[d] * inv;
    if (quarter == 0) {
      max_logits[idx] = m;
      exp_sums[idx] = l;
    }
    return;
  }
  scalar_t* dst = out + ((long long)q_start * num_heads + row0 + row) * kR;
  for (int d = quarter; d < kR; d += kTPR) dst[d] = from_float<scalar_t>(orow[d] * inv);
}

extern "C" __global__ void __launch_bounds__(KVC_MLA_THREADS, 1) mla_paged_attention(
    KVC_SCALAR* out, const KVC_SCALAR* query, const KVC_CACHE* cache, const int* block_tables,
    const int* context_lens, const int* query_start_loc, float* tmp_out, float* max_logits,
    float* exp_sums, int num_heads, int block_size, int max_blocks, int num_partitions,
    float scale, float kv_scale) {
  extern __shared__ __align__(128) unsigned char kvc_mla_smem[];
  mla_tile<KVC_SCALAR, KVC_CACHE>(out, query, cache, block_tables, context_lens, query_start_loc,
                                  tmp_out, max_logits, exp_sums, num_heads, block_size,
                                  max_blocks, num_partitions, scale * kv_scale, kv_scale,
                                  kvc_mla_smem);
}

// grid (H, S), 128 threads, 4 (P + 1) bytes of shared memory: merges the partitions of the
// one-token sequences (split_kv_reduce.cuh); out (T, H, kR).
extern "C" __global__ void mla_reduce(KVC_SCALAR* out, const float* tmp_out,
                                      const float* max_logits, const float* exp_sums,
                                      const int* query_start_loc, int num_heads,
                                      int num_partitions) {
  extern __shared__ __align__(16) float kvc_mla_weights[];
  decode_reduce<KVC_SCALAR>(out, tmp_out, max_logits, exp_sums, query_start_loc, num_heads, kR,
                            num_partitions, kvc_mla_weights);
}
