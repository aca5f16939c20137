// Stand-in for CUDA's crt/host_defines.h (shipped with nvcc, not with the runtime wheel's headers)
// so that NVIDIA's cuda_fp16.h / cuda_bf16.h / cuda_fp8.h compile unchanged under g++ for the CPU
// emulation harness. Execution-space qualifiers vanish; __shared__ becomes thread_local, which at
// block scope has static storage: all fibers of a block run on one OS thread and blocks run one
// after another, so one instance per worker thread is exactly one per running block.
#pragma once
#ifndef __HOST_DEFINES_H__
#define __HOST_DEFINES_H__
#define __host__
#define __device__
#define __global__
#define __shared__ thread_local
#define __constant__
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __inline__ inline
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(a) __align__(a)
#define __thread__ __thread
#define __restrict__ __restrict
#define __device_builtin__
#define __device_builtin_texture_type__
#define __device_builtin_surface_type__
#define __cudart_builtin__
#define __location__(a)
#define __launch_bounds__(...)
#define __grid_constant__
#define __no_return__ __attribute__((noreturn))
#define __import__
#define __export__
#define __cdecl
#define __specialization_static
#define __annotate__(a)
#define __nv_pure__
#define CUDARTAPI
#endif
