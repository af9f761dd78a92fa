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
#include "denom_program.h"
#include "dispatch.h"
#include "dtypes.h"
#include "torch_api.h"

#include <optional>
#include <tuple>
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

// The denominators (or a [K, B] table) in the accumulation dtype, contiguous.
inline Tensor kernel_denoms(const Tensor& sample_denoms, ScalarType values_dtype) {
  return as_dtype(as_contiguous(sample_denoms), acc_scalar_type(values_dtype));
}

// An incoming gradient in the accumulation dtype of the values, contiguous.
inline Tensor kernel_grad(const Tensor& grad, ScalarType values_dtype) { return as_contiguous(as_dtype(grad, acc_scalar_type(values_dtype))); }

// ----------------------------------------------------------------------------------------
// Each op's arguments, checked and in kernel types: one struct per op, filled once by its
// function below (the op's whole set-up: every check, then every conversion), read by both
// backends. An op's argument list is written here and in its schema (ops.cpp) only.

// segment_sum (values [T] / [B, T], or [K, T] / [K, B, T]) and segment_sum_and_count
// ([T] or [B, T] values, as reduce; `counting`).
inline TokenCall segment_sum_args(const Tensor& values, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, bool counting = false) {
  const char* op = counting ? "segment_sum_and_count" : "segment_sum";
  TokenLayout layout = check_token_layout(op, values, mask, cu_seqlens, /*allow_metric_dim=*/!counting);
  layout.max_segment_tokens = check_cu_seqlens_data(op, cu_seqlens, layout);
  return make_call(layout, values, mask, cu_seqlens, acc_scalar_type(values.scalar_type()));
}

// aggregate: values as for reduce, and a well-formed denominator program (denom_program.h).
inline TokenCall aggregate_args(
    const Tensor& values, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, const std::vector<int64_t>& denom_program, double divisor) {
  TokenLayout layout = check_token_layout("aggregate", values, mask, cu_seqlens, /*allow_metric_dim=*/false);
  check_denom_program("aggregate", denom_program, divisor);
  layout.max_segment_tokens = check_cu_seqlens_data("aggregate", cu_seqlens, layout);
  return make_call(layout, values, mask, cu_seqlens, acc_scalar_type(values.scalar_type()));
}

// aggregate_planned: values as for reduce, the mask and offsets as given (for the rare mask dtype counted from
// them), each label tensor int64 [B] on the host, contiguous, and the plan's settings and one term's program.
struct PlannedArgs {
  TokenCall call;
  Tensor mask;
  std::optional<Tensor> cu_seqlens, group_index, session_index;
  int64_t per_prompt;
  bool check_groups, sessions_in_groups;
  std::vector<int64_t> program;
  double divisor;
};

inline std::optional<Tensor> label_arg(const char* name, const std::optional<Tensor>& labels, int64_t b) {
  if (!labels.has_value()) {
    return std::nullopt;
  }
  const Tensor& t = *labels;
  LOSSAGG_CHECK_VALUE(
      t.dim() == 1 && t.size(0) == b && t.scalar_type() == ScalarType::Long && t.is_cpu(), "lossagg.aggregate_planned: ", name,
      " must be an int64 CPU tensor [B] with one label per sample (B = ", b, "), got ", t.scalar_type(), " of ", t.dim(), " dimension(s)",
      t.dim() == 1 ? " and " + std::to_string(t.size(0)) + " entries" : std::string());
  return as_contiguous(t);
}

inline PlannedArgs aggregate_planned_args(
    const Tensor& values,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    const std::optional<Tensor>& group_index,
    const std::optional<Tensor>& session_index,
    int64_t per_prompt,
    bool check_groups,
    bool sessions_in_groups,
    std::vector<int64_t> program,
    double divisor) {
  TokenLayout layout = check_token_layout("aggregate_planned", values, mask, cu_seqlens, /*allow_metric_dim=*/false);
  layout.max_segment_tokens = check_cu_seqlens_data("aggregate_planned", cu_seqlens, layout);
  const int64_t b = layout.num_segments;
  std::optional<Tensor> groups = label_arg("group_index", group_index, b), sessions = label_arg("session_index", session_index, b);
  return {
      make_call(layout, values, mask, cu_seqlens, acc_scalar_type(values.scalar_type())),
      mask,
      cu_seqlens,
      std::move(groups),
      std::move(sessions),
      per_prompt,
      check_groups,
      sessions_in_groups,
      std::move(program),
      divisor};
}

