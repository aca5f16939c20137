// Inline-PTX wrappers of the sm_80+ instructions the register-tile kernels use: mma.sync
// m16n8k16 (fp16 / bf16 inputs, fp32 accumulate) and cp.async 16-byte copies grouped by
// commit_group / wait_group. Kernels include it as <ptx_ops.cuh> (the kernel directory is on the
// include path), so a CPU emulation of the kernels can put its own model of the instructions
// first on the path, as for <mma.h>.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// g = lane >> 2 and t = lane % 4, two 16-bit elements per .b32 register, the lower one first:
//   A (16 x 16): a[0] = (g, 2t..2t+1), a[1] = (g + 8, 2t..2t+1), a[2] = (g, 2t+8..2t+9),
//                a[3] = (g + 8, 2t+8..2t+9)
//   B (16 x 8):  b[0] = (rows 2t, 2t+1; col g), b[1] = (rows 2t+8, 2t+9; col g)
//   C / D (16 x 8, fp32): c[0], c[1] = (g, 2t), (g, 2t+1); c[2], c[3] = (g + 8, 2t), (g + 8, 2t+1)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// acc (16 x 8) += A (16 x 16) B (16 x 8), fp32 accumulation; every lane of the warp calls it.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&acc)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2]);
template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&acc)[4], const unsigned (&a)[4],
                                                     const unsigned (&b)[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&acc)[4],
                                                            const unsigned (&a)[4],
                                                            const unsigned (&b)[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 16 bytes global -> shared, asynchronously (both 16-byte aligned); the copy belongs to the next
// committed group and may be read only after a wait that covers its group and a barrier.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}
// The same, or 16 zero bytes (nothing read) when !valid: keys past the span need no branch.
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's most recent groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// 4 bytes global -> shared (cp.async.ca: the sizes below 16 bytes go through L1), or 4 zero
// bytes when !valid; both addresses 4-byte aligned. Grouped and waited for as cp_async16.
__device__ __forceinline__ void cp_async4_zfill(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 4 : 0) : "memory");
}

// ldmatrix (PTX ISA 9.7.14.5.15, "Warp-level matrix load instruction: ldmatrix"), .m8n8 .b16:
// x4 loads four 8 x 8 matrices of 16-bit elements (x2: two) from shared memory, every lane of the
// warp taking part. Lanes 8 m .. 8 m + 7 give the addresses of rows 0..7 of matrix m (16 bytes
// each, 16-byte aligned); register m of lane l receives row l / 4, elements 2 (l % 4) and
// 2 (l % 4) + 1 of matrix m (the lower one in the low half): an mma.m16n8k16 A or B fragment
// register. With .trans it receives elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4): the
// fragment of the transposed matrix, so a B operand stored k-major (V: keys x channels) loads as
// its fragments directly.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* smem) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}

// 16-bit pair arithmetic and byte permutes for unpacking int4 codes into fragments (the emulation
// models them bit for bit where it can: fma in double, rounded once to fp16):
// fma.rn.f16x2 / sub.rn.f16x2 (PTX ISA 9.7.4, "Half Precision Floating-Point Instructions"): per
// 16-bit lane d = a * b + c (one rounding), d = a - b.
__device__ __forceinline__ unsigned hfma2_bits(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ unsigned hsub2_bits(unsigned a, unsigned b) {
  unsigned d;
  asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// prmt.b32 (PTX ISA 9.7.8.7, default mode): byte i of the result is byte (sel >> 4 i) & 7 of the
// eight bytes b:a (a's bytes 0-3, b's 4-7).
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
  return __byte_perm(a, b, sel);
}
