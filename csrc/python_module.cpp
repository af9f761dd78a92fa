// The Python extension module lossagg._C. Loading it registers the ops (the TORCH_LIBRARY
// blocks are linked into the same shared object); it exposes build facts and the switch
// for device-side data checks.
#include "lossagg.h"

#include <torch/version.h>

#include <pybind11/pybind11.h>

PYBIND11_MODULE(_C, m) {
  m.doc() = "lossagg native library: segmented loss reductions as torch.ops.lossagg.*";
  m.def("built_with_cuda", &lossagg::built_with_cuda, "True when the CUDA kernels were compiled in.");
  m.def(
      "set_device_checks", &lossagg::set_device_checks, pybind11::arg("enabled"),
      "Enable the data checks that need a device-to-host copy on CUDA.");
  m.def("device_checks_enabled", &lossagg::device_checks_enabled);
  m.def("cpu_isa", &lossagg::cpu_isa, "Vector ISA the CPU kernels use now: avx512, avx2 or baseline.");
  m.def("cpu_best_isa", &lossagg::cpu_best_isa, "Widest vector ISA this CPU supports for the CPU kernels.");
  m.def("set_cpu_isa", &lossagg::set_cpu_isa, pybind11::arg("isa"), "Cap the CPU kernels' vector ISA (auto, avx512, avx2, baseline).");
  m.attr("torch_version") = TORCH_VERSION;
}
