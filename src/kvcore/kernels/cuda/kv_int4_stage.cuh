// Staging of int4 KV tiles for the register-tile attention kernels (the byte layout is
// kvcore.cache.int4's): a key of a sealed block moves as its packed nibbles (head_dim / 2 bytes
// of K and of V), its value scales and zeros, and once per block and tile the per-channel key
// scales and zeros; a key of a block still in the fp16 window moves as its fp16 rows. All by
// cp.async, so the next tile's copies stay in flight while the current tile is computed.
//
// `stage` puts window rows (and zeros past the span) straight into the kernel's 16-bit K/V tile
// rows, and the packed parts of sealed keys into a separate raw buffer; after the tile's wait and
// barrier, `dequant` unpacks each sealed key's nibbles in registers (zero + scale * q in float32,
// as the reference) into its tile rows in the activation type, so the kernel's fragment loads
// and mma.sync steps are those of a 16-bit cache. With bf16 activations the fp16 window rows are
// converted in place by the same pass.
#pragma once
#include <ptx_ops.cuh>

#include "common.cuh"

// One layer's int4 cache.
struct Int4Cache {
  const unsigned char* k_rows;  // (num_blocks, key row bytes)
  const unsigned char* v_rows;  // (num_blocks, value row bytes)
  const __half* k_window;       // (num_slots, block_size, Hkv, D)
  const __half* v_window;
  const int* window_slot;       // (num_blocks,) -1 = sealed, else the block's window slot
};

