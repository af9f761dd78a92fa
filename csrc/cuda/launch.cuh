// Host-side launchers shared by the CUDA ops: workspace layout, grid shapes and the order
// of launches. They run on a `Device`, which provides
//   void* workspace(int64_t bytes)         scratch memory for the launches that follow
//   void zero(void* p, size_t bytes)       a memset ordered with those launches
//   void launch(kernel, grid, block, ...)  one kernel launch
// cuda_device.cuh is the real one (current stream, caching allocator, no host sync);
// tests/cuda_host/ runs the same launchers and kernels on the CPU.
#pragma once

#include "../kernel_common.h"
#include "segment_kernels.cuh"

#include <algorithm>
#include <cstdint>

namespace lossagg::cuda {

// Metrics beyond CUDA's gridDim.y limit are looped over inside the kernels.
inline unsigned metric_grid(int64_t num_metrics) { return static_cast<unsigned>(std::clamp<int64_t>(num_metrics, 1, kMaxGridY)); }

inline dim3 tile_grid(int64_t tiles, int64_t num_metrics) {
  return dim3(static_cast<unsigned>((tiles + kWarpsPerBlock - 1) / kWarpsPerBlock), metric_grid(num_metrics));
}

inline dim3 fixup_grid(int64_t num_segments, int64_t num_metrics) {
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, (num_segments + kSegmentsPerBlock - 1) / kSegmentsPerBlock)), metric_grid(num_metrics));
}

// Segment sums of values ([K, ntok] flattened) into out ([K, B], acc_t). With
// denoms != nullptr (K == 1), also writes sum_s out[s] / denoms[s] into *result; with
// counts != nullptr, the kept tokens of each segment into counts ([B], int64).
// Two launches: the tile pass and the fix-up.
template <typename acc_t, typename Device, typename scalar_t, typename mask_t>
void segment_sum_passes(
    Device& dev,
    const TokenLayout& layout,
    const Segments& seg,
    const scalar_t* values,
    const mask_t* mask,
    acc_t* out,
    const acc_t* denoms,
    acc_t* result,
    int64_t* counts = nullptr) {
  const int64_t tiles = num_tiles(layout.num_tokens);
  const int64_t B = layout.num_segments;
  const int64_t K = layout.num_metrics;
  const bool reduce = result != nullptr;
  const dim3 fgrid = fixup_grid(B, K);
  // One workspace: the per-tile count partials (when counting), first/last partials per
  // tile and metric, block sums, then two integers (the bad-table flag, the last-block
  // counter), zeroed by one memset.
  const int64_t count_elems = counts != nullptr ? 2 * tiles : 0;
  const int64_t partial_elems = 2 * K * tiles;
  const int64_t block_elems = reduce ? fgrid.x : 0;
  const int64_t bytes =
      count_elems * static_cast<int64_t>(sizeof(int64_t)) + (partial_elems + block_elems) * static_cast<int64_t>(sizeof(acc_t)) + 16;
  auto* base = static_cast<unsigned char*>(dev.workspace(bytes));
  int64_t* first_count = counts != nullptr ? reinterpret_cast<int64_t*>(base) : nullptr;
  int64_t* last_count = counts != nullptr ? first_count + tiles : nullptr;
  acc_t* first_partial = reinterpret_cast<acc_t*>(base + count_elems * static_cast<int64_t>(sizeof(int64_t)));
  acc_t* last_partial = first_partial + K * tiles;
  acc_t* block_sums = last_partial + K * tiles;
  unsigned int* bad_table = reinterpret_cast<unsigned int*>(block_sums + block_elems);
  unsigned int* counter = bad_table + 1;
  dev.zero(bad_table, 2 * sizeof(unsigned int));
  if (tiles > 0) {
    dev.launch(
        segment_sum_tiles_kernel<acc_t, scalar_t, mask_t>, tile_grid(tiles, K), dim3(kThreads), values, mask, seg, B, layout.num_tokens, K, tiles,
        out, first_partial, last_partial, bad_table, counts, first_count, last_count);
  }
  if (reduce) {
    dev.launch(
        segment_sum_fixup_kernel<true, acc_t>, fgrid, dim3(kThreads), seg, B, layout.num_tokens, K, tiles, out, first_partial, last_partial,
        bad_table, denoms, block_sums, counter, result, static_cast<int64_t*>(nullptr), static_cast<const int64_t*>(nullptr),
        static_cast<const int64_t*>(nullptr));
  } else if (B > 0) {
    dev.launch(
        segment_sum_fixup_kernel<false, acc_t>, fgrid, dim3(kThreads), seg, B, layout.num_tokens, K, tiles, out, first_partial, last_partial,
        bad_table, static_cast<const acc_t*>(nullptr), static_cast<acc_t*>(nullptr), static_cast<unsigned int*>(nullptr),
        static_cast<acc_t*>(nullptr), counts, static_cast<const int64_t*>(first_count), static_cast<const int64_t*>(last_count));
  }
}

// segment_sum: out [K, B].
template <typename acc_t, typename Device, typename scalar_t, typename mask_t>
void launch_segment_sum(Device& dev, const TokenLayout& layout, const Segments& seg, const scalar_t* values, const mask_t* mask, acc_t* out) {
  segment_sum_passes<acc_t>(dev, layout, seg, values, mask, out, static_cast<const acc_t*>(nullptr), static_cast<acc_t*>(nullptr));
}

// segment_sum_and_count: out [K, B] and counts [B] (kept tokens of each segment) from the
// same two launches.
template <typename acc_t, typename Device, typename scalar_t, typename mask_t>
void launch_segment_sum_and_count(
    Device& dev, const TokenLayout& layout, const Segments& seg, const scalar_t* values, const mask_t* mask, acc_t* out, int64_t* counts) {
  segment_sum_passes<acc_t>(dev, layout, seg, values, mask, out, static_cast<const acc_t*>(nullptr), static_cast<acc_t*>(nullptr), counts);
}

// reduce: *result = sum_s segment_sum[s] / denoms[s]; the per-sample sums live in the workspace.
template <typename acc_t, typename Device, typename scalar_t, typename mask_t>
void launch_reduce(
    Device& dev, const TokenLayout& layout, const Segments& seg, const scalar_t* values, const mask_t* mask, const acc_t* denoms, acc_t* result) {
  acc_t* sums = static_cast<acc_t*>(dev.workspace(std::max<int64_t>(layout.num_segments, 1) * static_cast<int64_t>(sizeof(acc_t))));
  segment_sum_passes<acc_t>(dev, layout, seg, values, mask, sums, denoms, result);
}

// out[k, t] = mask_weight(mask[t]) * coef(k, s(t)). One launch.
template <typename scalar_t, typename acc_t, typename Device, typename mask_t, typename Coef>
void launch_expand(Device& dev, const TokenLayout& layout, const Segments& seg, scalar_t* out, const mask_t* mask, Coef coef) {
  const int64_t tiles = num_tiles(layout.num_tokens);
  if (tiles == 0 || layout.num_metrics == 0) {
    return;
  }
  dev.launch(
      expand_tiles_kernel<scalar_t, acc_t, mask_t, Coef>, tile_grid(tiles, layout.num_metrics), dim3(kThreads), out, mask, seg, layout.num_segments,
      layout.num_tokens, layout.num_metrics, tiles, coef);
}

}  // namespace lossagg::cuda
