// A host emulation of the CUDA built-ins lossagg's kernels use, so that the kernel
// source in csrc/cuda/ runs unchanged on the CPU (under AddressSanitizer in CI).
//
// Every thread of a block is a fiber (ucontext) on one OS thread, scheduled
// cooperatively: a fiber runs until it reaches __syncthreads (a block barrier) or a
// warp shuffle (the 32 lanes of its warp meet), or returns. Exited threads count as
// arrived at a block barrier, as on the GPU; a shuffle with an exited lane, or a
// barrier that can never be passed, aborts with a message. Blocks run one at a time in
// the order the test chooses (in order, reversed, shuffled), so __shared__ memory can
// be a static of the kernel; so do the threads of a block between two meeting points
// (lanes in order, reversed, shuffled), so that stores of two lanes to one address with
// no __syncwarp/__syncthreads between them (a race on the GPU, where independent thread
// scheduling orders them in any way) give results that depend on the lane order.
// Include this before any kernel header.
#pragma once

#define LOSSAGG_CUDA_HOST_EMULATION 1
#ifndef LOSSAGG_MAX_GRID_Y  // the kernels' gridDim.y limit (segment_kernels.cuh)
#define LOSSAGG_MAX_GRID_Y 65535
#endif

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define LOSSAGG_HOST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LOSSAGG_HOST_ASAN 1
#endif
#endif
#ifdef LOSSAGG_HOST_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};

inline uint3 threadIdx{0, 0, 0};
inline uint3 blockIdx{0, 0, 0};
inline dim3 blockDim;
inline dim3 gridDim;

namespace cuda_host {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda_host: %s (block %u,%u thread %u)\n", what, blockIdx.x, blockIdx.y, threadIdx.x);
  std::abort();
}

enum class State { Ready, AtBarrier, AtWarp, Done };

// One fiber per thread slot, reused by every block of every launch: it is entered once
// through makecontext/setcontext, then switched with _setjmp/_longjmp (no system call
// per switch, which keeps thousands of emulated launches fast).
struct Fiber {
  jmp_buf jb;
  ucontext_t ctx;
  State state = State::Ready;
  bool started = false;
  std::vector<unsigned char> stack;
  void* fake_stack = nullptr;  // AddressSanitizer's bookkeeping while switched away
};

constexpr int kWarpSize = 32;
constexpr size_t kStackBytes = 128 * 1024;

// The block being run: its fibers, the scheduler's context and the kernel call.
struct Block {
  std::vector<Fiber> fibers;
  jmp_buf scheduler;
  unsigned current = 0;
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
  std::vector<uint64_t> warp_slots;  // one exchange slot per thread
  std::vector<unsigned> lane_order;  // the order the scheduler visits the threads in
  void* fake_stack = nullptr;
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
};

inline Block& block() {
  static Block b;
  return b;
}

// Switches from the running fiber back to the scheduler; returns when resumed.
inline void yield(State s) {
  Block& b = block();
  Fiber& f = b.fibers[b.current];
  f.state = s;
  if (!_setjmp(f.jb)) {
#ifdef LOSSAGG_HOST_ASAN
    __sanitizer_start_switch_fiber(&f.fake_stack, b.scheduler_stack_bottom, b.scheduler_stack_size);
#endif
    _longjmp(b.scheduler, 1);
  }
#ifdef LOSSAGG_HOST_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#endif
}

// A barrier among the lanes of the calling thread's warp.
inline void warp_sync() { yield(State::AtWarp); }

inline void fiber_main() {
  Block& b = block();
#ifdef LOSSAGG_HOST_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &b.scheduler_stack_bottom, &b.scheduler_stack_size);
#endif
  for (;;) {
    b.body(b.body_arg);
    yield(State::Done);
  }
}

}  // namespace cuda_host

inline void __syncthreads() { cuda_host::yield(cuda_host::State::AtBarrier); }

