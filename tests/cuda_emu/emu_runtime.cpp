// Fiber scheduler of the CUDA emulation harness: runs a grid block after block, each block's
// threads as ucontext fibers. Within a block it runs one warp at a time up to the next
// __syncthreads (the order of warps, and of lanes inside a warp, is a permutation drawn from the
// launch's seed; seed 0 keeps the natural order), so a missing barrier lets one warp read shared
// memory that another warp has not written yet. Warp collectives are rendezvous of their mask.
// cp.async copies are kept per thread until a wait_group completes them (see ptx_ops.cuh).
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <random>
#include <string>
#include <vector>

#include "cuda_emu.h"

uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;

// Defined by the generated per-source unit: the extern __shared__ arrays of the source.
extern "C" int emu_num_dynamic_smem();
extern "C" unsigned char* emu_dynamic_smem(int i);
extern "C" unsigned long emu_dynamic_smem_capacity();

namespace {

enum State { kRunnable, kAtBarrier, kAtWarp, kExited, kFailed };

// One cp.async in flight: the source bytes as read at issue, and its group (-1: not committed).
struct AsyncCopy {
  unsigned char* dst;
  unsigned char data[16];
  int bytes;
  long group;
};

struct Fiber {
  ucontext_t ctx;
  uint3 tid;
  int lane = 0;
  int warp = 0;
  State state = kRunnable;
  int kind = 0;  // collective waited on
  unsigned mask = 0;
  unsigned char value[16];
  int size = 0;
  int src_lane = 0;
  void* out = nullptr;
  std::vector<AsyncCopy> copies;  // this thread's cp.async copies not yet completed
  long groups = 0;                // cp.async groups committed so far
};

constexpr size_t kStackSize = 256 * 1024;
std::vector<Fiber> fibers;
// fiber stacks: malloc'd, never zero-filled (large blocks are mapped lazily), grown on demand
char* stacks = nullptr;
size_t stacks_size = 0;
ucontext_t scheduler;
Fiber* current = nullptr;
void (*kernel_tramp)(void**) = nullptr;
void** kernel_args = nullptr;
std::string error;
unsigned long launch_shared_mem = 0;  // the dynamic shared memory the launch asked for

void switch_to_scheduler() { swapcontext(&current->ctx, &scheduler); }

void fiber_main() {
  kernel_tramp(kernel_args);
  if (!current->copies.empty()) {
    emu::fail("a thread exited with cp.async copies it never waited for (cp.async.wait_group)");
  }
  current->state = kExited;
  switch_to_scheduler();
}

bool resume(Fiber& f) {
  current = &f;
  threadIdx = f.tid;
  swapcontext(&scheduler, &f.ctx);
  return error.empty();
}

Fiber* lane_fiber(int warp, int lane) {
  const size_t i = static_cast<size_t>(warp) * 32 + lane;
  return i < fibers.size() ? &fibers[i] : nullptr;
}

// Completes the collective that lane `lane` of `warp` waits on when all lanes of its mask have
// arrived at the same kind of collective with the same mask. Returns true when it completed one.
bool try_complete(int warp, int lane) {
  Fiber& f = *lane_fiber(warp, lane);
  for (int i = 0; i < 32; ++i) {
    if (!(f.mask >> i & 1u)) continue;
    Fiber* g = lane_fiber(warp, i);
    if (g == nullptr || g->state == kExited) {
      error = "warp collective mask names lane " + std::to_string(i) + " of warp " +
              std::to_string(warp) + ", which does not exist or has exited";
      return false;
    }
    if (g->state != kAtWarp) return false;
    if (g->kind != f.kind || g->mask != f.mask) {
      error = "lanes of warp " + std::to_string(warp) + " wait on different warp collectives";
      return false;
    }
  }
  unsigned vote = 0;
  for (int i = 0; i < 32; ++i) {
    if (f.mask >> i & 1u) vote |= (*reinterpret_cast<int*>(lane_fiber(warp, i)->value) ? 1u : 0u) << i;
  }
  for (int i = 0; i < 32; ++i) {
    if (!(f.mask >> i & 1u)) continue;
    Fiber& g = *lane_fiber(warp, i);
    if (g.kind == emu::kShuffle) {
      // a source lane outside the mask yields the caller's own value (undefined on hardware)
      const bool in_mask = g.src_lane >= 0 && g.src_lane < 32 && (f.mask >> g.src_lane & 1u);
      memcpy(g.out, in_mask ? lane_fiber(warp, g.src_lane)->value : g.value, g.size);
    } else if (g.kind == emu::kBallot) {
      memcpy(g.out, &vote, sizeof vote);
    } else if (g.kind >= emu::kLdmatrix) {
      // PTX ISA 9.7.14.5.15: lane l receives, from matrix m (rows addressed by lanes 8 m ..
      // 8 m + 7), row l / 4 elements 2 (l % 4) and 2 (l % 4) + 1, or with .trans column l / 4
      // of rows 2 (l % 4) and 2 (l % 4) + 1; the lower-indexed element in the low half
      const int num = (g.kind - emu::kLdmatrix) / 2;
      const bool trans = (g.kind - emu::kLdmatrix) % 2 != 0;
      unsigned* out = static_cast<unsigned*>(g.out);
      for (int m = 0; m < num; ++m) {
        uint16_t e[2];
        for (int k = 0; k < 2; ++k) {
          const int row = trans ? 2 * (i % 4) + k : i / 4, col = trans ? i / 4 : 2 * (i % 4) + k;
          const unsigned char* p;
          memcpy(&p, lane_fiber(warp, 8 * m + row)->value, sizeof p);
          memcpy(&e[k], p + 2 * col, 2);
        }
        out[m] = e[0] | static_cast<unsigned>(e[1]) << 16;
      }
    }
    g.state = kRunnable;
  }
  return true;
}

// Runs warp `warp` until all its lanes wait at the block barrier or have exited.
bool run_warp(int warp, std::mt19937& rng, bool shuffle_order) {
  int lanes[32];
  int n = 0;
  for (int i = 0; i < 32 && lane_fiber(warp, i) != nullptr; ++i) lanes[n++] = i;
  for (;;) {
    if (shuffle_order) std::shuffle(lanes, lanes + n, rng);
    for (int k = 0; k < n; ++k) {
      Fiber& f = *lane_fiber(warp, lanes[k]);
      if (f.state == kRunnable && !resume(f)) return false;
    }
    bool completed = false;
    for (int k = 0; k < n && !completed; ++k) {
      if (lane_fiber(warp, lanes[k])->state == kAtWarp) completed = try_complete(warp, lanes[k]);
      if (!error.empty()) return false;
    }
    if (!completed) break;
  }
  for (int k = 0; k < n; ++k) {
    if (lane_fiber(warp, lanes[k])->state == kAtWarp) {
      error = "warp " + std::to_string(warp) + " deadlocked: lanes wait on a warp collective that "
              "other lanes of its mask never reach (they wait at __syncthreads or exited)";
      return false;
    }
  }
  return true;
}

bool run_block(unsigned long long seed) {
  const int num_threads = static_cast<int>(fibers.size());
  const int num_warps = (num_threads + 31) / 32;
  for (int d = 0; d < emu_num_dynamic_smem(); ++d) {
    // uninitialized shared memory reads as NaN (0xff bytes) in every float type
    memset(emu_dynamic_smem(d), 0xff, emu_dynamic_smem_capacity());
  }
  for (int i = 0; i < num_threads; ++i) {
    Fiber& f = fibers[i];
    f.tid = {static_cast<unsigned>(i % blockDim.x), static_cast<unsigned>(i / blockDim.x % blockDim.y),
             static_cast<unsigned>(i / (blockDim.x * blockDim.y))};
    f.lane = i % 32;
    f.warp = i / 32;
    f.state = kRunnable;
    f.copies.clear();
    f.groups = 0;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks + static_cast<size_t>(i) * kStackSize;
    f.ctx.uc_stack.ss_size = kStackSize;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
  }
  const unsigned long long block_id =
      blockIdx.x + static_cast<unsigned long long>(gridDim.x) * (blockIdx.y + gridDim.y * blockIdx.z);
  std::mt19937 rng(static_cast<unsigned>(seed * 1000003ull + block_id));
  std::vector<int> order(num_warps);
  for (;;) {
    for (int w = 0; w < num_warps; ++w) order[w] = w;
    if (seed != 0) std::shuffle(order.begin(), order.end(), rng);
    for (int w : order) {
      if (!run_warp(w, rng, seed != 0)) return false;
    }
    int live = 0;
    for (Fiber& f : fibers) live += f.state != kExited;
    if (live == 0) return true;
    for (Fiber& f : fibers) {
      if (f.state == kAtBarrier) f.state = kRunnable;
    }
  }
}

}  // namespace

