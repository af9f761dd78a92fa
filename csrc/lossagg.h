// Public C++ surface of lossagg for libtorch users. The ops themselves are reached
// through the dispatcher (torch::ops / c10::Dispatcher) as lossagg::<name>.
#pragma once

#include <string>

// The library is built with hidden visibility; this surface is exported.
#define LOSSAGG_API __attribute__((visibility("default")))

namespace lossagg {

// Data-dependent input checks (cu_seqlens monotone and ending at T, sample_denoms
// finite and > 0) need the data on the host. On the CPU they always run. On CUDA they
// would cost a device-to-host copy and a sync, so they are off unless enabled here or
// with the environment variable LOSSAGG_CHECK_INPUTS=1 at load time.
LOSSAGG_API void set_device_checks(bool enabled);
LOSSAGG_API bool device_checks_enabled();

// True when the library was compiled with its CUDA kernels.
LOSSAGG_API bool built_with_cuda();

// The vector instruction set of the CPU kernels: "avx512", "avx2" or "baseline". The
// widest the CPU supports is used, capped by LOSSAGG_CPU_ISA at load time or by
// set_cpu_isa ("auto" removes the cap). Results are bitwise the same on every one.
LOSSAGG_API std::string cpu_isa();
LOSSAGG_API std::string cpu_best_isa();
LOSSAGG_API void set_cpu_isa(const std::string& name);

}  // namespace lossagg
