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
#include "torch_api.h"

#include <optional>
#include <utility>
#include <vector>

namespace lossagg {

// t itself when it is already contiguous (no dispatcher call), else a contiguous copy.
inline Tensor as_contiguous(const Tensor& t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }

// t in dtype `to` (t itself when it already is).
inline Tensor as_dtype(const Tensor& t, ScalarType to) { return t.scalar_type() == to ? t : torch::stable::to(t, to); }

// The mask as the kernels read it, and its kind. `acc` is the accumulation dtype of the
// values; without one (token_counts) float32 and float64 masks are read as given.
inline std::pair<Tensor, MaskKind> kernel_mask(const Tensor& mask, std::optional<ScalarType> acc) {
  switch (mask.scalar_type()) {
    case ScalarType::Bool:
      return {as_contiguous(mask), MaskKind::boolean};
    case ScalarType::Byte:
      return {as_contiguous(mask), MaskKind::uint8};
    case ScalarType::Char:
    case ScalarType::Short:
    case ScalarType::Int:
    case ScalarType::Long:
      return {as_dtype(as_contiguous(mask), ScalarType::Long), MaskKind::int64};
    default: {
      const ScalarType target = acc.value_or(mask.scalar_type() == ScalarType::Double ? ScalarType::Double : ScalarType::Float);
      return {as_dtype(as_contiguous(mask), target), target == ScalarType::Double ? MaskKind::float64 : MaskKind::float32};
    }
  }
}

// One checked call: contiguous tensors in kernel types, and their layout.
struct TokenCall {
  TokenLayout layout;
  std::optional<Tensor> values;  // absent for backward ops and token_counts
  Tensor mask;
  MaskKind mask_kind;
  std::optional<Tensor> offsets;  // cu_seqlens (int32 or int64); absent when padded

  template <typename M>
  const M* mask_data() const {
    return static_cast<const M*>(mask.const_data_ptr());
  }

  const void* values_data() const { return values.has_value() ? values->const_data_ptr() : nullptr; }

  Segments segments() const {
    if (!offsets.has_value()) {
      return Segments{nullptr, false, layout.row_len};
    }
    return Segments{offsets->const_data_ptr(), offsets->scalar_type() == ScalarType::Long, 0};
  }

  // f(type_tag<S>, type_tag<M>) for the kernel types of this call; S is the values dtype
  // (of the forward input, or of the gradient a backward op returns).
  template <typename F>
  void dispatch(ScalarType values_dtype, F&& f) const {
    dispatch_kernel_types(values_dtype, mask_kind, std::forward<F>(f));
  }

  // Per-segment sums [B] or [K, B] in the accumulation dtype of `values_dtype`.
  Tensor new_segment_sums(ScalarType values_dtype) const {
    std::vector<int64_t> shape{layout.num_segments};
    if (layout.has_metric_dim) {
      shape.insert(shape.begin(), layout.num_metrics);
    }
    return new_tensor(mask, shape, acc_scalar_type(values_dtype));
  }

