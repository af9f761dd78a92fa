// The 32 independent accumulators of the CPU sums and their fixed combine, written once for the
// engine's loops (csrc/cpu/engine_loops.h; vec/ keeps the same lanes in registers) and for the
// sum of quotients of reduce and aggregate (csrc/cpu/ops_cpu.cpp).
#pragma once

namespace lossagg::cpu {

constexpr int kLanes = 32;  // two AVX-512 or four AVX2 registers of float32

// The lanes combined pairwise, l with l + 16, then l + 8, 4, 2, 1 (in place): lane[0] is the sum.
// The order is fixed, so the sum has the same bits on every instruction set.
template <typename acc_t>
inline acc_t combine_lanes(acc_t* lane) {
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) {
      lane[l] += lane[l + width];
    }
  }
  return lane[0];
}

}  // namespace lossagg::cpu
