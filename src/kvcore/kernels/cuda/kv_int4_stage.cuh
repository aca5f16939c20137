// Int4 KV tiles for the register-tile attention kernels (the byte layout is kvcore.cache.int4's):
// a key of a sealed block moves as its packed nibbles (head_dim / 2 bytes of K and of V), its
// value scales and zeros, and once per block and tile the per-channel key scales and zeros; a key
// of a block still in the fp16 window moves as its fp16 rows. All by cp.async, so the next tile's
// copies stay in flight while the current tile is computed.
//
// `stage` looks the tile's blocks up once per block (block table and window slot, into the raw
// buffer's block records, one barrier), then puts window rows (zeros past the span) into the
// kernel's 16-bit K/V tile rows and the packed parts of sealed keys into the raw buffer. The codes
// become 16-bit values with the fp16-bias trick: a nibble q OR-ed into 0x6400 (1024.0 in fp16,
// whose last 10 mantissa bits count units) is 1024 + q exactly, so one LOP3 makes two codes into
// an f16x2 pair, one sub.f16x2 removes the bias, one fma.f16x2 applies scale and zero (bf16
// activations: the same codes, scale and zero in fp32, rounded once). Two consumers:
// - decode (paged_attention_decode_tc.cu): `k_frag_*` / `v_frag_*` build mma.sync B fragments
//   straight from the nibbles in registers (a sealed key is never written back as 16-bit rows);
// - prefill (paged_attention_prefill_mma.cu): `dequant` unpacks each sealed key once per tile
//   into the 16-bit tile (8 warps share every key there: unpacking per warp would do it 8 times),
//   then the 16-bit fragment loads (ldmatrix) run.
// KVC_BREAK_NIBBLE (a test mutant) pairs the wrong nibbles. KVC_INT4_PROBE_SEALED compiles the
// kernels as if every block were sealed: the traffic model counts the instructions of the
// common tile from it (kvcore.kernels.cuda.dev.traffic_model); it is never launched.
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

// 1024 + the codes at bits 0-3 and 16-19 of x as an f16x2 pair (one LOP3).
__device__ __forceinline__ unsigned nibbles_1024(unsigned x) {
  return (x & 0x000F000Fu) | 0x64006400u;
}
// The shift that brings nibble pair m of a code word to bits 0-3 / 16-19.
__device__ __forceinline__ int nibble_shift(int m) {
#ifdef KVC_BREAK_NIBBLE
  return 4 * (m ^ 1);
#else
  return 4 * m;
#endif
}

// (q.lo s.lo + z.lo, q.hi s.hi + z.hi) as two activation values: q1024 from nibbles_1024, s2 and
// z2 fp16 pairs.
template <typename scalar_t>
__device__ __forceinline__ unsigned dequant2(unsigned q1024, unsigned s2, unsigned z2);
template <>
__device__ __forceinline__ unsigned dequant2<__half>(unsigned q1024, unsigned s2, unsigned z2) {
  return hfma2_bits(hsub2_bits(q1024, 0x64006400u), s2, z2);
}
__device__ __forceinline__ float half_lo(unsigned x) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(x & 0xffffu)));
}
__device__ __forceinline__ float half_hi(unsigned x) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(x >> 16)));
}
template <>
__device__ __forceinline__ unsigned dequant2<__nv_bfloat16>(unsigned q1024, unsigned s2,
                                                            unsigned z2) {
  // s q is exact in fp32 (11 x 4 bits): the fma rounds once, as the reference's z + s q
  const float lo = fmaf(half_lo(s2), (float)(q1024 & 0xFu), half_lo(z2));
  const float hi = fmaf(half_hi(s2), (float)((q1024 >> 16) & 0xFu), half_hi(z2));
  return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
         ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}