  // Per-token gradients in the token layout of the mask (with the leading K if any).
  Tensor new_token_grad(ScalarType values_dtype) const {
    const auto sizes = mask.sizes();
    std::vector<int64_t> shape(sizes.begin(), sizes.end());
    if (layout.has_metric_dim) {
      shape.insert(shape.begin(), layout.num_metrics);
    }
    return new_tensor(mask, shape, values_dtype);
  }
};

inline TokenCall make_call(
    const TokenLayout& layout,
    const std::optional<Tensor>& values,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    std::optional<ScalarType> acc) {
  auto [kmask, kind] = kernel_mask(mask, acc);
  return TokenCall{
      layout, values.has_value() ? std::optional<Tensor>(as_contiguous(*values)) : std::nullopt, std::move(kmask), kind,
      cu_seqlens.has_value() ? std::optional<Tensor>(as_contiguous(*cu_seqlens)) : std::nullopt};
}

// The denominators in the accumulation dtype, contiguous.
inline Tensor kernel_denoms(const Tensor& sample_denoms, ScalarType values_dtype) {
  return as_dtype(as_contiguous(sample_denoms), acc_scalar_type(values_dtype));
}

inline TokenCall segment_sum_call(const Tensor& values, const Tensor& mask, const std::optional<Tensor>& cu_seqlens) {
  return make_call(check_segment_sum_inputs(values, mask, cu_seqlens), values, mask, cu_seqlens, acc_scalar_type(values.scalar_type()));
}

inline TokenCall segment_sum_and_count_call(const Tensor& values, const Tensor& mask, const std::optional<Tensor>& cu_seqlens) {
  return make_call(
      check_segment_sum_inputs(values, mask, cu_seqlens, /*allow_metric_dim=*/false), values, mask, cu_seqlens,
      acc_scalar_type(values.scalar_type()));
}

inline TokenCall aggregate_call(
    const Tensor& values, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, const std::vector<int64_t>& denom_program, double divisor) {
  return make_call(
      check_aggregate_inputs(values, mask, cu_seqlens, denom_program, divisor), values, mask, cu_seqlens, acc_scalar_type(values.scalar_type()));
}

inline TokenCall reduce_call(const Tensor& values, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, const Tensor& sample_denoms) {
  return make_call(check_reduce_inputs(values, mask, cu_seqlens, sample_denoms), values, mask, cu_seqlens, acc_scalar_type(values.scalar_type()));
}

// reduce_terms: the call (K metrics, the mask in kernel types) and the K value tensors, each
// contiguous and read where it lies (no [K, T] copy): rows[k] and their data pointers.
struct TermsCall {
  TokenCall call;
  std::vector<Tensor> rows;
  std::vector<const void*> row_data;
};

inline TermsCall reduce_terms_call(
    const std::vector<Tensor>& values,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    const Tensor& sample_denoms,
    const std::optional<Tensor>& sample_weights,
    const std::vector<double>& coefficients) {
  const TokenLayout layout = check_reduce_terms_inputs(values, mask, cu_seqlens, sample_denoms, sample_weights, coefficients);
  TermsCall terms{make_call(layout, std::nullopt, mask, cu_seqlens, acc_scalar_type(values[0].scalar_type())), {}, {}};
  terms.rows.reserve(values.size());
  for (const Tensor& v : values) {
    terms.rows.push_back(as_contiguous(v));
    terms.row_data.push_back(terms.rows.back().const_data_ptr());
  }
  return terms;
}

inline TokenCall reduce_terms_backward_call(
    const Tensor& grad,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    const Tensor& sample_denoms,
    const std::optional<Tensor>& sample_weights,
    const std::vector<double>& coefficients,
    ScalarType values_dtype) {
  return make_call(
      check_reduce_terms_backward_inputs(grad, mask, cu_seqlens, sample_denoms, sample_weights, coefficients, values_dtype), std::nullopt, mask,
      cu_seqlens, acc_scalar_type(values_dtype));
}

// reduce_terms_backward's output: one gradient of the mask's shape per term, each its own tensor.
inline std::vector<Tensor> new_term_grads(const TokenCall& call, ScalarType values_dtype) {
  const auto sizes = call.mask.sizes();
  const std::vector<int64_t> shape(sizes.begin(), sizes.end());
  std::vector<Tensor> out;
  for (int64_t k = 0; k < call.layout.num_metrics; ++k) {
    out.push_back(new_tensor(call.mask, shape, values_dtype));
  }
  return out;
}

// reduce_terms' per-term tables ([K, B] denominators or weights) in the accumulation dtype, contiguous.
inline Tensor kernel_term_table(const Tensor& table, ScalarType values_dtype) {
  return as_dtype(as_contiguous(table), acc_scalar_type(values_dtype));
}

inline TokenCall segment_sum_backward_call(const Tensor& grad, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, ScalarType values_dtype) {
  return make_call(
      check_segment_sum_backward_inputs(grad, mask, cu_seqlens, values_dtype), std::nullopt, mask, cu_seqlens, acc_scalar_type(values_dtype));
}

inline TokenCall reduce_backward_call(
    const Tensor& grad, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, const Tensor& sample_denoms, ScalarType values_dtype) {
  return make_call(
      check_reduce_backward_inputs(grad, mask, cu_seqlens, sample_denoms, values_dtype), std::nullopt, mask, cu_seqlens,
      acc_scalar_type(values_dtype));
}

inline TokenCall token_counts_call(const Tensor& mask, const std::optional<Tensor>& cu_seqlens) {
  return make_call(check_token_counts_inputs(mask, cu_seqlens), std::nullopt, mask, cu_seqlens, std::nullopt);
}

// A token count is a non-zero entry of the mask the user passed (token_counts reads it as given).
// A float64 mask beside values of a lower precision is converted to float32 for the sums (the
// rounding mask_weight did), which turns an entry 0 < |m| <= 2^-150 into 0: the ops that count
// (segment_sum_and_count, aggregate) then take the counts from the mask itself, in one more pass
// over it, for this rare pair of dtypes only.
inline bool counts_need_own_pass(const Tensor& mask, ScalarType values_dtype) {
  return mask.scalar_type() == ScalarType::Double && acc_scalar_type(values_dtype) != ScalarType::Double;
}

}  // namespace lossagg