namespace emu {

void warp_collective(int kind, unsigned mask, const void* value, int size, int src_lane, void* out) {
  if (!(mask >> current->lane & 1u)) fail("a warp collective's mask must include the calling lane");
  current->kind = kind;
  current->mask = mask;
  current->size = size;
  if (size > 0) memcpy(current->value, value, size);
  current->src_lane = src_lane;
  current->out = out;
  current->state = kAtWarp;
  switch_to_scheduler();
}

void syncthreads() {
  current->state = kAtBarrier;
  switch_to_scheduler();
}

unsigned active_mask() {
  unsigned mask = 0;
  for (int i = 0; i < 32; ++i) {
    Fiber* f = lane_fiber(current->warp, i);
    if (f != nullptr && f->state != kExited) mask |= 1u << i;
  }
  return mask;
}

int lane_id() { return current->lane; }

void ldmatrix(unsigned* out, const void* row, int num, bool trans) {
  if (current->lane < 8 * num) {  // the lanes whose addresses the form reads
    const uintptr_t a = reinterpret_cast<uintptr_t>(row);
    if (a % 16) fail("ldmatrix: a row address must be 16-byte aligned");
    bool inside = false;
    for (int d = 0; d < emu_num_dynamic_smem(); ++d) {
      const uintptr_t base = reinterpret_cast<uintptr_t>(emu_dynamic_smem(d));
      inside |= a >= base && a + 16 <= base + launch_shared_mem;
    }
    if (!inside) fail("ldmatrix: a row address outside the launch's dynamic shared memory");
  }
  // .sync.aligned: every lane of the warp, the same form (a different form is another kind)
  warp_collective(kLdmatrix + 2 * num + (trans ? 1 : 0), 0xffffffffu, &row, sizeof row, 0, out);
}

void cp_async(void* dst, const void* src, int bytes) {
  // src null: the zero-fill form (src-size 0), nothing is read
  if (reinterpret_cast<uintptr_t>(dst) % bytes || reinterpret_cast<uintptr_t>(src) % bytes) {
    fail("cp.async: source and destination must be aligned to the copy size");
  }
  AsyncCopy copy{static_cast<unsigned char*>(dst), {}, bytes, -1};
  if (src != nullptr) memcpy(copy.data, src, bytes);
  memset(dst, 0xff, bytes);  // not arrived yet: reads as NaN until a wait completes the copy
  current->copies.push_back(copy);
}

void cp_async_commit() {
  for (AsyncCopy& c : current->copies) {
    if (c.group < 0) c.group = current->groups;
  }
  ++current->groups;  // an empty group is a group too, as in PTX
}

void cp_async_wait(int allowed_in_flight) {
  const long done_below = current->groups - allowed_in_flight;  // groups that must be complete
  std::vector<AsyncCopy> still;
  for (const AsyncCopy& c : current->copies) {
    if (c.group < 0 || c.group >= done_below) {
      still.push_back(c);
      continue;
    }
    for (int i = 0; i < c.bytes; ++i) {
      if (c.dst[i] != 0xff) fail("cp.async: its destination was written while the copy was in flight");
    }
    memcpy(c.dst, c.data, c.bytes);
  }
  current->copies.swap(still);
}

void fail(const char* message) {
  error = message;
  current->state = kFailed;
  switch_to_scheduler();
  abort();  // never resumed
}

}  // namespace emu