template <typename T> struct IsHalf { static constexpr bool kValue = false; };
template <> struct IsHalf<__half> { static constexpr bool kValue = true; };
// An fp16 pair of a window row as two activation values.
template <typename scalar_t>
__device__ __forceinline__ unsigned window2(unsigned h2) {
  return h2;
}
template <>
__device__ __forceinline__ unsigned window2<__nv_bfloat16>(unsigned h2) {
  return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(half_lo(h2))) |
         ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(half_hi(h2))) << 16);
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
  // K params (kMaxBlocks, 2, kD halves), block records (kMaxBlocks, BlockRecord: 24 bytes)
  static constexpr int kVNib = kKeys * kNib;
  static constexpr int kVPar = 2 * kKeys * kNib;
  static constexpr int kKPar = kVPar + kKeys * 2 * kVWords * 4;
  static constexpr int kMeta = kKPar + kMaxBlocks * 2 * kD * 2;
  static constexpr int kBytes = (kMeta + kMaxBlocks * 24 + 15) / 16 * 16;
  static_assert(kGroup % 16 == 0 && kD % kGroup == 0,
                "value groups of whole 16-channel steps (a group of 8 would need more copies "
                "per key than a row has chunks)");
  static_assert(kNib % 16 == 0 && kChunks >= kNib / 16 + 2 * kVWords,
                "a key's packed copies fit in its chunk items");
  static_assert(kThreads % kChunks == 0, "a thread unpacks one chunk of every key it takes");

  Int4Cache cache;
  int heads, shift, kvh;

  __device__ Int4Tile(const Int4Cache& c, int num_kv_heads, int block_shift, int head)
      : cache(c), heads(num_kv_heads), shift(block_shift), kvh(head) {}
  // a block row's layout (recomputed where used: registers matter more than the arithmetic)
  __device__ __forceinline__ int split() const { return (heads << shift) * kNib; }  // codes
  __device__ __forceinline__ int v_zero() const { return 2 * (heads << shift) * kN; }
  __device__ __forceinline__ long long k_row_bytes() const {
    return split() + 4ll * heads * kD;
  }
  __device__ __forceinline__ long long v_row_bytes() const { return split() + 2ll * v_zero(); }

  // Block record bi of the tile in `raw`: where its K and V bytes start (sealed: the block's
  // rows; window: its slot's rows of this KV head) and its kind (0: past the span, 1: window,
  // 2: sealed), written once per block by `stage`.
  struct BlockRecord {
    const unsigned char* k;
    const unsigned char* v;
    long long kind;
  };
  __device__ __forceinline__ static const BlockRecord& record(const unsigned char* raw, int bi) {
    return reinterpret_cast<const BlockRecord*>(raw + kMeta)[bi];
  }
  // Whether block bi holds sealed codes in the raw buffer (a sealed block within the span:
  // all its keys staged, the ones past k_hi masked by the kernel).
  __device__ __forceinline__ static bool sealed_kind(const BlockRecord& rec) {
#ifdef KVC_INT4_PROBE_SEALED  // the traffic model's probe (never launched): all blocks sealed
    return true;
#else
    return rec.kind == 2;
#endif
  }
  __device__ __forceinline__ static bool sealed(const unsigned char* raw, int bi) {
    return sealed_kind(record(raw, bi));
  }

  // Keys [k0, k0 + kKeys) into the 16-bit tiles k_s / v_s (window rows; zeros at or past k_hi)
  // and the raw buffer (sealed keys). Every thread calls it (a barrier publishes the block
  // records); the buffer must no longer be read. Loops run whole rounds of kThreads items, so
  // they unroll into straight code.
  __device__ __forceinline__ void stage(unsigned char* k_s, unsigned char* v_s,
                                        unsigned char* raw, const int* table, int k0, int k_hi,
                                        int tid) const {
    const int b0 = k0 >> shift, k_end = min(k0 + kKeys, k_hi);
    if (tid < kMaxBlocks) {  // once per block: its table entry and window slot
      BlockRecord rec = {nullptr, nullptr, 0};
      if ((b0 + tid) << shift < k_end) {
        const int block = table[b0 + tid], window = cache.window_slot[block];
        if (window >= 0) {
          const long long row = (((long long)window << shift) * heads + kvh) * kD;
          rec = {reinterpret_cast<const unsigned char*>(cache.k_window + row),
                 reinterpret_cast<const unsigned char*>(cache.v_window + row), 1};
        } else {
          rec = {cache.k_rows + block * k_row_bytes(), cache.v_rows + block * v_row_bytes(), 2};
        }
      }
      reinterpret_cast<BlockRecord*>(raw + kMeta)[tid] = rec;
    }
    __syncthreads();
    // sealed keys' codes: kNib / 16 chunks of K and of V per key
    constexpr int kCodeItems = kKeys * (kNib / 16);
#pragma unroll
    for (int round = 0; round < (kCodeItems + kThreads - 1) / kThreads; ++round) {
      const int i = tid + round * kThreads;
      if (kCodeItems % kThreads != 0 && i >= kCodeItems) break;
      const int key = i / (kNib / 16), c = i % (kNib / 16);
      const int pos = k0 + key, p = pos & ((1 << shift) - 1);
      const BlockRecord& rec = record(raw, (pos >> shift) - b0);
      if (sealed_kind(rec)) {
        const int at = (p * heads + kvh) * kNib + c * 16;
        cp_async16(raw + key * kNib + c * 16, rec.k + at);
        cp_async16(raw + kVNib + key * kNib + c * 16, rec.v + at);
      }
    }
    // sealed keys' V scales and zeros: 2 x kVWords 4-byte words per key
    constexpr int kParWords = kKeys * 2 * kVWords;
#pragma unroll
    for (int round = 0; round < (kParWords + kThreads - 1) / kThreads; ++round) {
      const int i = tid + round * kThreads;
      if (kParWords % kThreads != 0 && i >= kParWords) break;
      const int key = i / (2 * kVWords), w = i % (2 * kVWords), side = w / kVWords;
      const int pos = k0 + key, p = pos & ((1 << shift) - 1);
      const BlockRecord& rec = record(raw, (pos >> shift) - b0);
      if (sealed_kind(rec)) {
        const int at = split() + side * v_zero() + (((p * heads + kvh) * kN * 2) & ~3) +
                             (w % kVWords) * 4;
        cp_async4_zfill(raw + kVPar + (key * 2 + side) * kVWords * 4 + (w % kVWords) * 4,
                        rec.v + at, true);
      }
    }
    // the K scales and zeros of each sealed block the tile touches: 2 x kD halves
    constexpr int kParItems = kMaxBlocks * 2 * (kD / 8);
#pragma unroll
    for (int round = 0; round < (kParItems + kThreads - 1) / kThreads; ++round) {
      const int i = tid + round * kThreads;
      if (i >= kParItems) break;
      const int bi = i / (2 * (kD / 8)), c = i % (2 * (kD / 8));
      if (!sealed(raw, bi)) continue;
      const int side = c / (kD / 8);
      const int at = split() + (side * heads + kvh) * kD * 2 + (c % (kD / 8)) * 16;
      cp_async16(raw + kKPar + bi * 4 * kD + c * 16, record(raw, bi).k + at);
    }
    // window rows, and zeros past the span, into the 16-bit tiles: only for a tile that has
    // such blocks (the last ones of a sequence; a block-uniform test)
    bool any_window = false;
#pragma unroll
    for (int bi = 0; bi < kMaxBlocks; ++bi) any_window |= !sealed(raw, bi);
    if (!any_window) return;
#pragma unroll 1  // (rare: kept rolled, it would take registers from the common path)
    for (int round = 0; round < (kKeys * kChunks + kThreads - 1) / kThreads; ++round) {
      const int i = tid + round * kThreads;
      if (kKeys * kChunks % kThreads != 0 && i >= kKeys * kChunks) break;
      const int key = i / kChunks, c = i % kChunks;
      const int pos = k0 + key, p = pos & ((1 << shift) - 1);
      const BlockRecord& rec = record(raw, (pos >> shift) - b0);
      if (sealed_kind(rec)) continue;
      const bool valid = pos < k_hi;
      const int at = valid ? (p * heads * kD + c * 8) * 2 : 0;
      cp_async16_zfill(k_s + key * kPitch + c * 16, rec.k + at, valid);
      cp_async16_zfill(v_s + key * kPitch + c * 16, rec.v + at, valid);
    }
  }

  // A V scale (side 0) or zero (side 1) of tile key `key` at position `pos`, value group grp.
  __device__ __forceinline__ unsigned v_param(const unsigned char* raw, int key, int pos, int grp,
                                              int side) const {
    // the key's params start at the half (p * heads + kvh) * kN of the words copied
    const int p = pos & ((1 << shift) - 1);
    const int half = kN == 1 ? (p * heads + kvh) & 1 : 0;
    return reinterpret_cast<const unsigned short*>(raw + kVPar + key * 2 * kVWords * 4)
        [side * 2 * kVWords + half + grp];
  }

  // ---- decode: B fragments straight from the codes ---------------------------------------
  // Channel order of the decode fragments. K (S = Q K^T): lane t of 16-channel steps 2 c and
  // 2 c + 1 (c = 32-channel group) holds channels 32 c + 8 t + 2 i and + 1 (i = 0..3) in its
  // four B registers, so one 32-bit word of codes feeds them (Q's A fragments are loaded in the
  // same order: a dot product does not care). V (O += P V): n-tile 8 q + m, column g is channel
  // 64 q + 8 g + m, so lane g's word of codes covers its 8 n-tiles; the output columns are
  // permuted back when O is written (out_channel).

  // K fragments of the 8 keys at tile rows `key`.. (one block: k0 and key multiples of 8) for
  // the 32-channel group c: b[0..1] step 2 c, b[2..3] step 2 c + 1. Sealed: from the codes and
  // the block's params; window: the fp16 tile row as it is.
  template <typename scalar_t>
  __device__ __forceinline__ void k_frags(unsigned (&b)[4], const unsigned char* k_s,
                                          const unsigned char* raw, int key, int bi, bool is_sealed,
                                          int c, int g, int t) const {
    if (is_sealed) {
      const unsigned code = *reinterpret_cast<const unsigned*>(raw + (key + g) * kNib + 16 * c + 4 * t);
      const unsigned char* par = raw + kKPar + bi * 4 * kD + (32 * c + 8 * t) * 2;
      const uint4 s = *reinterpret_cast<const uint4*>(par);           // channels +0..7
      const uint4 z = *reinterpret_cast<const uint4*>(par + 2 * kD);
      const unsigned sw[4] = {s.x, s.y, s.z, s.w}, zw[4] = {z.x, z.y, z.z, z.w};
      unpack8<scalar_t>(b, code, sw, zw);
    } else {
      const uint4 h = *reinterpret_cast<const uint4*>(k_s + (key + g) * kPitch + (32 * c + 8 * t) * 2);
      b[0] = window2<scalar_t>(h.x);
      b[1] = window2<scalar_t>(h.y);
      b[2] = window2<scalar_t>(h.z);
      b[3] = window2<scalar_t>(h.w);
    }
  }

  // V fragment halves of keys `key` + 2 t and + 1 (one block) for the 64-channel group q:
  // r[m] pairs the two keys' channel 64 q + 8 g + m (n-tile 8 q + m); `pos` is `key`'s position.
  template <typename scalar_t>
  __device__ __forceinline__ void v_frags(unsigned (&r)[8], const unsigned char* v_s,
                                          const unsigned char* raw, int key, int pos,
                                          bool is_sealed, int q, int g, int t) const {
    const int ka = key + 2 * t;
    if (is_sealed) {
      const unsigned char* codes = raw + kVNib + 32 * q + 4 * g;
      const unsigned a = *reinterpret_cast<const unsigned*>(codes + ka * kNib);
      const unsigned b = *reinterpret_cast<const unsigned*>(codes + (ka + 1) * kNib);
      const int grp = (64 * q + 8 * g) / kGroup;
      const unsigned s2 = v_param(raw, ka, pos + 2 * t, grp, 0) |
                          (v_param(raw, ka + 1, pos + 2 * t + 1, grp, 0) << 16);
      const unsigned z2 = v_param(raw, ka, pos + 2 * t, grp, 1) |
                          (v_param(raw, ka + 1, pos + 2 * t + 1, grp, 1) << 16);
      const unsigned lo = prmt(a, b, 0x5410), hi = prmt(a, b, 0x7632);  // channels 0-3, 4-7
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        r[m] = dequant2<scalar_t>(nibbles_1024(lo >> nibble_shift(m)), s2, z2);
        r[m + 4] = dequant2<scalar_t>(nibbles_1024(hi >> nibble_shift(m)), s2, z2);
      }
    } else {
      const uint4 a = *reinterpret_cast<const uint4*>(v_s + ka * kPitch + (64 * q + 8 * g) * 2);
      const uint4 b = *reinterpret_cast<const uint4*>(v_s + (ka + 1) * kPitch + (64 * q + 8 * g) * 2);
      const unsigned wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        r[m] = window2<scalar_t>(prmt(wa[m / 2], wb[m / 2], m % 2 ? 0x7632 : 0x5410));
      }
    }
  }

  // S (16 rows x 8 kN keys from tile row `key`) += Q K^T, Q's fragments in k_frags' order;
  // tile0 the tile's first position (a multiple of 8: each 8-key group is one block).
  template <typename scalar_t, int kN>
  __device__ __forceinline__ void qk(float (&s)[kN][4], const unsigned (&q)[kD / 16][4],
                                     const unsigned char* k_s, const unsigned char* raw, int key,
                                     int tile0, int g, int t) const {
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const int bi = ((tile0 + key + 8 * j) >> shift) - (tile0 >> shift);
      const bool is_sealed = sealed(raw, bi);  // warp-uniform
#pragma unroll
      for (int c = 0; c < kD / 32; ++c) {
        unsigned b[4];
        k_frags<scalar_t>(b, k_s, raw, key + 8 * j, bi, is_sealed, c, g, t);
        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_m16n8k16<scalar_t>(s[j], q[2 * c], b0);
        mma_m16n8k16<scalar_t>(s[j], q[2 * c + 1], b1);
      }
    }
  }
  // O (16 rows x kD, columns in v_frags' order) += P V over the 16 keys from tile row `key`:
  // b[0] pairs keys + 2t, + 2t + 1, b[1] keys + 2t + 8, + 2t + 9 (each pair in one block).
  template <typename scalar_t>
  __device__ __forceinline__ void pv(float (&o)[kD / 8][4], const unsigned (&p)[4],
                                     const unsigned char* v_s, const unsigned char* raw, int key,
                                     int tile0, int g, int t) const {
    const int bi0 = ((tile0 + key) >> shift) - (tile0 >> shift);
    const int bi1 = ((tile0 + key + 8) >> shift) - (tile0 >> shift);
    const bool sealed0 = sealed(raw, bi0), sealed1 = sealed(raw, bi1);
#pragma unroll
    for (int q = 0; q < kD / 64; ++q) {
      unsigned r0[8], r1[8];
      v_frags<scalar_t>(r0, v_s, raw, key, tile0 + key, sealed0, q, g, t);
      v_frags<scalar_t>(r1, v_s, raw, key + 8, tile0 + key + 8, sealed1, q, g, t);
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const unsigned vf[2] = {r0[m], r1[m]};
        mma_m16n8k16<scalar_t>(o[8 * q + m], p, vf);
      }
    }
  }

  // ---- prefill: each sealed key unpacked once per tile into the 16-bit tiles --------------
  // After the tile's copies landed (wait + barrier): the sealed keys' rows of k_s / v_s as
  // activations; with bf16 activations, the window rows converted in place. Each (key, chunk)
  // item is read and written by one thread (its chunk c is the same for all its keys).
  template <typename scalar_t>
  __device__ __forceinline__ void dequant(unsigned char* k_s, unsigned char* v_s,
                                          const unsigned char* raw, int k0, int tid) const {
    const int c = tid % kChunks;
    static_assert(kKeys * kChunks % kThreads == 0, "whole rounds of (key, chunk) items");
#pragma unroll 1  // a rolled loop of kKeys * kChunks / kThreads rounds: unrolled, prefill spills
    for (int round = 0; round < kKeys * kChunks / kThreads; ++round) {
      const int key = (tid + round * kThreads) / kChunks, pos = k0 + key;
      const int bi = (pos >> shift) - (k0 >> shift);
      unsigned char* k_dst = k_s + key * kPitch + c * 16;
      unsigned char* v_dst = v_s + key * kPitch + c * 16;
      if (!sealed(raw, bi)) {
        if constexpr (!IsHalf<scalar_t>::kValue) {  // bf16: the fp16 window rows converted
          uint4 kw = *reinterpret_cast<const uint4*>(k_dst), vw = *reinterpret_cast<const uint4*>(v_dst);
          kw = {window2<scalar_t>(kw.x), window2<scalar_t>(kw.y), window2<scalar_t>(kw.z), window2<scalar_t>(kw.w)};
          vw = {window2<scalar_t>(vw.x), window2<scalar_t>(vw.y), window2<scalar_t>(vw.z), window2<scalar_t>(vw.w)};
          *reinterpret_cast<uint4*>(k_dst) = kw;
          *reinterpret_cast<uint4*>(v_dst) = vw;
        }
        continue;
      }
      const unsigned char* k_par = raw + kKPar + bi * 4 * kD + c * 16;  // its 8 channels
      const uint4 k_sc = *reinterpret_cast<const uint4*>(k_par);
      const uint4 k_ze = *reinterpret_cast<const uint4*>(k_par + 2 * kD);
      const unsigned ks[4] = {k_sc.x, k_sc.y, k_sc.z, k_sc.w}, kz[4] = {k_ze.x, k_ze.y, k_ze.z, k_ze.w};
      const int grp = c * 8 / kGroup;
      const unsigned vs = v_param(raw, key, pos, grp, 0), vz = v_param(raw, key, pos, grp, 1);
      unsigned kout[4], vout[4];
      unpack8<scalar_t>(kout, *reinterpret_cast<const unsigned*>(raw + key * kNib + c * 4), ks, kz);
      const unsigned vs2[4] = {vs | vs << 16, vs | vs << 16, vs | vs << 16, vs | vs << 16};
      const unsigned vz2[4] = {vz | vz << 16, vz | vz << 16, vz | vz << 16, vz | vz << 16};
      unpack8<scalar_t>(vout, *reinterpret_cast<const unsigned*>(raw + kVNib + key * kNib + c * 4), vs2, vz2);
      *reinterpret_cast<uint4*>(k_dst) = make_uint4(kout[0], kout[1], kout[2], kout[3]);
      *reinterpret_cast<uint4*>(v_dst) = make_uint4(vout[0], vout[1], vout[2], vout[3]);
    }
  }

  // Eight codes (channel e at bits 4 e of `code`) as four pairs of activations in channel
  // order, scales and zeros as fp16 pairs (s[i], z[i] for channels 2 i, 2 i + 1).
  template <typename scalar_t>
  __device__ __forceinline__ static void unpack8(unsigned (&out)[4], unsigned code,
                                                 const unsigned (&s)[4], const unsigned (&z)[4]) {
    const unsigned even = code & 0x0F0F0F0Fu, odd = (code >> 4) & 0x0F0F0F0Fu;  // 0 2 4 6, 1 3 5 7
#ifdef KVC_BREAK_NIBBLE
    const unsigned lo = prmt(odd, even, 0x5410), hi = prmt(odd, even, 0x7632);
#else
    const unsigned lo = prmt(even, odd, 0x5410), hi = prmt(even, odd, 0x7632);  // 0 2 1 3, 4 6 5 7
#endif
    out[0] = dequant2<scalar_t>(nibbles_1024(lo), s[0], z[0]);
    out[1] = dequant2<scalar_t>(nibbles_1024(lo >> 8), s[1], z[1]);
    out[2] = dequant2<scalar_t>(nibbles_1024(hi), s[2], z[2]);
    out[3] = dequant2<scalar_t>(nibbles_1024(hi >> 8), s[3], z[3]);
  }
};
