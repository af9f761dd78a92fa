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
#include <type_traits>

namespace lossagg::cuda {

// Metrics beyond CUDA's gridDim.y limit are looped over inside the kernels.
inline unsigned metric_grid(int64_t num_metrics) { return static_cast<unsigned>(std::clamp<int64_t>(num_metrics, 1, kMaxGridY)); }

inline dim3 tile_grid(int64_t tiles, int64_t num_metrics) {
  return dim3(static_cast<unsigned>((tiles + kWarpsPerBlock - 1) / kWarpsPerBlock), metric_grid(num_metrics));
}

inline dim3 fixup_grid(int64_t num_segments, int64_t num_metrics) {
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, (num_segments + kSegmentsPerBlock - 1) / kSegmentsPerBlock)), metric_grid(num_metrics));
}

// Segment sums of values (Rows: the rows of one [K, ntok] array, or the terms' own arrays)
// into out ([K, B], acc_t). With denoms != nullptr (K == 1), also writes sum_s out[s] /
// denoms[s] into *result; with counts != nullptr, the kept tokens of each segment into counts
// ([B], int64). Two launches: the tile pass and the fix-up. Rows of their own run every metric
// in each warp (one block row). Returns the flag (device memory) the tiles set when cu_seqlens
// is inconsistent.
template <typename acc_t, typename Device, typename scalar_t, typename mask_t>
unsigned int* segment_sum_passes(
    Device& dev,
    const TokenLayout& layout,
    const Segments& seg,
    const Rows<const scalar_t>& values,
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
        segment_sum_tiles_kernel<acc_t, scalar_t, mask_t>, tile_grid(tiles, values.base == nullptr ? 1 : K), dim3(kThreads), values, mask, seg, B,
        layout.num_tokens, K, tiles, out, first_partial, last_partial, bad_table, counts, first_count, last_count);
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
  return bad_table;
}

// segment_sum: out [K, B].
template <typename acc_t, typename Device, typename scalar_t, typename mask_t>
void launch_segment_sum(Device& dev, const TokenLayout& layout, const Segments& seg, const scalar_t* values, const mask_t* mask, acc_t* out) {
  segment_sum_passes<acc_t>(dev, layout, seg, strided_rows(values), mask, out, static_cast<const acc_t*>(nullptr), static_cast<acc_t*>(nullptr));
}

// segment_sum_and_count: out [K, B] and counts [B] (kept tokens of each segment) from the
// same two launches.
template <typename acc_t, typename Device, typename scalar_t, typename mask_t>
void launch_segment_sum_and_count(
    Device& dev, const TokenLayout& layout, const Segments& seg, const scalar_t* values, const mask_t* mask, acc_t* out, int64_t* counts) {
  segment_sum_passes<acc_t>(
      dev, layout, seg, strided_rows(values), mask, out, static_cast<const acc_t*>(nullptr), static_cast<acc_t*>(nullptr), counts);
}

// reduce: *result = sum_s segment_sum[s] / denoms[s]; the per-sample sums live in the workspace.
template <typename acc_t, typename Device, typename scalar_t, typename mask_t>
void launch_reduce(
    Device& dev, const TokenLayout& layout, const Segments& seg, const scalar_t* values, const mask_t* mask, const acc_t* denoms, acc_t* result) {
  acc_t* sums = static_cast<acc_t*>(dev.workspace(std::max<int64_t>(layout.num_segments, 1) * static_cast<int64_t>(sizeof(acc_t))));
  segment_sum_passes<acc_t>(dev, layout, seg, strided_rows(values), mask, sums, denoms, result);
}

// out(k)[t] = mask_weight(mask[t]) * coef(k, s(t)), out the rows of one [K, ntok] array (or
// the terms' own tensors). One launch.
template <typename scalar_t, typename acc_t, typename Device, typename mask_t>
void launch_expand_rows(
    Device& dev, const TokenLayout& layout, const Segments& seg, const Rows<scalar_t>& out, const mask_t* mask, const Coefficient<acc_t>& coef) {
  const int64_t tiles = num_tiles(layout.num_tokens);
  if (tiles == 0 || layout.num_metrics == 0) {
    return;
  }
  dev.launch(
      expand_tiles_kernel<scalar_t, acc_t, mask_t>, tile_grid(tiles, layout.num_metrics), dim3(kThreads), out, mask, seg, layout.num_segments,
      layout.num_tokens, layout.num_metrics, tiles, coef);
}

