// The real Device of launch.cuh: the current CUDA stream, workspaces from the caching
// allocator (stream-ordered, so they may be released once the launches are enqueued),
// and no host synchronisation.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <vector>

namespace lossagg::cuda {

class CudaDevice {
 public:
  explicit CudaDevice(const at::TensorOptions& options)
      : options_(options.dtype(at::kByte)), stream_(c10::cuda::getCurrentCUDAStream()) {}

  void* workspace(int64_t bytes) {
    buffers_.push_back(at::empty({std::max<int64_t>(bytes, 1)}, options_));
    return buffers_.back().mutable_data_ptr();
  }

  void zero(void* p, size_t bytes) {
    C10_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
  }

  template <typename... KernelArgs, typename... Args>
  void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, Args... args) {
    kernel<<<grid, block, 0, stream_>>>(static_cast<KernelArgs>(args)...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

 private:
  at::TensorOptions options_;
  cudaStream_t stream_;
  std::vector<at::Tensor> buffers_;
};

}  // namespace lossagg::cuda
