// The CPU kernels of every lossagg op, registered in one place. Checks, layouts and
// dispatch are shared with CUDA (op_setup.h); the engine is segment_kernels.h.
#include "../op_setup.h"
#include "segment_kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

namespace lossagg::cpu {
namespace {

at::Tensor segment_sum(const at::Tensor& values, const at::Tensor& mask, const std::optional<at::Tensor>& cu_seqlens) {
  const TokenCall call = segment_sum_call(values, mask, cu_seqlens);
  at::Tensor out = call.new_segment_sums(values.scalar_type());
  call.dispatch(values.scalar_type(), [&]<typename S, typename M>(type_tag<S>, type_tag<M>, auto seg) {
    using acc_t = acc_t_of<S>;
    segment_sums<acc_t>(call.values.const_data_ptr<S>(), call.mask_data<M>(), call.layout, seg, out.mutable_data_ptr<acc_t>());
  });
  return out;
}

// sum_i segment_sum[i] / sample_denoms[i], samples added in a fixed order (weighted_total):
// deterministic whatever the thread count or instruction set. The denominators are read in their own dtype
// and converted one at a time (the same value a .to(acc dtype) copy would hold).
at::Tensor reduce(
    const at::Tensor& values,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms) {
  const TokenCall call = reduce_call(values, mask, cu_seqlens, sample_denoms);
  const at::ScalarType acc_dtype = acc_scalar_type(values.scalar_type());
  const at::Tensor denoms = sample_denoms.contiguous();
  at::Tensor out = at::empty({}, values.options().dtype(acc_dtype));
  call.dispatch(values.scalar_type(), [&]<typename S, typename M>(type_tag<S>, type_tag<M>, auto seg) {
    using acc_t = acc_t_of<S>;
    std::vector<acc_t> sums(static_cast<size_t>(call.layout.num_segments));
    segment_sums<acc_t>(call.values.const_data_ptr<S>(), call.mask_data<M>(), call.layout, seg, sums.data());
    dispatch_floating(denoms.scalar_type(), "sample_denoms", [&]<typename D>(type_tag<D>) {
      *out.mutable_data_ptr<acc_t>() = weighted_total(sums.data(), denoms.const_data_ptr<D>(), call.layout.num_segments);
    });
  });
  return out;
}

// Each segment's gradient broadcast to its tokens, weighted by the mask.
at::Tensor segment_sum_backward(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    at::ScalarType values_dtype) {
  const TokenCall call = segment_sum_backward_call(grad, mask, cu_seqlens);
  at::Tensor out = call.new_token_grad(values_dtype);
  const at::Tensor g = grad.to(acc_scalar_type(values_dtype)).contiguous();
  call.dispatch(values_dtype, [&]<typename S, typename M>(type_tag<S>, type_tag<M>, auto seg) {
    using acc_t = acc_t_of<S>;
    expand_to_tokens<S, acc_t>(out.mutable_data_ptr<S>(), call.mask_data<M>(), call.layout, seg, g.const_data_ptr<acc_t>());
  });
  return out;
}

// d reduce / d values[t] = grad * mask[t] / sample_denoms[s(t)].
at::Tensor reduce_backward(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms,
    at::ScalarType values_dtype) {
  const TokenCall call = reduce_backward_call(grad, mask, cu_seqlens, sample_denoms, values_dtype);
  at::Tensor out = call.new_token_grad(values_dtype);
  const at::ScalarType acc_dtype = acc_scalar_type(values_dtype);
  const at::Tensor denoms = sample_denoms.contiguous();
  call.dispatch(values_dtype, [&]<typename S, typename M>(type_tag<S>, type_tag<M>, auto seg) {
    using acc_t = acc_t_of<S>;
    const acc_t g = grad.to(acc_dtype).item<acc_t>();
    // one coefficient per sample, g / d[s] in the accumulation dtype
    std::vector<acc_t> coef(static_cast<size_t>(call.layout.num_segments));
    dispatch_floating(denoms.scalar_type(), "sample_denoms", [&]<typename D>(type_tag<D>) {
      const D* d = denoms.const_data_ptr<D>();
      for (int64_t s = 0; s < call.layout.num_segments; ++s) {
        coef[s] = g / static_cast<acc_t>(d[s]);
      }
    });
    expand_to_tokens<S, acc_t>(out.mutable_data_ptr<S>(), call.mask_data<M>(), call.layout, seg, coef.data());
  });
  return out;
}

at::Tensor token_counts(const at::Tensor& mask, const std::optional<at::Tensor>& cu_seqlens) {
  const TokenCall call = token_counts_call(mask, cu_seqlens);
  at::Tensor out = at::empty({call.layout.num_segments}, mask.options().dtype(at::kLong));
  call.dispatch(at::kFloat, [&]<typename S, typename M>(type_tag<S>, type_tag<M>, auto seg) {
    count_kept(call.mask_data<M>(), call.layout, seg, out.mutable_data_ptr<int64_t>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lossagg, CPU, m) {
  m.impl("token_counts", &token_counts);
  m.impl("segment_sum", &segment_sum);
  m.impl("segment_sum_backward", &segment_sum_backward);
  m.impl("reduce", &reduce);
  m.impl("reduce_backward", &reduce_backward);
}

}  // namespace lossagg::cpu
