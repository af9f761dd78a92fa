// lossagg::segment_sum_backward on CUDA: each segment's gradient broadcast to its tokens,
// weighted by the mask; one launch.
#include "../checks.h"
#include "launch.cuh"

#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace lossagg::cuda {
namespace {

template <typename acc_t>
struct SegmentGrad {
  const acc_t* grad;  // [K, B]
  int64_t num_segments;
  __device__ acc_t operator()(int64_t k, int64_t s) const {
    return grad[k * num_segments + s];
  }
};

at::Tensor segment_sum_backward(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    at::ScalarType values_dtype) {
  const TokenLayout layout = check_segment_sum_backward_inputs(grad, mask, cu_seqlens);
  const c10::cuda::CUDAGuard guard(mask.device());

  const at::Tensor m = mask.contiguous();
  const std::optional<at::Tensor> cu = contiguous_offsets(cu_seqlens);
  at::Tensor out = at::empty(token_grad_shape(mask, layout), mask.options().dtype(values_dtype));

  dispatch_values_dtype(values_dtype, [&]<typename S>(type_tag<S>) {
    using acc_t = acc_t_of<S>;
    const at::Tensor g = grad.to(acc_scalar_type(values_dtype)).contiguous();
    dispatch_mask_dtype(m.scalar_type(), [&]<typename M>(type_tag<M>) {
      dispatch_segments(cu, layout.row_len, [&](auto seg) {
        launch_expand<S, acc_t>(
            out.mutable_data_ptr<S>(), static_cast<const M*>(m.const_data_ptr()), seg, layout.num_segments,
            layout.num_tokens, layout.num_metrics, SegmentGrad<acc_t>{g.const_data_ptr<acc_t>(), layout.num_segments});
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lossagg, CUDA, m) {
  m.impl("segment_sum_backward", &segment_sum_backward);
}

}  // namespace lossagg::cuda