extern "C" __attribute__((visibility("default"))) int emu_launch(
    void (*tramp)(void**), void** args, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
    unsigned by, unsigned bz, unsigned long shared_mem, unsigned long smem_limit,
    unsigned long long seed, char* message, int message_len) {
  error.clear();
  const unsigned long threads = static_cast<unsigned long>(bx) * by * bz;
  if (threads == 0 || threads > 1024 || bz > 64 || gx == 0 || gy == 0 || gz == 0 || gy > 65535 ||
      gz > 65535) {
    error = "invalid launch configuration: grid (" + std::to_string(gx) + ", " +
            std::to_string(gy) + ", " + std::to_string(gz) + "), block (" + std::to_string(bx) +
            ", " + std::to_string(by) + ", " + std::to_string(bz) + ")";
  } else if (shared_mem > smem_limit) {
    error = "dynamic shared memory of " + std::to_string(shared_mem) + " bytes exceeds the " +
            std::to_string(smem_limit) + " the kernel may use (48 KiB unless it opted in)";
  } else if (shared_mem > 0 && emu_num_dynamic_smem() == 0) {
    error = "shared_mem requested but the source declares no extern __shared__ array";
  }
  if (error.empty()) {
    kernel_tramp = tramp;
    kernel_args = args;
    launch_shared_mem = shared_mem;
    gridDim = dim3(gx, gy, gz);
    blockDim = dim3(bx, by, bz);
    fibers.assign(threads, Fiber());
    if (stacks_size < threads * kStackSize) {
      free(stacks);
      stacks_size = threads * kStackSize;
      stacks = static_cast<char*>(malloc(stacks_size));
    }
    for (unsigned z = 0; z < gz && error.empty(); ++z) {
      for (unsigned y = 0; y < gy && error.empty(); ++y) {
        for (unsigned x = 0; x < gx && error.empty(); ++x) {
          blockIdx = {x, y, z};
          if (!run_block(seed)) {
            error = "block (" + std::to_string(x) + ", " + std::to_string(y) + ", " +
                    std::to_string(z) + "): " + error;
          }
        }
      }
    }
  }
  snprintf(message, message_len, "%s", error.c_str());
  return error.empty() ? 0 : 1;
}
