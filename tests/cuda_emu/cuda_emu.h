// CUDA emulation header: force-included (g++ -include cuda_emu.h) before an unchanged .cu source.
//
// Built-in indices are globals that the fiber scheduler (emu_runtime.cpp) switches with the
// running thread; barriers, warp shuffles, votes and __syncwarp hand control back to the scheduler,
// which runs one warp at a time up to each barrier and makes every warp collective a rendezvous
// of the lanes in its mask. Atomics are plain read-modify-writes: fibers never preempt each other.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "crt/host_defines.h"
#include <vector_types.h>

extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;
constexpr int warpSize = 32;

using std::max;
using std::min;

namespace emu {
// kLdmatrix + 2 num + trans: the ldmatrix forms (a lane's 16-byte value holds its row address)
enum Collective : int { kSyncWarp = 1, kShuffle = 2, kBallot = 3, kLdmatrix = 16 };
// Runs the calling lane's part of a warp collective: deposits `size` bytes of `value` and the
// lane it reads from, waits for every lane of `mask`, then copies the source lane's deposit to
// `out`. For kBallot `value` is an int predicate and `out` receives the 32-bit vote.
void warp_collective(int kind, unsigned mask, const void* value, int size, int src_lane, void* out);
void syncthreads();
unsigned active_mask();
int lane_id();
[[noreturn]] void fail(const char* message);

template <typename T>
T shuffle(unsigned mask, T var, int src_lane) {
  static_assert(sizeof(T) <= 16, "emulated shuffles move at most 16 bytes");
  T out;
  warp_collective(kShuffle, mask, &var, sizeof(T), src_lane, &out);
  return out;
}
}  // namespace emu

inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::warp_collective(emu::kSyncWarp, mask, nullptr, 0, 0, nullptr);
}
inline void __threadfence() {}
inline void __threadfence_block() {}
inline unsigned __activemask() { return emu::active_mask(); }

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  const int lane = emu::lane_id();
  return emu::shuffle(mask, var, (lane / width) * width + src_lane % width);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  const int lane = emu::lane_id();
  const int src = lane ^ lane_mask;
  return emu::shuffle(mask, var, src / width == lane / width ? src : lane);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  const int lane = emu::lane_id();
  const int src = lane + static_cast<int>(delta);
  return emu::shuffle(mask, var, src / width == lane / width ? src : lane);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  const int lane = emu::lane_id();
  const int src = lane - static_cast<int>(delta);
  return emu::shuffle(mask, var, src >= 0 && src / width == lane / width ? src : lane);
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  unsigned vote = 0;
  const int pred = predicate != 0;
  emu::warp_collective(emu::kBallot, mask, &pred, sizeof(int), 0, &vote);
  return vote;
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) {
  return __ballot_sync(mask, predicate) == (mask & __activemask());
}

template <typename T>
T emu_atomic_add(T* address, T val) {
  const T old = *address;
  *address = old + val;
  return old;
}
inline int atomicAdd(int* a, int v) { return emu_atomic_add(a, v); }
inline unsigned atomicAdd(unsigned* a, unsigned v) { return emu_atomic_add(a, v); }
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
  return emu_atomic_add(a, v);
}
inline float atomicAdd(float* a, float v) { return emu_atomic_add(a, v); }
inline double atomicAdd(double* a, double v) { return emu_atomic_add(a, v); }
inline int atomicSub(int* a, int v) { return emu_atomic_add(a, -v); }
template <typename T>
T atomicMax(T* a, T v) {
  const T old = *a;
  *a = old > v ? old : v;
  return old;
}
template <typename T>
T atomicMin(T* a, T v) {
  const T old = *a;
  *a = old < v ? old : v;
  return old;
}
template <typename T>
T atomicExch(T* a, T v) {
  const T old = *a;
  *a = v;
  return old;
}
template <typename T>
T atomicCAS(T* a, T compare, T v) {
  const T old = *a;
  if (old == compare) *a = v;
  return old;
}

template <typename T>
T __ldg(const T* p) { return *p; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float __fmul_rn(float x, float y) { return x * y; }  // IEEE, never contracted
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __int_as_float(int x) { float f; memcpy(&f, &x, sizeof f); return f; }
inline float __uint_as_float(unsigned x) { float f; memcpy(&f, &x, sizeof f); return f; }
inline int __float_as_int(float f) { int x; memcpy(&x, &f, sizeof x); return x; }
inline unsigned __float_as_uint(float f) { unsigned x; memcpy(&x, &f, sizeof x); return x; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }

// Trampolines: the launcher calls kernels through `void (*)(void** args)` like cuLaunchKernel.
namespace emu {
template <typename... A, size_t... I>
void invoke_impl(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}
template <typename... A>
void invoke(void (*kernel)(A...), void** args) {
  invoke_impl(kernel, args, std::index_sequence_for<A...>{});
}
// One character per parameter, checked by the Python launcher against the arguments it passes.
template <typename T>
constexpr char type_code() {
  if constexpr (std::is_pointer_v<T>) return 'P';
  else if constexpr (std::is_same_v<T, bool>) return '?';
  else if constexpr (std::is_same_v<T, float>) return 'f';
  else if constexpr (std::is_same_v<T, double>) return 'd';
  else if constexpr (std::is_integral_v<T> && sizeof(T) == 4) return std::is_signed_v<T> ? 'i' : 'I';
  else if constexpr (std::is_integral_v<T> && sizeof(T) == 8) return std::is_signed_v<T> ? 'q' : 'Q';
  else return 'x';
}
template <typename... A>
const char* signature(void (*)(A...)) {
  static const char codes[] = {type_code<std::decay_t<A>>()..., '\0'};
  return codes;
}
}  // namespace emu

#define EMU_KERNEL(name)                                                                        \
  extern "C" __attribute__((visibility("default"))) void emu_tramp_##name(void** args) {       \
    emu::invoke(name, args);                                                                    \
  }                                                                                             \
  extern "C" __attribute__((visibility("default"))) const char* emu_sig_##name() {            \
    return emu::signature(name);                                                                \
  }
