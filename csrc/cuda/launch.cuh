// Host-side launchers shared by the CUDA ops: allocation of the small workspaces, grid
// shapes, the current stream. Nothing here synchronises with the host.
#pragma once

#include "../checks.h"
#include "../common.h"
#include "segment_kernels.cuh"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <optional>

namespace lossagg::cuda {

inline dim3 tile_grid(int64_t tiles, int64_t num_metrics) {
  return dim3(static_cast<unsigned>((tiles + kWarpsPerBlock - 1) / kWarpsPerBlock), static_cast<unsigned>(num_metrics));
}

inline dim3 fixup_grid(int64_t num_segments, int64_t num_metrics) {
  return dim3(
      static_cast<unsigned>(std::max<int64_t>(1, (num_segments + kSegmentsPerBlock - 1) / kSegmentsPerBlock)),
      static_cast<unsigned>(num_metrics));
}

// Segment sums of values ([K, ntok] flattened) into out ([K, B], acc_t). With
// denoms != nullptr (K == 1), also writes sum_s out[s] / denoms[s] into *result.
// Two launches: the tile pass and the fix-up.
template <typename acc_t, typename scalar_t, typename mask_t, typename offset_t, typename denom_t = acc_t>
void launch_segment_sums(
    const scalar_t* values,
    const mask_t* mask,
    const Segments<offset_t>& seg,
    int64_t num_segments,
    int64_t num_tokens,
    int64_t num_metrics,
    acc_t* out,
    const at::TensorOptions& options,
    const denom_t* denoms = nullptr,
    acc_t* result = nullptr) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t tiles = num_tiles(num_tokens);
  const bool reduce = result != nullptr;
  const dim3 fgrid = fixup_grid(num_segments, num_metrics);
  // One workspace: first/last partials per tile and metric, block sums, the counter.
  const int64_t partial_elems = 2 * num_metrics * tiles;
  const int64_t block_elems = reduce ? fgrid.x : 0;
  const int64_t counter_bytes = reduce ? 16 : 0;
  const int64_t bytes = (partial_elems + block_elems) * static_cast<int64_t>(sizeof(acc_t)) + counter_bytes;
  at::Tensor workspace = at::empty({std::max<int64_t>(bytes, 1)}, options.dtype(at::kByte));
  auto* base = static_cast<unsigned char*>(workspace.mutable_data_ptr());
  acc_t* first_partial = reinterpret_cast<acc_t*>(base);
  acc_t* last_partial = first_partial + num_metrics * tiles;
  acc_t* block_sums = last_partial + num_metrics * tiles;
  unsigned int* counter = reinterpret_cast<unsigned int*>(block_sums + block_elems);
  if (reduce) {
    C10_CUDA_CHECK(cudaMemsetAsync(counter, 0, sizeof(unsigned int), stream));
  }

  if (tiles > 0) {
    segment_sum_tiles_kernel<acc_t><<<tile_grid(tiles, num_metrics), kThreads, 0, stream>>>(
        values, mask, seg, num_segments, num_tokens, tiles, out, first_partial, last_partial);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (reduce) {
    segment_sum_fixup_kernel<true, acc_t, denom_t><<<fgrid, kThreads, 0, stream>>>(
        seg, num_segments, num_tokens, tiles, out, first_partial, last_partial, denoms, block_sums, counter, result);
  } else if (num_segments > 0) {
    segment_sum_fixup_kernel<false, acc_t, denom_t><<<fgrid, kThreads, 0, stream>>>(
        seg, num_segments, num_tokens, tiles, out, first_partial, last_partial, nullptr, nullptr, nullptr, nullptr);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// out[k, t] = mask_weight(mask[t]) * coef(k, s(t)). One launch.
template <typename scalar_t, typename acc_t, typename mask_t, typename offset_t, typename Coef>
void launch_expand(
    scalar_t* out,
    const mask_t* mask,
    const Segments<offset_t>& seg,
    int64_t num_segments,
    int64_t num_tokens,
    int64_t num_metrics,
    Coef coef) {
  const int64_t tiles = num_tiles(num_tokens);
  if (tiles == 0 || num_metrics == 0) {
    return;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  expand_tiles_kernel<scalar_t, acc_t><<<tile_grid(tiles, num_metrics), kThreads, 0, stream>>>(
      out, mask, seg, num_segments, num_tokens, tiles, coef);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace lossagg::cuda