// reduce: the call and d [B] in the accumulation dtype.
struct ReduceArgs {
  TokenCall call;
  Tensor denoms;
};

inline ReduceArgs reduce_args(const Tensor& values, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, const Tensor& sample_denoms) {
  TokenLayout layout = check_token_layout("reduce", values, mask, cu_seqlens, /*allow_metric_dim=*/false);
  check_sample_denoms("reduce", sample_denoms, layout, values);
  layout.max_segment_tokens = check_cu_seqlens_data("reduce", cu_seqlens, layout);
  check_sample_denoms_data("reduce", sample_denoms, values.scalar_type());
  const ScalarType acc = acc_scalar_type(values.scalar_type());
  return {make_call(layout, values, mask, cu_seqlens, acc), kernel_denoms(sample_denoms, values.scalar_type())};
}

// The backward ops: the call (the mask in kernel types), the incoming gradient in the
// accumulation dtype and, for reduce's, d [B]; values_dtype is the gradient's dtype.
struct BackwardArgs {
  TokenCall call;
  Tensor grad;
  std::optional<Tensor> denoms;
};

inline BackwardArgs segment_sum_backward_args(
    const Tensor& grad, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, ScalarType values_dtype) {
  const char* op = "segment_sum_backward";
  check_values_dtype_argument(op, values_dtype);
  LOSSAGG_CHECK_VALUE(grad.dim() == 1 || grad.dim() == 2, "lossagg.", op, ": grad must be [B] or [K, B], got shape ", shape_of(grad));
  LOSSAGG_CHECK_TYPE(is_value_dtype(grad.scalar_type()), "lossagg.", op, ": grad must have a floating dtype, got ", grad.scalar_type());
  const bool has_metric_dim = grad.dim() == 2;
  TokenLayout layout = check_mask_layout(op, mask, cu_seqlens, has_metric_dim ? grad.size(0) : 1, has_metric_dim);
  LOSSAGG_CHECK_VALUE(
      grad.size(grad.dim() - 1) == layout.num_segments, "lossagg.", op, ": grad must have B = ", layout.num_segments,
      " entries in its last dimension, got shape ", shape_of(grad));
  check_same_device(op, "grad", grad, mask, "mask");
  layout.max_segment_tokens = check_cu_seqlens_data(op, cu_seqlens, layout);
  return {make_call(layout, std::nullopt, mask, cu_seqlens, acc_scalar_type(values_dtype)), kernel_grad(grad, values_dtype), std::nullopt};
}

// The checks of a backward op's 0-dim incoming gradient.
inline void check_scalar_grad(const char* op, const Tensor& grad, const Tensor& mask, ScalarType values_dtype) {
  check_values_dtype_argument(op, values_dtype);
  LOSSAGG_CHECK_VALUE(grad.dim() == 0, "lossagg.", op, ": grad must be a 0-dim tensor, got shape ", shape_of(grad));
  LOSSAGG_CHECK_TYPE(is_value_dtype(grad.scalar_type()), "lossagg.", op, ": grad must have a floating dtype, got ", grad.scalar_type());
  check_same_device(op, "grad", grad, mask, "mask");
}

inline BackwardArgs reduce_backward_args(
    const Tensor& grad, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, const Tensor& sample_denoms, ScalarType values_dtype) {
  const char* op = "reduce_backward";
  check_scalar_grad(op, grad, mask, values_dtype);
  TokenLayout layout = check_mask_layout(op, mask, cu_seqlens, 1, false);
  check_sample_denoms(op, sample_denoms, layout, mask);
  layout.max_segment_tokens = check_cu_seqlens_data(op, cu_seqlens, layout);
  check_sample_denoms_data(op, sample_denoms, values_dtype);
  return {
      make_call(layout, std::nullopt, mask, cu_seqlens, acc_scalar_type(values_dtype)), kernel_grad(grad, values_dtype),
      kernel_denoms(sample_denoms, values_dtype)};
}

// reduce_terms and its backward: the call (K metrics, the mask in kernel types), the [K, B]
// tables in the accumulation dtype and the coefficients; the forward also holds the K value
// tensors, each contiguous and read where it lies (no [K, T] copy): rows[k] and their data
// pointers; the backward, its incoming gradient.
struct TermsArgs {
  TokenCall call;
  Tensor denoms;
  std::optional<Tensor> weights;
  const std::vector<double>& coefficients;
  ScalarType values_dtype;
  std::vector<Tensor> rows = {};
  std::vector<const void*> row_data = {};
  std::optional<Tensor> grad = std::nullopt;
};

