// The dtypes the ops accept: the one list of the C++ side. lossagg/dtypes.py is the Python
// one (the fake kernels' checks); tests/test_supported_dtypes.py checks that the two agree,
// through the C entry points lossagg_value_dtypes / lossagg_mask_dtypes (csrc/c_api.cpp).
#pragma once

#include "torch_api.h"

#include <string>

namespace lossagg {

// Values (and the incoming gradients and denominators, which are floating too): the four
// floating dtypes the kernels are built for (dispatch.h maps each to its C++ type).
inline constexpr ScalarType kValueDtypes[] = {ScalarType::Float, ScalarType::BFloat16, ScalarType::Half, ScalarType::Double};
// Masks: bool, every signed integer dtype and uint8, and the floating dtypes (a weight).
inline constexpr ScalarType kMaskDtypes[] = {ScalarType::Bool, ScalarType::Byte,  ScalarType::Char,     ScalarType::Short, ScalarType::Int,
                                             ScalarType::Long, ScalarType::Float, ScalarType::BFloat16, ScalarType::Half,  ScalarType::Double};
// How the messages name the mask dtypes.
inline constexpr const char* kMaskDtypesText = "bool, an integer dtype (uint8, int8/16/32/64) or a floating dtype";

template <size_t N>
constexpr bool in_list(const ScalarType (&list)[N], ScalarType t) {
  for (ScalarType x : list) {
    if (x == t) {
      return true;
    }
  }
  return false;
}

inline bool is_value_dtype(ScalarType t) { return in_list(kValueDtypes, t); }
inline bool is_mask_dtype(ScalarType t) { return in_list(kMaskDtypes, t); }

// The dtype as Python names it (torch.float32 -> "float32").
inline const char* python_dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Bool:
      return "bool";
    case ScalarType::Byte:
      return "uint8";
    case ScalarType::Char:
      return "int8";
    case ScalarType::Short:
      return "int16";
    case ScalarType::Int:
      return "int32";
    case ScalarType::Long:
      return "int64";
    case ScalarType::Half:
      return "float16";
    case ScalarType::BFloat16:
      return "bfloat16";
    case ScalarType::Float:
      return "float32";
    case ScalarType::Double:
      return "float64";
    default:
      return "?";
  }
}

// "float32, bfloat16, float16 or float64": the values dtypes, as the messages list them.
inline const std::string& value_dtypes_text() {
  static const std::string text = [] {
    std::string out;
    const size_t n = std::size(kValueDtypes);
    for (size_t i = 0; i < n; ++i) {
      out += (i == 0 ? "" : i + 1 == n ? " or " : ", ");
      out += python_dtype_name(kValueDtypes[i]);
    }
    return out;
  }();
  return text;
}

// "float32,bfloat16,...": a list for the C entry points.
template <size_t N>
std::string dtype_names(const ScalarType (&list)[N]) {
  std::string out;
  for (size_t i = 0; i < N; ++i) {
    out += (i ? "," : "");
    out += python_dtype_name(list[i]);
  }
  return out;
}

}  // namespace lossagg
