// lossagg::reduce_backward on the CPU: d reduce / d values[t] = grad * mask[t] / sample_denoms[s(t)].
#include "../checks.h"
#include "../common.h"
#include "segment_kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace lossagg::cpu {
namespace {

at::Tensor reduce_backward(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms,
    at::ScalarType values_dtype) {
  const TokenLayout layout = check_reduce_backward_inputs(grad, mask, cu_seqlens, sample_denoms);

  const at::Tensor m = mask.contiguous();
  const std::optional<at::Tensor> cu = contiguous_offsets(cu_seqlens);
  at::Tensor out = at::empty(mask.sizes(), mask.options().dtype(values_dtype));

  dispatch_values_dtype(values_dtype, [&]<typename S>(type_tag<S>) {
    using acc_t = acc_t_of<S>;
    const acc_t g = grad.to(acc_scalar_type(values_dtype)).item<acc_t>();
    const at::Tensor denoms = sample_denoms.to(acc_scalar_type(values_dtype)).contiguous();
    const acc_t* d = denoms.const_data_ptr<acc_t>();
    dispatch_mask_dtype(m.scalar_type(), [&]<typename M>(type_tag<M>) {
      dispatch_segments(cu, layout.row_len, [&](auto seg) {
        expand_to_tokens<S, acc_t>(
            out.mutable_data_ptr<S>(), static_cast<const M*>(m.const_data_ptr()), 1, layout.num_tokens, seg, layout.num_segments,
            [&](int64_t, int64_t s) { return g / d[s]; });
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lossagg, CPU, m) {
  m.impl("reduce_backward", &reduce_backward);
}

}  // namespace lossagg::cpu
