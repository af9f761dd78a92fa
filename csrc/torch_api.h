// The part of torch the native library uses: the LibTorch stable ABI only (C shims and
// header-only types), so that one build runs on every torch from TORCH_TARGET_VERSION on
// (CMakeLists.txt sets it to the oldest supported release; with it, any header outside
// the stable set is an #error). Besides torch's headers this file holds what the stable
// API leaves to its users: printing shapes, dtypes and devices in messages, and the error
// macros.
//
// Errors: a kernel throws std::runtime_error, which reaches Python as RuntimeError. The
// message starts with the Python exception the lossagg wrappers raise for it
// ("TypeError: lossagg.reduce: values must ..."), so lossagg/ops.py turns it into that
// exception with the same text and libtorch callers read the kind in the message.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace lossagg {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;
using Device = torch::stable::Device;
using DeviceType = torch::headeronly::DeviceType;

// A tensor's shape as messages print it: [2, 5].
struct Shape {
  torch::headeronly::IntHeaderOnlyArrayRef sizes;
};

inline Shape shape_of(const Tensor& t) { return Shape{t.sizes()}; }

inline std::ostream& operator<<(std::ostream& os, const Shape& s) {
  os << '[';
  for (size_t i = 0; i < s.sizes.size(); ++i) {
    os << (i ? ", " : "") << s.sizes[i];
  }
  return os << ']';
}

// A device as torch prints it: cpu, cuda:0, meta.
struct DeviceName {
  Device device;
};

inline std::ostream& operator<<(std::ostream& os, const DeviceName& d) {
  switch (d.device.type()) {
    case DeviceType::CPU:
      os << "cpu";
      break;
    case DeviceType::CUDA:
      os << "cuda";
      break;
    case DeviceType::Meta:
      os << "meta";
      break;
    default:
      os << "device type " << static_cast<int>(d.device.type());
  }
  if (d.device.has_index()) {
    os << ':' << static_cast<int>(d.device.index());
  }
  return os;
}

inline DeviceName device_name(const Tensor& t) { return DeviceName{t.device()}; }

enum class ErrorKind { type_error, value_error, runtime_error };

// One piece of an error message, formatted as it is made, so that fail() is one function whatever it is
// given (a variadic fail was instantiated once per list of argument types: 27 functions).
struct Piece {
  std::string text;
  Piece(const char* s) : text(s) {}         // NOLINT(google-explicit-constructor): pieces are written inline
  Piece(const std::string& s) : text(s) {}  // NOLINT(google-explicit-constructor)
  template <typename T>
  Piece(const T& value) {  // NOLINT(google-explicit-constructor)
    std::ostringstream os;
    os << value;
    text = os.str();
  }
};

[[noreturn]] void fail(ErrorKind kind, std::initializer_list<Piece> pieces);

// The C shim's code of a dtype the ops allocate.
inline int32_t shim_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Float:
      return aoti_torch_dtype_float32();
    case ScalarType::Double:
      return aoti_torch_dtype_float64();
    case ScalarType::Half:
      return aoti_torch_dtype_float16();
    case ScalarType::BFloat16:
      return aoti_torch_dtype_bfloat16();
    case ScalarType::Long:
      return aoti_torch_dtype_int64();
    case ScalarType::Byte:
      return aoti_torch_dtype_uint8();
    default:
      fail(ErrorKind::runtime_error, {"lossagg: internal error: no output of dtype ", t});
  }
}

// A new contiguous tensor of `shape` and `dtype` on the device of `like`. Through the C
// shim's empty_strided: one call, where torch::stable::new_empty is a boxed dispatcher call
// (a fixed cost every op pays, so it counts for small calls).
inline Tensor new_tensor(const Tensor& like, const std::vector<int64_t>& shape, ScalarType dtype) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) {
    strides[i - 1] = strides[i] * std::max<int64_t>(shape[i], 1);
  }
  int32_t device_type = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  AtenTensorHandle out = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(
      static_cast<int64_t>(shape.size()), shape.data(), strides.data(), shim_dtype(dtype), device_type, like.get_device_index(), &out));
  return Tensor(out);
}

[[noreturn]] inline void fail(ErrorKind kind, std::initializer_list<Piece> pieces) {
  std::string message = kind == ErrorKind::type_error ? "TypeError: " : kind == ErrorKind::value_error ? "ValueError: " : "";
  for (const Piece& piece : pieces) {
    message += piece.text;
  }
  throw std::runtime_error(message);
}

}  // namespace lossagg

// Input checks whose messages name the argument, what was expected and what was given;
// `kind` is the Python exception the message starts with (type_error, value_error) or
// runtime_error (an internal error).
#define LOSSAGG_CHECK_AS(kind, cond, ...)                         \
  do {                                                            \
    if (!(cond)) {                                                \
      ::lossagg::fail(::lossagg::ErrorKind::kind, {__VA_ARGS__}); \
    }                                                             \
  } while (0)
#define LOSSAGG_CHECK_TYPE(cond, ...) LOSSAGG_CHECK_AS(type_error, cond, __VA_ARGS__)
#define LOSSAGG_CHECK_VALUE(cond, ...) LOSSAGG_CHECK_AS(value_error, cond, __VA_ARGS__)
#define LOSSAGG_CHECK(cond, ...) LOSSAGG_CHECK_AS(runtime_error, cond, __VA_ARGS__)