// out[k, t] = mask_weight(mask[t]) * coef(k, s(t)), out [K, ntok]. One launch.
template <typename scalar_t, typename acc_t, typename Device, typename mask_t>
void launch_expand(Device& dev, const TokenLayout& layout, const Segments& seg, scalar_t* out, const mask_t* mask, const Coefficient<acc_t>& coef) {
  launch_expand_rows<scalar_t, acc_t>(dev, layout, seg, strided_rows(out), mask, coef);
}

// reduce_terms over the K terms of `layout` (num_metrics = K), term k's values at rows[k] (a
// host array of K device pointers): parts[k] = J_k = sum_s w[k, s] S[k, s] / denoms[k, s]
// (weights may be null) and *result = sum_k c_k J_k in term order (terms_total_kernel).
// Per chunk of at most kMaxTermRows terms, three launches: the tile pass over the chunk's
// values (one read of the mask), the fix-up, the chunk's totals.
template <typename acc_t, typename Device, typename scalar_t, typename mask_t>
void launch_reduce_terms(
    Device& dev,
    const TokenLayout& layout,
    const Segments& seg,
    const scalar_t* const* rows,
    const mask_t* mask,
    const acc_t* denoms,
    const acc_t* weights,
    const double* coefficients,
    acc_t* parts,
    acc_t* result) {
  const int64_t K = layout.num_metrics;
  const int64_t B = layout.num_segments;
  acc_t* sums = static_cast<acc_t*>(dev.workspace(std::max<int64_t>(K * B, 1) * static_cast<int64_t>(sizeof(acc_t))));
  for (int64_t k0 = 0; k0 < K; k0 += kMaxTermRows) {
    const int64_t n = std::min<int64_t>(kMaxTermRows, K - k0);
    Rows<const scalar_t> chunk{};
    TermCoefficients c{};
    for (int64_t j = 0; j < n; ++j) {
      chunk.row[j] = rows[k0 + j];
      c.c[j] = coefficients[k0 + j];
    }
    TokenLayout part = layout;
    part.num_metrics = n;
    const unsigned int* bad_table =
        segment_sum_passes<acc_t>(dev, part, seg, chunk, mask, sums + k0 * B, static_cast<const acc_t*>(nullptr), static_cast<acc_t*>(nullptr));
    dev.launch(
        terms_total_kernel<acc_t>, dim3(1), dim3(kThreads), static_cast<const acc_t*>(sums), denoms, weights, c, k0, n, B, bad_table, parts, result);
  }
}

// reduce_terms_backward: out[k] (K arrays of ntok, values dtype, a host array of device
// pointers), out[k][t] = mask_weight(mask[t]) * ((grad * c_k) / denoms[k, s(t)]) * weights[k,
// s(t)]. One launch per chunk of kMaxTermRows terms.
template <typename scalar_t, typename acc_t, typename Device, typename mask_t>
void launch_reduce_terms_backward(
    Device& dev,
    const TokenLayout& layout,
    const Segments& seg,
    scalar_t* const* out,
    const mask_t* mask,
    const acc_t* grad,
    const acc_t* denoms,
    const acc_t* weights,
    const double* coefficients) {
  const int64_t K = layout.num_metrics;
  for (int64_t k0 = 0; k0 < K; k0 += kMaxTermRows) {
    const int64_t n = std::min<int64_t>(kMaxTermRows, K - k0);
    TermCoefficients c{};
    Rows<scalar_t> rows{};
    for (int64_t j = 0; j < n; ++j) {
      c.c[j] = coefficients[k0 + j];
      rows.row[j] = out[k0 + j];
    }
    TokenLayout part = layout;
    part.num_metrics = n;
    launch_expand_rows<scalar_t, acc_t>(dev, part, seg, rows, mask, term_grad_of<acc_t>(grad, denoms, weights, c, k0, layout.num_segments));
  }
}

}  // namespace lossagg::cuda