__device__ __forceinline__ void window_row_to(__half*, unsigned char*) {}  // fp16 as staged
__device__ __forceinline__ void window_row_to(__nv_bfloat16*, unsigned char* chunk) {
  const uint4 raw = *reinterpret_cast<const uint4*>(chunk);
  const __half* h = reinterpret_cast<const __half*>(&raw);
  __nv_bfloat16 out[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = __float2bfloat16_rn(__half2float(h[e]));
  *reinterpret_cast<uint4*>(chunk) = *reinterpret_cast<const uint4*>(out);
}

// Eight channels zero[e] + scale[e] * q[e] (q: 8 nibbles, channel e at bits 4e) written as
// activations into 16 bytes; scale and zero step by `step` halves (0: one group for all 8).
template <typename scalar_t>
__device__ __forceinline__ void dequant8(unsigned q, const __half* scale, const __half* zero,
                                         int step, unsigned char* dst) {
  scalar_t out[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float s = __half2float(scale[e * step]), z = __half2float(zero[e * step]);
    // no contraction into an fma: the reference rounds the product, then the sum
    out[e] = from_float<scalar_t>(__fadd_rn(z, __fmul_rn(s, (float)((q >> (4 * e)) & 0xFu))));
  }
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(out);
}

// The tiles of kKeys keys of one KV head: kD channels, 16-bit tile rows of kPitch bytes,
// value groups of kGroup channels; block sizes are powers of two from 8 on.
template <int kKeys, int kThreads, int kD, int kPitch, int kGroup>
struct Int4Tile {
  static constexpr int kNib = kD / 2;                   // packed bytes of one key's K (or V)
  static constexpr int kN = kD / kGroup;                // value groups per key
  static constexpr int kVWords = kN >= 2 ? kN / 2 : 1;  // 4-byte words of a key's V scales
  static constexpr int kMaxBlocks = kKeys / 8 + 1;      // blocks a tile touches (size >= 8)
  static constexpr int kChunks = kD / 8;                // 16-byte chunks of a 16-bit row
  // raw buffer: K nibbles (kKeys, kNib), V nibbles, V params (kKeys, 2, kVWords words),
  // K params (kMaxBlocks, 2, kD halves), a sealed flag per key
  static constexpr int kVNib = kKeys * kNib;
  static constexpr int kVPar = 2 * kKeys * kNib;
  static constexpr int kKPar = kVPar + kKeys * 2 * kVWords * 4;
  static constexpr int kFlags = kKPar + kMaxBlocks * 2 * kD * 2;
  static constexpr int kBytes = (kFlags + kKeys + 15) / 16 * 16;
  static_assert(kGroup % 8 == 0 && kD % kGroup == 0, "value groups of whole 8-channel chunks");
  static_assert(kNib % 16 == 0 && kChunks >= kNib / 16 + 2 * kVWords,
                "a key's packed copies fit in its chunk items");
  static_assert(kThreads % kChunks == 0, "a thread unpacks one chunk of every key it takes");

  Int4Cache cache;
  int heads, shift, kvh;
  long long k_row_bytes, v_row_bytes, split, v_zero;  // split: nibble bytes of a block

  __device__ Int4Tile(const Int4Cache& c, int num_kv_heads, int block_shift, int head)
      : cache(c), heads(num_kv_heads), shift(block_shift), kvh(head) {
    const long long bs = 1ll << block_shift;
    split = bs * heads * kNib;
    k_row_bytes = split + 4ll * heads * kD;
    v_zero = 2 * bs * heads * kN;
    v_row_bytes = split + 2 * v_zero;
  }

  // Keys [k0, k0 + kKeys) into the 16-bit tiles k_s / v_s (window rows; zeros at or past
  // k_hi) and the raw buffer (sealed keys); one block-table read per (key, chunk) item.
  __device__ __forceinline__ void stage(unsigned char* k_s, unsigned char* v_s,
                                        unsigned char* raw, const int* table, int k0, int k_hi,
                                        int tid) const {
    for (int i = tid; i < kKeys * kChunks; i += kThreads) {
      const int key = i / kChunks, c = i % kChunks;
      const int pos = k0 + key, p = pos & ((1 << shift) - 1);
      const bool valid = pos < k_hi;
      const int block = valid ? table[pos >> shift] : 0;
      const int window = valid ? cache.window_slot[block] : 0;
      if (window >= 0) {  // fp16 rows (or zeros past the span) straight into the tiles
        const long long row = ((((long long)window << shift) + p) * heads + kvh) * kD + c * 8;
        cp_async16_zfill(k_s + key * kPitch + c * 16, cache.k_window + row, valid);
        cp_async16_zfill(v_s + key * kPitch + c * 16, cache.v_window + row, valid);
      } else if (c < kNib / 16) {  // nibbles: chunk c of K and of V
        const long long at = ((long long)p * heads + kvh) * kNib + c * 16;
        cp_async16(raw + key * kNib + c * 16, cache.k_rows + block * k_row_bytes + at);
        cp_async16(raw + kVNib + key * kNib + c * 16, cache.v_rows + block * v_row_bytes + at);
      } else if (c < kNib / 16 + 2 * kVWords) {  // a word of the key's V scales or zeros
        const int w = c - kNib / 16, side = w / kVWords;
        const long long at = split + side * v_zero +
                             ((((long long)p * heads + kvh) * kN * 2) & ~3ll) + (w % kVWords) * 4;
        cp_async4_zfill(raw + kVPar + (key * 2 + side) * kVWords * 4 + (w % kVWords) * 4,
                        cache.v_rows + block * v_row_bytes + at, true);
      }
      if (c == 0) raw[kFlags + key] = valid && window < 0;
    }
    // the K scales and zeros of each sealed block the tile touches: 2 x kD halves
    const int b0 = k0 >> shift, k_end = min(k0 + kKeys, k_hi);
    for (int i = tid; i < kMaxBlocks * 2 * (kD / 8); i += kThreads) {
      const int bi = i / (2 * (kD / 8)), c = i % (2 * (kD / 8));
      if ((b0 + bi) << shift >= k_end) continue;
      const int block = table[b0 + bi];
      if (cache.window_slot[block] >= 0) continue;
      const int side = c / (kD / 8);
      const long long at = split + ((long long)side * heads + kvh) * kD * 2 + (c % (kD / 8)) * 16;
      cp_async16(raw + kKPar + bi * 4 * kD + c * 16, cache.k_rows + block * k_row_bytes + at);
    }
  }

  // After the tile's copies landed (wait + barrier): the sealed keys' rows of k_s / v_s as
  // activations; with bf16 activations, the window rows converted in place. Each (key, chunk)
  // item is read and written by one thread; a thread's chunk is the same for all its keys, so
  // it holds the K scales and zeros of its 8 channels while its keys stay in one block.
  template <typename scalar_t>
  __device__ __forceinline__ void dequant(unsigned char* k_s, unsigned char* v_s,
                                          const unsigned char* raw, int k0, int tid) const {
    const int c = tid % kChunks;
    int held = -1;  // the block (within the tile) whose K params k_scale / k_zero hold
    uint4 k_scale = {}, k_zero = {};
    for (int i = tid; i < kKeys * kChunks; i += kThreads) {
      const int key = i / kChunks;
      unsigned char* k_dst = k_s + key * kPitch + c * 16;
      unsigned char* v_dst = v_s + key * kPitch + c * 16;
      if (!raw[kFlags + key]) {
        window_row_to(static_cast<scalar_t*>(nullptr), k_dst);
        window_row_to(static_cast<scalar_t*>(nullptr), v_dst);
        continue;
      }
      const int pos = k0 + key, p = pos & ((1 << shift) - 1);
      const int block = (pos >> shift) - (k0 >> shift);
      if (block != held) {
        const unsigned char* k_par = raw + kKPar + block * 4 * kD + c * 16;
        k_scale = *reinterpret_cast<const uint4*>(k_par);
        k_zero = *reinterpret_cast<const uint4*>(k_par + 2 * kD);
        held = block;
      }
      dequant8<scalar_t>(*reinterpret_cast<const unsigned*>(raw + key * kNib + c * 4),
                         reinterpret_cast<const __half*>(&k_scale),
                         reinterpret_cast<const __half*>(&k_zero), 1, k_dst);
      // the key's V params start at the half (p * heads + kvh) * kN of the words copied
      const int half = kN == 1 ? (p * heads + kvh) & 1 : 0;
      const __half* v_par = reinterpret_cast<const __half*>(raw + kVPar + key * 2 * kVWords * 4) +
                            half + c * 8 / kGroup;
      dequant8<scalar_t>(*reinterpret_cast<const unsigned*>(raw + kVNib + key * kNib + c * 4),
                         v_par, v_par + 2 * kVWords, 0, v_dst);
    }
  }
};