// The tables of both: sample_denoms [K, B], sample_weights (when given) [K, B] and finite, one
// finite coefficient per term; checked on the device of `like`.
inline void check_term_tables(
    const char* op,
    TokenLayout& layout,
    const Tensor& sample_denoms,
    const std::optional<Tensor>& sample_weights,
    const std::vector<double>& coefficients,
    ScalarType values_dtype,
    const Tensor& like,
    const std::optional<Tensor>& cu_seqlens) {
  check_term_table(op, "sample_denoms", sample_denoms, layout.num_metrics, layout.num_segments, like);
  if (sample_weights.has_value()) {
    check_term_table(op, "sample_weights", *sample_weights, layout.num_metrics, layout.num_segments, like);
  }
  check_coefficients(op, coefficients, layout.num_metrics);
  layout.max_segment_tokens = check_cu_seqlens_data(op, cu_seqlens, layout);
  check_sample_denoms_data(op, sample_denoms, values_dtype);
  if (sample_weights.has_value()) {
    check_sample_weights_data(op, *sample_weights, values_dtype);
  }
}

inline TermsArgs term_args(
    const TokenLayout& layout,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    const Tensor& sample_denoms,
    const std::optional<Tensor>& sample_weights,
    const std::vector<double>& coefficients,
    ScalarType values_dtype) {
  const std::optional<Tensor> weights =
      sample_weights.has_value() ? std::optional<Tensor>(kernel_denoms(*sample_weights, values_dtype)) : std::nullopt;
  return TermsArgs{
      make_call(layout, std::nullopt, mask, cu_seqlens, acc_scalar_type(values_dtype)), kernel_denoms(sample_denoms, values_dtype), weights,
      coefficients, values_dtype};
}

// reduce_terms: K >= 1 value tensors of one dtype and device, each of the token shape of mask.
inline TermsArgs reduce_terms_args(
    const std::vector<Tensor>& values,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    const Tensor& sample_denoms,
    const std::optional<Tensor>& sample_weights,
    const std::vector<double>& coefficients) {
  const char* op = "reduce_terms";
  LOSSAGG_CHECK_VALUE(!values.empty(), "lossagg.", op, ": values must hold at least one term's tensor, got an empty list");
  TokenLayout layout = check_token_layout(op, values[0], mask, cu_seqlens, /*allow_metric_dim=*/false, "values[0]");
  const Tensor& first = values[0];
  for (size_t k = 1; k < values.size(); ++k) {
    const Tensor& v = values[k];
    LOSSAGG_CHECK_TYPE(
        v.scalar_type() == first.scalar_type(), "lossagg.", op, ": every term's values must have one dtype, values[0]'s ", first.scalar_type(),
        ", got values[", k, "] of dtype ", v.scalar_type());
    LOSSAGG_CHECK_VALUE(
        v.device() == first.device(), "lossagg.", op, ": values[", k, "] must be on the device of values[0] (", device_name(first), "), got ",
        device_name(v));
    LOSSAGG_CHECK_VALUE(
        v.sizes() == mask.sizes(), "lossagg.", op, ": values[", k, "] must have the token shape of mask ", shape_of(mask), ", got shape ",
        shape_of(v));
  }
  layout.num_metrics = static_cast<int64_t>(values.size());
  layout.has_metric_dim = true;
  check_term_tables(op, layout, sample_denoms, sample_weights, coefficients, first.scalar_type(), first, cu_seqlens);
  TermsArgs args = term_args(layout, mask, cu_seqlens, sample_denoms, sample_weights, coefficients, first.scalar_type());
  args.rows.reserve(values.size());
  for (const Tensor& v : values) {
    args.rows.push_back(as_contiguous(v));
    args.row_data.push_back(args.rows.back().const_data_ptr());
  }
  return args;
}

