// From runtime dtypes to kernel template arguments, for every op of every backend: the
// value dtype (four) and the mask kind (four per value dtype, see kernel_common.h). No
// other type reaches a kernel template: 16 (values, mask) pairs in all.
#pragma once

#include "dtypes.h"
#include "kernel_common.h"
#include "torch_api.h"

#include <type_traits>

namespace lossagg {

template <typename T>
struct type_tag {
  using type = T;
};

inline ScalarType acc_scalar_type(ScalarType values_dtype) { return values_dtype == ScalarType::Double ? ScalarType::Double : ScalarType::Float; }

// f(type_tag<S>) for a value dtype; `what` names the argument in the error.
template <typename F>
void dispatch_values(ScalarType t, const char* what, F&& f) {
  switch (t) {
    case ScalarType::Float:
      return f(type_tag<float>{});
    case ScalarType::Double:
      return f(type_tag<double>{});
    case ScalarType::Half:
      return f(type_tag<c10::Half>{});
    case ScalarType::BFloat16:
      return f(type_tag<c10::BFloat16>{});
    default:
      ::lossagg::fail(ErrorKind::type_error, {"lossagg: ", what, " must have dtype ", value_dtypes_text(), ", got ", t});
  }
}

// f(type_tag<S>, type_tag<M>) for a value dtype and a mask kind the op set-up produced
// for it (a floating mask is in S's accumulation dtype).
template <typename F>
void dispatch_kernel_types(ScalarType values_dtype, MaskKind mask, F&& f) {
  dispatch_values(values_dtype, "values", [&]<typename S>(type_tag<S> s) {
    switch (mask) {
      case MaskKind::boolean:
        return f(s, type_tag<BoolMask>{});
      case MaskKind::uint8:
        return f(s, type_tag<uint8_t>{});
      case MaskKind::int64:
        return f(s, type_tag<int64_t>{});
      default:
        constexpr bool acc_is_double = std::is_same_v<acc_t_of<S>, double>;
        LOSSAGG_CHECK(
            (mask == MaskKind::float64) == acc_is_double,
            "lossagg: internal error: a floating mask must come in the accumulation dtype of the values");
        return f(s, type_tag<acc_t_of<S>>{});
    }
  });
}

// f(type_tag<M>) for any mask kind (token_counts).
template <typename F>
void dispatch_mask_kind(MaskKind mask, F&& f) {
  switch (mask) {
    case MaskKind::boolean:
      return f(type_tag<BoolMask>{});
    case MaskKind::uint8:
      return f(type_tag<uint8_t>{});
    case MaskKind::int64:
      return f(type_tag<int64_t>{});
    case MaskKind::float32:
      return f(type_tag<float>{});
    default:
      return f(type_tag<double>{});
  }
}

}  // namespace lossagg
