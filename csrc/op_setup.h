// The set-up every op shares, whatever the backend: checks, contiguous inputs, the token
// layout, output allocation and the dispatch over values x mask x offsets. A backend's
// op is then its kernel call and nothing else.
#pragma once

#include "checks.h"
#include "dispatch.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>
#include <utility>
#include <vector>

namespace lossagg {

// One checked call: contiguous tensors and their layout.
struct TokenCall {
  TokenLayout layout;
  at::Tensor values;  // undefined for backward ops
  at::Tensor mask;
  std::optional<at::Tensor> cu_seqlens;

  template <typename M>
  const M* mask_data() const {
    return static_cast<const M*>(mask.const_data_ptr());
  }

  // f(type_tag<S>, type_tag<M>, Segments<O>) for the dtypes of this call; S is the
  // values dtype (of the forward input, or of the gradient a backward op returns).
  template <typename F>
  void dispatch(c10::ScalarType values_dtype, F&& f) const {
    dispatch_tokens(values_dtype, mask.scalar_type(), cu_seqlens, layout, std::forward<F>(f));
  }

  // Per-segment sums [B] or [K, B] in the accumulation dtype of `values_dtype`.
  at::Tensor new_segment_sums(c10::ScalarType values_dtype) const {
    std::vector<int64_t> shape{layout.num_segments};
    if (layout.has_metric_dim) {
      shape.insert(shape.begin(), layout.num_metrics);
    }
    return at::empty(shape, mask.options().dtype(acc_scalar_type(values_dtype)));
  }

  // Per-token gradients in the token layout of the mask (with the leading K if any).
  at::Tensor new_token_grad(c10::ScalarType values_dtype) const {
    std::vector<int64_t> shape(mask.sizes().begin(), mask.sizes().end());
    if (layout.has_metric_dim) {
      shape.insert(shape.begin(), layout.num_metrics);
    }
    return at::empty(shape, mask.options().dtype(values_dtype));
  }
};

inline TokenCall make_call(
    const TokenLayout& layout,
    const at::Tensor& values,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens) {
  return TokenCall{
      layout, values.defined() ? values.contiguous() : at::Tensor(), mask.contiguous(),
      cu_seqlens.has_value() ? std::optional<at::Tensor>(cu_seqlens->contiguous()) : std::nullopt};
}

inline TokenCall segment_sum_call(const at::Tensor& values, const at::Tensor& mask, const std::optional<at::Tensor>& cu_seqlens) {
  return make_call(check_segment_sum_inputs(values, mask, cu_seqlens), values, mask, cu_seqlens);
}

inline TokenCall reduce_call(
    const at::Tensor& values,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms) {
  return make_call(check_reduce_inputs(values, mask, cu_seqlens, sample_denoms), values, mask, cu_seqlens);
}

inline TokenCall segment_sum_backward_call(const at::Tensor& grad, const at::Tensor& mask, const std::optional<at::Tensor>& cu_seqlens) {
  return make_call(check_segment_sum_backward_inputs(grad, mask, cu_seqlens), at::Tensor(), mask, cu_seqlens);
}

inline TokenCall reduce_backward_call(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms,
    c10::ScalarType values_dtype) {
  return make_call(check_reduce_backward_inputs(grad, mask, cu_seqlens, sample_denoms, values_dtype), at::Tensor(), mask, cu_seqlens);
}

inline TokenCall token_counts_call(const at::Tensor& mask, const std::optional<at::Tensor>& cu_seqlens) {
  return make_call(check_token_counts_inputs(mask, cu_seqlens), at::Tensor(), mask, cu_seqlens);
}

}  // namespace lossagg