inline TermsArgs reduce_terms_backward_args(
    const Tensor& grad,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    const Tensor& sample_denoms,
    const std::optional<Tensor>& sample_weights,
    const std::vector<double>& coefficients,
    ScalarType values_dtype) {
  const char* op = "reduce_terms_backward";
  check_scalar_grad(op, grad, mask, values_dtype);
  LOSSAGG_CHECK_VALUE(
      sample_denoms.dim() == 2 && sample_denoms.size(0) >= 1, "lossagg.", op, ": sample_denoms must be [K, B] with K >= 1, got shape ",
      shape_of(sample_denoms));
  TokenLayout layout = check_mask_layout(op, mask, cu_seqlens, sample_denoms.size(0), /*has_metric_dim=*/true);
  check_term_tables(op, layout, sample_denoms, sample_weights, coefficients, values_dtype, mask, cu_seqlens);
  TermsArgs args = term_args(layout, mask, cu_seqlens, sample_denoms, sample_weights, coefficients, values_dtype);
  args.grad = kernel_grad(grad, values_dtype);
  return args;
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

inline TokenCall token_counts_args(const Tensor& mask, const std::optional<Tensor>& cu_seqlens) {
  TokenLayout layout = check_mask_layout("token_counts", mask, cu_seqlens, 1, false);
  layout.max_segment_tokens = check_cu_seqlens_data("token_counts", cu_seqlens, layout);
  return make_call(layout, std::nullopt, mask, cu_seqlens, std::nullopt);
}

// ----------------------------------------------------------------------------------------
// Each op's entry point, as its schema (csrc/ops.cpp) declares it, written once for every
// backend: the op's arguments checked and converted (the *_args above), then the backend's
// kernel call, which takes them. A backend registers the entry point of its kernel:
// m.impl("reduce", TORCH_BOX(&reduce_op<&reduce>)).
template <auto kernel>
Tensor segment_sum_op(const Tensor& values, const Tensor& mask, const std::optional<Tensor>& cu_seqlens) {
  return kernel(segment_sum_args(values, mask, cu_seqlens), values.scalar_type());
}

// (the kernel also gets the mask and cu_seqlens as given: a rare mask dtype is counted from them, op_setup.h)
template <auto kernel>
std::tuple<Tensor, Tensor> segment_sum_and_count_op(const Tensor& values, const Tensor& mask, const std::optional<Tensor>& cu_seqlens) {
  return kernel(segment_sum_args(values, mask, cu_seqlens, /*counting=*/true), values.scalar_type(), mask, cu_seqlens);
}

template <auto kernel>
std::tuple<Tensor, Tensor> aggregate_op(
    const Tensor& values, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, std::vector<int64_t> denom_program, double divisor) {
  return kernel(aggregate_args(values, mask, cu_seqlens, denom_program, divisor), values.scalar_type(), mask, cu_seqlens, denom_program, divisor);
}

template <auto kernel>
std::tuple<Tensor, Tensor> aggregate_planned_op(
    const Tensor& values,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    const std::optional<Tensor>& group_index,
    const std::optional<Tensor>& session_index,
    int64_t per_prompt,
    bool check_groups,
    bool sessions_in_groups,
    std::vector<int64_t> program,
    double divisor) {
  return kernel(aggregate_planned_args(
      values, mask, cu_seqlens, group_index, session_index, per_prompt, check_groups, sessions_in_groups, std::move(program), divisor));
}

template <auto kernel>
Tensor reduce_op(const Tensor& values, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, const Tensor& sample_denoms) {
  return kernel(reduce_args(values, mask, cu_seqlens, sample_denoms), values.scalar_type());
}

template <auto kernel>
Tensor segment_sum_backward_op(const Tensor& grad, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, ScalarType values_dtype) {
  return kernel(segment_sum_backward_args(grad, mask, cu_seqlens, values_dtype), values_dtype);
}

template <auto kernel>
Tensor reduce_backward_op(
    const Tensor& grad, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, const Tensor& sample_denoms, ScalarType values_dtype) {
  return kernel(reduce_backward_args(grad, mask, cu_seqlens, sample_denoms, values_dtype), values_dtype);
}

template <auto kernel>
std::tuple<Tensor, Tensor> reduce_terms_op(
    std::vector<Tensor> values,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    const Tensor& sample_denoms,
    const std::optional<Tensor>& sample_weights,
    std::vector<double> coefficients) {
  return kernel(reduce_terms_args(values, mask, cu_seqlens, sample_denoms, sample_weights, coefficients));
}

template <auto kernel>
std::vector<Tensor> reduce_terms_backward_op(
    const Tensor& grad,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    const Tensor& sample_denoms,
    const std::optional<Tensor>& sample_weights,
    std::vector<double> coefficients,
    ScalarType values_dtype) {
  return kernel(reduce_terms_backward_args(grad, mask, cu_seqlens, sample_denoms, sample_weights, coefficients, values_dtype));
}

template <auto kernel>
Tensor token_counts_op(const Tensor& mask, const std::optional<Tensor>& cu_seqlens) {
  return kernel(token_counts_args(mask, cu_seqlens));
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
