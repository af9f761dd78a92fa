// The set-up every op shares, whatever the backend: checks, then the inputs converted to
// the few types the kernels are built for, the token layout, output allocation and the
// dispatch over (values, mask kind). A backend's op is then its kernel call and nothing
// else.
//
// Conversions on the way in (each exact, or the one rounding the kernels used to do
// themselves, so results keep their bits):
//   sample_denoms  any floating dtype -> the accumulation dtype (B values; half/bf16/float32
//                  widen exactly, float64 -> float32 is the single rounding of the division)
//   mask           bool, uint8, int64 and a floating mask in the accumulation dtype are read
//                  as given; int8/16/32 -> int64 (same value), float16/bfloat16 -> the
//                  accumulation dtype (exact), float64 with non-float64 values -> float32
//                  (the rounding mask_weight did), float32/16/bf16 with float64 values ->
//                  float64 (exact). These rare masks cost one conversion pass.
#pragma once

#include "checks.h"
#include "dispatch.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>
#include <utility>
#include <vector>

namespace lossagg {

// The mask as the kernels read it, and its kind. `acc` is the accumulation dtype of the
// values; without one (token_counts) float32 and float64 masks are read as given.
inline std::pair<at::Tensor, MaskKind> kernel_mask(const at::Tensor& mask, std::optional<c10::ScalarType> acc) {
  switch (mask.scalar_type()) {
    case c10::kBool:
      return {mask.contiguous(), MaskKind::boolean};
    case c10::kByte:
      return {mask.contiguous(), MaskKind::uint8};
    case c10::kChar:
    case c10::kShort:
    case c10::kInt:
    case c10::kLong:
      return {mask.contiguous().to(c10::kLong), MaskKind::int64};
    default: {
      const c10::ScalarType target = acc.value_or(mask.scalar_type() == c10::kDouble ? c10::kDouble : c10::kFloat);
      return {mask.contiguous().to(target), target == c10::kDouble ? MaskKind::float64 : MaskKind::float32};
    }
  }
}

// One checked call: contiguous tensors in kernel types, and their layout.
struct TokenCall {
  TokenLayout layout;
  at::Tensor values;  // undefined for backward ops and token_counts
  at::Tensor mask;
  MaskKind mask_kind;
  at::Tensor offsets;  // cu_seqlens (int32 or int64); undefined when padded

  template <typename M>
  const M* mask_data() const {
    return static_cast<const M*>(mask.const_data_ptr());
  }

  Segments segments() const {
    if (!offsets.defined()) {
      return Segments{nullptr, false, layout.row_len};
    }
    return Segments{offsets.const_data_ptr(), offsets.scalar_type() == c10::kLong, 0};
  }

  // f(type_tag<S>, type_tag<M>) for the kernel types of this call; S is the values dtype
  // (of the forward input, or of the gradient a backward op returns).
  template <typename F>
  void dispatch(c10::ScalarType values_dtype, F&& f) const {
    dispatch_kernel_types(values_dtype, mask_kind, std::forward<F>(f));
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
    const std::optional<at::Tensor>& cu_seqlens,
    std::optional<c10::ScalarType> acc) {
  auto [kmask, kind] = kernel_mask(mask, acc);
  return TokenCall{
      layout, values.defined() ? values.contiguous() : at::Tensor(), std::move(kmask), kind,
      cu_seqlens.has_value() ? cu_seqlens->contiguous() : at::Tensor()};
}

// The denominators in the accumulation dtype, contiguous.
inline at::Tensor kernel_denoms(const at::Tensor& sample_denoms, c10::ScalarType values_dtype) {
  return sample_denoms.contiguous().to(acc_scalar_type(values_dtype));
}

inline TokenCall segment_sum_call(const at::Tensor& values, const at::Tensor& mask, const std::optional<at::Tensor>& cu_seqlens) {
  return make_call(check_segment_sum_inputs(values, mask, cu_seqlens), values, mask, cu_seqlens, acc_scalar_type(values.scalar_type()));
}

inline TokenCall reduce_call(
    const at::Tensor& values,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms) {
  return make_call(
      check_reduce_inputs(values, mask, cu_seqlens, sample_denoms), values, mask, cu_seqlens, acc_scalar_type(values.scalar_type()));
}

inline TokenCall segment_sum_backward_call(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    c10::ScalarType values_dtype) {
  return make_call(check_segment_sum_backward_inputs(grad, mask, cu_seqlens), at::Tensor(), mask, cu_seqlens, acc_scalar_type(values_dtype));
}

inline TokenCall reduce_backward_call(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms,
    c10::ScalarType values_dtype) {
  return make_call(
      check_reduce_backward_inputs(grad, mask, cu_seqlens, sample_denoms, values_dtype), at::Tensor(), mask, cu_seqlens,
      acc_scalar_type(values_dtype));
}

inline TokenCall token_counts_call(const at::Tensor& mask, const std::optional<at::Tensor>& cu_seqlens) {
  return make_call(check_token_counts_inputs(mask, cu_seqlens), at::Tensor(), mask, cu_seqlens, std::nullopt);
}

}  // namespace lossagg
