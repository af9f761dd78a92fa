// lossagg::reduce on CUDA: sum_i segment_sum[i] / sample_denoms[i], in two launches
// (tile pass, fix-up with the final fixed-order combine).
#include "../checks.h"
#include "launch.cuh"

#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace lossagg::cuda {
namespace {

at::Tensor reduce(
    const at::Tensor& values,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms) {
  const TokenLayout layout = check_reduce_inputs(values, mask, cu_seqlens, sample_denoms);
  const c10::cuda::CUDAGuard guard(values.device());

  const at::Tensor v = values.contiguous();
  const at::Tensor m = mask.contiguous();
  const at::Tensor d = sample_denoms.contiguous();
  const std::optional<at::Tensor> cu = contiguous_offsets(cu_seqlens);
  const at::ScalarType acc_dtype = acc_scalar_type(values.scalar_type());
  at::Tensor out = at::empty({}, values.options().dtype(acc_dtype));
  // Per-sample sums: a workspace of B accumulators.
  at::Tensor sums = at::empty({layout.num_segments}, values.options().dtype(acc_dtype));

  dispatch_values_dtype(v.scalar_type(), [&]<typename S>(type_tag<S>) {
    using acc_t = acc_t_of<S>;
    dispatch_float_dtype(d.scalar_type(), "sample_denoms", [&]<typename D>(type_tag<D>) {
      dispatch_mask_dtype(m.scalar_type(), [&]<typename M>(type_tag<M>) {
        dispatch_segments(cu, layout.row_len, [&](auto seg) {
          launch_segment_sums<acc_t>(
              v.const_data_ptr<S>(), static_cast<const M*>(m.const_data_ptr()), seg, layout.num_segments,
              layout.num_tokens, 1, sums.mutable_data_ptr<acc_t>(), values.options(), d.const_data_ptr<D>(),
              out.mutable_data_ptr<acc_t>());
        });
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lossagg, CUDA, m) {
  m.impl("reduce", &reduce);
}

}  // namespace lossagg::cuda
