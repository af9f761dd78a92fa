// The C entry points of liblossagg_ops.so besides the ops: build facts and the run-time
// switches. Python reaches them with ctypes (lossagg/_native.py), so the library needs no
// Python headers and is the same file for Python, ctest and libtorch users. Nothing here
// throws: a C caller cannot catch a C++ exception.
#include "denom_program.h"
#include "dtypes.h"
#include "lossagg.h"

#include <torch/headeronly/version.h>

#include <exception>
#include <string>

#define LOSSAGG_EXPORT extern "C" __attribute__((visibility("default")))

LOSSAGG_EXPORT int lossagg_built_with_cuda() { return lossagg::built_with_cuda() ? 1 : 0; }

LOSSAGG_EXPORT void lossagg_set_device_checks(int enabled) { lossagg::set_device_checks(enabled != 0); }

LOSSAGG_EXPORT int lossagg_device_checks_enabled() { return lossagg::device_checks_enabled() ? 1 : 0; }

// Static strings: the ISA names are literals.
LOSSAGG_EXPORT const char* lossagg_cpu_isa() {
  static thread_local std::string name;
  name = lossagg::cpu_isa();
  return name.c_str();
}

LOSSAGG_EXPORT const char* lossagg_cpu_best_isa() {
  static thread_local std::string name;
  name = lossagg::cpu_best_isa();
  return name.c_str();
}

// 1 when `name` is auto, avx512, avx2 or baseline (and the cap is set), else 0.
LOSSAGG_EXPORT int lossagg_set_cpu_isa(const char* name) {
  try {
    lossagg::set_cpu_isa(name == nullptr ? std::string() : std::string(name));
    return 1;
  } catch (const std::exception&) {
    return 0;
  }
}

// The dtypes the ops accept, as Python names them, comma-separated (csrc/dtypes.h).
LOSSAGG_EXPORT const char* lossagg_value_dtypes() {
  static const std::string names = lossagg::dtype_names(lossagg::kValueDtypes);
  return names.c_str();
}

LOSSAGG_EXPORT const char* lossagg_mask_dtypes() {
  static const std::string names = lossagg::dtype_names(lossagg::kMaskDtypes);
  return names.c_str();
}

// The denominator program's factor codes and their symbols, "1:N,2:c(N'),..." (csrc/denom_program.h;
// lossagg/denom_program.py holds the same table, tests/test_denom_program.py compares them).
LOSSAGG_EXPORT const char* lossagg_denom_factor_codes() {
  static const std::string table = [] {
    std::string out;
    for (const auto& f : lossagg::kFactorCodes) {
      out += (out.empty() ? "" : ",") + std::to_string(static_cast<int64_t>(f.code)) + ":" + f.symbol;
    }
    return out;
  }();
  return table.c_str();
}

// The oldest torch the library runs on: the stable ABI version it targets ("2.10").
LOSSAGG_EXPORT const char* lossagg_torch_floor() {
#ifdef TORCH_TARGET_VERSION
  static const std::string floor = std::to_string((TORCH_TARGET_VERSION >> 56) & 0xff) + "." + std::to_string((TORCH_TARGET_VERSION >> 48) & 0xff);
#else
  static const std::string floor = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
#endif
  return floor.c_str();
}
