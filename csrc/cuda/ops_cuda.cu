// The CUDA kernels of every lossagg op, registered in one place. Checks, layouts and
// dispatch are shared with the CPU (op_setup.h); launches go through launch.cuh on the
// current stream; nothing here synchronises with the host.
#include "../op_setup.h"
#include "cuda_device.cuh"
#include "launch.cuh"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace lossagg::cuda {
namespace {

at::Tensor segment_sum(const at::Tensor& values, const at::Tensor& mask, const std::optional<at::Tensor>& cu_seqlens) {
  const TokenCall call = segment_sum_call(values, mask, cu_seqlens);
  const c10::cuda::CUDAGuard guard(values.device());
  at::Tensor out = call.new_segment_sums(values.scalar_type());
  if (out.numel() == 0) {
    return out;
  }
  CudaDevice dev(values.options());
  call.dispatch(values.scalar_type(), [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    launch_segment_sum<acc_t>(
        dev, call.layout, call.segments(), call.values.const_data_ptr<S>(), call.mask_data<M>(), out.mutable_data_ptr<acc_t>());
  });
  return out;
}

// Two launches: the tile pass, and the fix-up with the final fixed-order combine.
at::Tensor reduce(
    const at::Tensor& values,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms) {
  const TokenCall call = reduce_call(values, mask, cu_seqlens, sample_denoms);
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor d = kernel_denoms(sample_denoms, values.scalar_type());
  at::Tensor out = at::empty({}, values.options().dtype(acc_scalar_type(values.scalar_type())));
  CudaDevice dev(values.options());
  call.dispatch(values.scalar_type(), [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    launch_reduce<acc_t>(
        dev, call.layout, call.segments(), call.values.const_data_ptr<S>(), call.mask_data<M>(), d.const_data_ptr<acc_t>(),
        out.mutable_data_ptr<acc_t>());
  });
  return out;
}

at::Tensor segment_sum_backward(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    at::ScalarType values_dtype) {
  const TokenCall call = segment_sum_backward_call(grad, mask, cu_seqlens, values_dtype);
  const c10::cuda::CUDAGuard guard(mask.device());
  at::Tensor out = call.new_token_grad(values_dtype);
  const at::Tensor g = grad.to(acc_scalar_type(values_dtype)).contiguous();
  CudaDevice dev(mask.options());
  call.dispatch(values_dtype, [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    launch_expand<S, acc_t>(
        dev, call.layout, call.segments(), out.mutable_data_ptr<S>(), call.mask_data<M>(),
        SegmentGrad<acc_t>{g.const_data_ptr<acc_t>(), call.layout.num_segments});
  });
  return out;
}

// One launch; the incoming gradient is read on the device.
at::Tensor reduce_backward(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms,
    at::ScalarType values_dtype) {
  const TokenCall call = reduce_backward_call(grad, mask, cu_seqlens, sample_denoms, values_dtype);
  const c10::cuda::CUDAGuard guard(mask.device());
  const at::Tensor d = kernel_denoms(sample_denoms, values_dtype);
  at::Tensor out = call.new_token_grad(values_dtype);
  const at::Tensor g = grad.to(acc_scalar_type(values_dtype)).contiguous();
  CudaDevice dev(mask.options());
  call.dispatch(values_dtype, [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    launch_expand<S, acc_t>(
        dev, call.layout, call.segments(), out.mutable_data_ptr<S>(), call.mask_data<M>(),
        GradOverDenom<acc_t>{g.const_data_ptr<acc_t>(), d.const_data_ptr<acc_t>()});
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lossagg, CUDA, m) {
  m.impl("segment_sum", &segment_sum);
  m.impl("segment_sum_backward", &segment_sum_backward);
  m.impl("reduce", &reduce);
  m.impl("reduce_backward", &reduce_backward);
}

}  // namespace lossagg::cuda