inline void __threadfence() {}

// A warp barrier with memory ordering among its lanes (the full mask only).
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) {
    cuda_host::fail("__syncwarp: only the full-warp mask is emulated");
  }
  cuda_host::warp_sync();
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  if (mask != 0xffffffffu) {
    cuda_host::fail("__shfl_xor_sync: only the full-warp mask is emulated");
  }
  auto& b = cuda_host::block();
  const unsigned tid = threadIdx.x;
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  b.warp_slots[tid] = bits;
  cuda_host::warp_sync();  // every lane has written
  const unsigned partner = (tid & ~unsigned(cuda_host::kWarpSize - 1)) | ((tid % cuda_host::kWarpSize) ^ unsigned(lane_mask));
  T out;
  std::memcpy(&out, &b.warp_slots[partner], sizeof(T));
  cuda_host::warp_sync();  // every lane has read before any overwrites
  return out;
}

inline unsigned int atomicAdd(unsigned int* address, unsigned int val) {
  const unsigned int old = *address;
  *address = old + val;
  return old;
}

template <typename T>
T __ldcg(const T* p) {
  return *p;
}

inline unsigned int __float_as_uint(float x) {
  unsigned int u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float __uint_as_float(unsigned int u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
inline long long __double_as_longlong(double x) {
  long long u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline double __longlong_as_double(long long u) {
  double x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

namespace cuda_host {

enum class BlockOrder { InOrder, Reversed, Shuffled };
// The order a block's ready threads run in between two meeting points.
enum class LaneOrder { InOrder, Reversed, Shuffled };

// Runs one block of `threads` threads to completion, each calling body(arg), visiting the
// ready threads in `lane_order` (a permutation of 0..threads-1; empty: in order).
inline void run_block(unsigned threads, void (*body)(void*), void* arg, const std::vector<unsigned>& lane_order = {}) {
  Block& b = block();
  if (b.fibers.size() < threads) {
    b.fibers.resize(threads);
  }
  b.body = body;
  b.body_arg = arg;
  b.warp_slots.assign(threads, 0);
  b.lane_order = lane_order;
  if (b.lane_order.size() != threads) {
    b.lane_order.resize(threads);
    std::iota(b.lane_order.begin(), b.lane_order.end(), 0u);
  }
  for (unsigned t = 0; t < threads; ++t) {
    b.fibers[t].state = State::Ready;
  }
  const unsigned warps = (threads + kWarpSize - 1) / kWarpSize;
  for (;;) {
    bool ran = false;
    for (unsigned t : b.lane_order) {
      Fiber& f = b.fibers[t];
      if (f.state != State::Ready) {
        continue;
      }
      ran = true;
      b.current = t;
      threadIdx = uint3{t, 0, 0};
      if (!_setjmp(b.scheduler)) {
        if (!f.started) {
          f.started = true;
          f.stack.resize(kStackBytes);
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.data();
          f.ctx.uc_stack.ss_size = kStackBytes;
          f.ctx.uc_link = nullptr;
          makecontext(&f.ctx, &fiber_main, 0);
#ifdef LOSSAGG_HOST_ASAN
          __sanitizer_start_switch_fiber(&b.fake_stack, f.stack.data(), kStackBytes);
#endif
          setcontext(&f.ctx);
        }
#ifdef LOSSAGG_HOST_ASAN
        __sanitizer_start_switch_fiber(&b.fake_stack, f.stack.data(), kStackBytes);
#endif
        _longjmp(f.jb, 1);
      }
#ifdef LOSSAGG_HOST_ASAN
      __sanitizer_finish_switch_fiber(b.fake_stack, nullptr, nullptr);
#endif
    }
    if (ran) {
      continue;
    }
    // Nobody can run: release a warp whose lanes all met, else the block barrier.
    bool released = false;
    unsigned done = 0;
    for (unsigned w = 0; w < warps; ++w) {
      const unsigned first = w * kWarpSize;
      const unsigned last = std::min(threads, first + kWarpSize);
      unsigned at_warp = 0, exited = 0;
      for (unsigned t = first; t < last; ++t) {
        at_warp += b.fibers[t].state == State::AtWarp;
        exited += b.fibers[t].state == State::Done;
      }
      done += exited;
      if (at_warp > 0 && at_warp + exited == last - first) {
        if (exited > 0) {
          threadIdx = uint3{first, 0, 0};
          fail("a warp shuffle with lanes that have exited");
        }
        for (unsigned t = first; t < last; ++t) {
          b.fibers[t].state = State::Ready;
        }
        released = true;
      }
    }
    if (released) {
      continue;
    }
    if (done == threads) {
      return;
    }
    unsigned at_barrier = 0;
    for (unsigned t = 0; t < threads; ++t) {
      at_barrier += b.fibers[t].state == State::AtBarrier;
    }
    if (at_barrier + done != threads) {
      fail("deadlock: threads wait at different barriers");
    }
    for (unsigned t = 0; t < threads; ++t) {
      if (b.fibers[t].state == State::AtBarrier) {
        b.fibers[t].state = State::Ready;
      }
    }
  }
}

// The Device of csrc/cuda/launch.cuh, on the host. Workspaces are filled with 0xFF bytes
// (NaN for floats) so that a kernel reading memory nobody wrote shows up in the results.
class HostDevice {
 public:
  explicit HostDevice(BlockOrder order = BlockOrder::InOrder, uint64_t seed = 0, LaneOrder lanes = LaneOrder::InOrder)
      : order_(order), lanes_(lanes), rng_(seed) {}
  HostDevice(const HostDevice&) = delete;
  HostDevice& operator=(const HostDevice&) = delete;

  void* workspace(int64_t bytes) {
    buffers_.emplace_back(static_cast<size_t>(std::max<int64_t>(bytes, 1)), static_cast<unsigned char>(0xFF));
    return buffers_.back().data();
  }

  void zero(void* p, size_t bytes) { std::memset(p, 0, bytes); }

  template <typename... KernelArgs, typename... Args>
  void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block_dim, Args... args) {
    ++launches;
    if (grid.x == 0 || grid.y == 0 || grid.y > static_cast<unsigned>(LOSSAGG_MAX_GRID_Y) || block_dim.x == 0 || block_dim.x > 1024u) {
      fail("invalid launch configuration");
    }
    gridDim = grid;
    blockDim = block_dim;
    std::vector<uint64_t> ids(static_cast<size_t>(grid.x) * grid.y);
    std::iota(ids.begin(), ids.end(), 0);
    if (order_ == BlockOrder::Reversed) {
      std::reverse(ids.begin(), ids.end());
    } else if (order_ == BlockOrder::Shuffled) {
      std::shuffle(ids.begin(), ids.end(), rng_);
    }
    auto call = [&]() { kernel(static_cast<KernelArgs>(args)...); };
    using Call = decltype(call);
    std::vector<unsigned> lanes(block_dim.x);
    std::iota(lanes.begin(), lanes.end(), 0u);
    if (lanes_ == LaneOrder::Reversed) {
      std::reverse(lanes.begin(), lanes.end());
    }
    for (uint64_t id : ids) {
      blockIdx = uint3{static_cast<unsigned>(id % grid.x), static_cast<unsigned>(id / grid.x), 0};
      if (lanes_ == LaneOrder::Shuffled) {
        std::shuffle(lanes.begin(), lanes.end(), rng_);
      }
      run_block(block_dim.x, [](void* c) { (*static_cast<Call*>(c))(); }, &call, lanes);
    }
  }

  int launches = 0;

 private:
  BlockOrder order_;
  LaneOrder lanes_;
  std::mt19937_64 rng_;
  std::vector<std::vector<unsigned char>> buffers_;
};

}  // namespace cuda_host
