// lossagg::segment_sum on the CPU.
#include "../checks.h"
#include "../common.h"
#include "segment_kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace lossagg::cpu {
namespace {

at::Tensor segment_sum(const at::Tensor& values, const at::Tensor& mask, const std::optional<at::Tensor>& cu_seqlens) {
  const TokenLayout layout = check_segment_sum_inputs(values, mask, cu_seqlens);

  const at::Tensor v = values.contiguous();
  const at::Tensor m = mask.contiguous();
  const std::optional<at::Tensor> cu = contiguous_offsets(cu_seqlens);
  at::Tensor out = at::empty(segment_sums_shape(layout), values.options().dtype(acc_scalar_type(values.scalar_type())));

  dispatch_values_dtype(v.scalar_type(), [&]<typename S>(type_tag<S>) {
    using acc_t = acc_t_of<S>;
    dispatch_mask_dtype(m.scalar_type(), [&]<typename M>(type_tag<M>) {
      dispatch_segments(cu, layout.row_len, [&](auto seg) {
        segment_sums<acc_t>(
            v.const_data_ptr<S>(), static_cast<const M*>(m.const_data_ptr()), layout.num_metrics, layout.num_tokens, seg,
            layout.num_segments, out.mutable_data_ptr<acc_t>());
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lossagg, CPU, m) {
  m.impl("segment_sum", &segment_sum);
}

}  // namespace lossagg::cpu
