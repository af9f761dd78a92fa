// lossagg::reduce_backward on CUDA: grad * mask[t] / sample_denoms[s(t)], one launch.
// The incoming gradient is read on the device: no host synchronisation.
#include "../checks.h"
#include "launch.cuh"

#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace lossagg::cuda {
namespace {

template <typename acc_t, typename denom_t>
struct GradOverDenom {
  const acc_t* grad;
  const denom_t* denoms;
  __device__ acc_t operator()(int64_t, int64_t s) const {
    return *grad / static_cast<acc_t>(denoms[s]);
  }
};

at::Tensor reduce_backward(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms,
    at::ScalarType values_dtype) {
  const TokenLayout layout = check_reduce_backward_inputs(grad, mask, cu_seqlens, sample_denoms);
  const c10::cuda::CUDAGuard guard(mask.device());

  const at::Tensor m = mask.contiguous();
  const at::Tensor d = sample_denoms.contiguous();
  const std::optional<at::Tensor> cu = contiguous_offsets(cu_seqlens);
  at::Tensor out = at::empty(mask.sizes(), mask.options().dtype(values_dtype));

  dispatch_values_dtype(values_dtype, [&]<typename S>(type_tag<S>) {
    using acc_t = acc_t_of<S>;
    const at::Tensor g = grad.to(acc_scalar_type(values_dtype)).contiguous();
    dispatch_float_dtype(d.scalar_type(), "sample_denoms", [&]<typename D>(type_tag<D>) {
      dispatch_mask_dtype(m.scalar_type(), [&]<typename M>(type_tag<M>) {
        dispatch_segments(cu, layout.row_len, [&](auto seg) {
          launch_expand<S, acc_t>(
              out.mutable_data_ptr<S>(), static_cast<const M*>(m.const_data_ptr()), seg, layout.num_segments,
              layout.num_tokens, 1, GradOverDenom<acc_t, D>{g.const_data_ptr<acc_t>(), d.const_data_ptr<D>()});
        });
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lossagg, CUDA, m) {
  m.impl("reduce_backward", &reduce_backward);
}

}  // namespace lossagg::cuda
