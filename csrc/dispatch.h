// From runtime dtypes to kernel template arguments: one list of floating dtypes (values,
// sample_denoms), one of mask dtypes, and the segment layouts, combined by
// dispatch_tokens for every op of every backend.
#pragma once

#include "kernel_common.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <optional>

namespace lossagg {

template <typename T>
struct type_tag {
  using type = T;
};

inline c10::ScalarType acc_scalar_type(c10::ScalarType values_dtype) {
  return values_dtype == c10::kDouble ? c10::kDouble : c10::kFloat;
}

// f(type_tag<T>) for a floating dtype; `what` names the argument in the error.
template <typename F>
void dispatch_floating(c10::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case c10::kFloat:
      return f(type_tag<float>{});
    case c10::kDouble:
      return f(type_tag<double>{});
    case c10::kHalf:
      return f(type_tag<c10::Half>{});
    case c10::kBFloat16:
      return f(type_tag<c10::BFloat16>{});
    default:
      TORCH_CHECK_TYPE(false, "lossagg: ", what, " must have dtype float32, bfloat16, float16 or float64, got ", t);
  }
}

template <typename F>
void dispatch_mask_dtype(c10::ScalarType t, F&& f) {
  switch (t) {
    case c10::kBool:
      return f(type_tag<BoolMask>{});
    case c10::kByte:
      return f(type_tag<uint8_t>{});
    case c10::kChar:
      return f(type_tag<int8_t>{});
    case c10::kShort:
      return f(type_tag<int16_t>{});
    case c10::kInt:
      return f(type_tag<int32_t>{});
    case c10::kLong:
      return f(type_tag<int64_t>{});
    default:
      return dispatch_floating(t, "mask", f);
  }
}

// f(Segments<offset_t>) for the layout of a call: packed with int32 or int64 offsets, or
// padded rows.
template <typename F>
void dispatch_segments(const std::optional<at::Tensor>& cu_seqlens, const TokenLayout& layout, F&& f) {
  if (!cu_seqlens.has_value()) {
    return f(Segments<int64_t>{nullptr, layout.row_len});
  }
  if (cu_seqlens->scalar_type() == c10::kInt) {
    return f(Segments<int32_t>{cu_seqlens->const_data_ptr<int32_t>(), 0});
  }
  return f(Segments<int64_t>{cu_seqlens->const_data_ptr<int64_t>(), 0});
}

// f(type_tag<values type>, type_tag<mask type>, Segments<offset_t>): every combination.
template <typename F>
void dispatch_tokens(
    c10::ScalarType values_dtype,
    c10::ScalarType mask_dtype,
    const std::optional<at::Tensor>& cu_seqlens,
    const TokenLayout& layout,
    F&& f) {
  dispatch_floating(values_dtype, "values", [&](auto values_tag) {
    dispatch_mask_dtype(mask_dtype, [&](auto mask_tag) {
      dispatch_segments(cu_seqlens, layout, [&](auto seg) { f(values_tag, mask_tag, seg); });
    });
  });
}

}  // namespace lossagg
