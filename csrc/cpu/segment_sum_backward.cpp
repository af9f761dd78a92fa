// lossagg::segment_sum_backward on the CPU: broadcast each segment's gradient to its
// tokens, weighted by the mask.
#include "../checks.h"
#include "../common.h"
#include "segment_kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace lossagg::cpu {
namespace {

at::Tensor segment_sum_backward(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    at::ScalarType values_dtype) {
  const TokenLayout layout = check_segment_sum_backward_inputs(grad, mask, cu_seqlens);

  const at::Tensor m = mask.contiguous();
  const std::optional<at::Tensor> cu = contiguous_offsets(cu_seqlens);
  at::Tensor out = at::empty(token_grad_shape(mask, layout), mask.options().dtype(values_dtype));

  dispatch_values_dtype(values_dtype, [&]<typename S>(type_tag<S>) {
    using acc_t = acc_t_of<S>;
    const at::Tensor g = grad.to(acc_scalar_type(values_dtype)).contiguous();
    const acc_t* gp = g.const_data_ptr<acc_t>();
    const int64_t B = layout.num_segments;
    dispatch_mask_dtype(m.scalar_type(), [&]<typename M>(type_tag<M>) {
      dispatch_segments(cu, layout.row_len, [&](auto seg) {
        expand_to_tokens<S, acc_t>(
            out.mutable_data_ptr<S>(), static_cast<const M*>(m.const_data_ptr()), layout.num_metrics, layout.num_tokens, seg, B,
            [&](int64_t k, int64_t s) { return gp[k * B + s]; });
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lossagg, CPU, m) {
  m.impl("segment_sum_backward", &segment_sum_backward);
}

}  // namespace lossagg::cpu
