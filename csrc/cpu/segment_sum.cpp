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
  const TokenLayout layout = check_token_layout("segment_sum", values, mask, cu_seqlens, /*allow_metric_dim=*/true);
  check_cu_seqlens_data("segment_sum", cu_seqlens, layout);

  const at::Tensor v = values.contiguous();
  const at::Tensor m = mask.contiguous();
  const std::optional<at::Tensor> cu =
      cu_seqlens.has_value() ? std::optional<at::Tensor>(cu_seqlens->contiguous()) : std::nullopt;
  std::vector<int64_t> out_shape{layout.num_segments};
  if (layout.has_metric_dim) {
    out_shape.insert(out_shape.begin(), layout.num_metrics);
  }
  at::Tensor out = at::empty(out_shape, values.options().dtype(acc_scalar_type(values.scalar_type())));

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
