// Pieces shared by the CPU and CUDA kernels: segment geometry, mask weights and the
// dtype dispatch used by every op.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define LOSSAGG_HD __host__ __device__ __forceinline__
#else
#define LOSSAGG_HD inline
#endif

namespace lossagg {

template <typename T>
struct type_tag {
  using type = T;
};

// Segments of the token index space. Packed (THD): segment s is
// [cu_seqlens[s], cu_seqlens[s+1]). Padded ([B, T] rows): cu == nullptr and segment s is
// [s*row_len, (s+1)*row_len). The padded case uses offset_t = int64_t.
template <typename offset_t>
struct Segments {
  const offset_t* cu;
  int64_t row_len;

  LOSSAGG_HD int64_t begin(int64_t s) const {
    return cu ? static_cast<int64_t>(cu[s]) : s * row_len;
  }
  LOSSAGG_HD int64_t end(int64_t s) const {
    return cu ? static_cast<int64_t>(cu[s + 1]) : (s + 1) * row_len;
  }
};

// A bool mask element, read as its byte (torch stores bool as 0 or 1). Kernels use
// is_binary_mask_v to skip the multiply by the weight, which is 1 for every kept token.
struct BoolMask {
  uint8_t value;
  LOSSAGG_HD explicit operator float() const {
    return static_cast<float>(value);
  }
};
template <typename mask_t>
inline constexpr bool is_binary_mask_v = std::is_same_v<mask_t, BoolMask>;

// The weight a mask element gives its token: its value. Tokens whose weight is 0 are
// selected out (never multiplied), so a NaN or inf loss under a zero mask contributes
// exactly 0. A float64 mask keeps its full precision for float64 values.
template <typename acc_t, typename mask_t>
LOSSAGG_HD acc_t mask_weight(mask_t m) {
  return static_cast<acc_t>(static_cast<float>(m));
}
template <>
LOSSAGG_HD double mask_weight<double, double>(double m) {
  return m;
}

// Accumulation type: float32 for every value dtype except float64.
template <typename scalar_t>
struct acc_type {
  using type = float;
};
template <>
struct acc_type<double> {
  using type = double;
};
template <typename scalar_t>
using acc_t_of = typename acc_type<scalar_t>::type;

inline c10::ScalarType acc_scalar_type(c10::ScalarType values_dtype) {
  return values_dtype == c10::kDouble ? c10::kDouble : c10::kFloat;
}

template <typename F>
void dispatch_values_dtype(c10::ScalarType t, F&& f) {
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
      TORCH_CHECK_TYPE(false, "lossagg: values must have dtype float32, bfloat16, float16 or float64, got ", t);
  }
}

template <typename F>
void dispatch_mask_dtype(c10::ScalarType t, F&& f) {
  switch (t) {
    case c10::kBool:
      return f(type_tag<BoolMask>{});
    case c10::kByte:
      return f(type_tag<uint8_t>{});
    case c10::kFloat:
      return f(type_tag<float>{});
    case c10::kDouble:
      return f(type_tag<double>{});
    case c10::kHalf:
      return f(type_tag<c10::Half>{});
    case c10::kBFloat16:
      return f(type_tag<c10::BFloat16>{});
    default:
      TORCH_CHECK_TYPE(false, "lossagg: mask must have dtype bool, uint8 or a floating dtype, got ", t);
  }
}

template <typename F>
void dispatch_float_dtype(c10::ScalarType t, const char* what, F&& f) {
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
      TORCH_CHECK_TYPE(false, "lossagg: ", what, " must have a floating dtype, got ", t);
  }
}

// Calls f(Segments<offset_t>) for the layout of a call: packed with int32 or int64
// offsets, or padded rows of row_len tokens.
template <typename F>
void dispatch_segments(const std::optional<at::Tensor>& cu_seqlens, int64_t row_len, F&& f) {
  if (!cu_seqlens.has_value()) {
    return f(Segments<int64_t>{nullptr, row_len});
  }
  if (cu_seqlens->scalar_type() == c10::kInt) {
    return f(Segments<int32_t>{cu_seqlens->const_data_ptr<int32_t>(), 0});
  }
  return f(Segments<int64_t>{cu_seqlens->const_data_ptr<int64_t>(), 0});
}

}  // namespace lossagg
