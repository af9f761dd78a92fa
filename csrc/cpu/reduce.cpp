// lossagg::reduce on the CPU: sum_i segment_sum[i] / sample_denoms[i].
#include "../checks.h"
#include "../common.h"
#include "segment_kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace lossagg::cpu {
namespace {

at::Tensor reduce(
    const at::Tensor& values,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms) {
  const TokenLayout layout = check_reduce_inputs(values, mask, cu_seqlens, sample_denoms);

  const at::Tensor v = values.contiguous();
  const at::Tensor m = mask.contiguous();
  const std::optional<at::Tensor> cu = contiguous_offsets(cu_seqlens);
  const at::ScalarType acc_dtype = acc_scalar_type(values.scalar_type());
  const at::Tensor denoms = sample_denoms.to(acc_dtype).contiguous();
  at::Tensor out = at::empty({}, values.options().dtype(acc_dtype));

  dispatch_values_dtype(v.scalar_type(), [&]<typename S>(type_tag<S>) {
    using acc_t = acc_t_of<S>;
    const int64_t B = layout.num_segments;
    std::vector<acc_t> sums(static_cast<size_t>(B));
    dispatch_mask_dtype(m.scalar_type(), [&]<typename M>(type_tag<M>) {
      dispatch_segments(cu, layout.row_len, [&](auto seg) {
        segment_sums<acc_t>(v.const_data_ptr<S>(), static_cast<const M*>(m.const_data_ptr()), 1, layout.num_tokens, seg, B, sums.data());
      });
    });
    // Fixed order over samples: deterministic whatever the thread count.
    const acc_t* d = denoms.const_data_ptr<acc_t>();
    acc_t total = acc_t(0);
    for (int64_t s = 0; s < B; ++s) {
      total += sums[s] / d[s];
    }
    *out.mutable_data_ptr<acc_t>() = total;
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lossagg, CPU, m) {
  m.impl("reduce", &reduce);
}

}  // namespace lossagg::cpu
