// The real Device of launch.cuh: the current CUDA stream, workspaces from torch's caching
// allocator (stream-ordered, so they may be released once the launches are enqueued),
// and no host synchronisation. Reached through the stable ABI: tensors from
// torch::stable::new_empty, the stream from the C shim.
#pragma once

#include "../torch_api.h"

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

namespace lossagg::cuda {

inline void check_cuda(cudaError_t status, const char* what) {
  LOSSAGG_CHECK(status == cudaSuccess, "lossagg: CUDA error in ", what, ": ", cudaGetErrorString(status));
}

// The device the tensors live on is current for the call (the device guard), and its
// current stream is the one torch enqueues on.
class CudaDevice {
 public:
  explicit CudaDevice(const Tensor& like) : like_(like), guard_(like.get_device_index()) {
    void* stream = nullptr;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(like.get_device_index(), &stream));
    stream_ = static_cast<cudaStream_t>(stream);
  }

  void* workspace(int64_t bytes) {
    buffers_.push_back(new_tensor(like_, {std::max<int64_t>(bytes, 1)}, ScalarType::Byte));
    return buffers_.back().mutable_data_ptr();
  }

  void zero(void* p, size_t bytes) { check_cuda(cudaMemsetAsync(p, 0, bytes, stream_), "cudaMemsetAsync"); }

  template <typename... KernelArgs, typename... Args>
  void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, Args... args) {
    kernel<<<grid, block, 0, stream_>>>(static_cast<KernelArgs>(args)...);
    check_cuda(cudaGetLastError(), "a kernel launch");
  }

 private:
  Tensor like_;
  torch::stable::accelerator::DeviceGuard guard_;
  cudaStream_t stream_ = nullptr;
  std::vector<Tensor> buffers_;
};

}  // namespace lossagg::cuda
