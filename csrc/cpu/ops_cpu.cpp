// The CPU kernels of every lossagg op, registered in one place. Checks, conversions to
// kernel types and dispatch are shared with CUDA (op_setup.h); the loops are the engine
// (engine.h), whose instruction set is chosen once per op.
#include "../op_setup.h"
#include "engine.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

namespace lossagg::cpu {
namespace {

KernelArgs kernel_args(const TokenCall& call, c10::ScalarType values_dtype) {
  return KernelArgs{
      call.values.defined() ? call.values.const_data_ptr() : nullptr, values_dtype, call.mask.const_data_ptr(), call.mask_kind, call.layout,
      call.segments()};
}

const Engine& engine() {
  const std::string& problem = isa_env_problem();
  TORCH_CHECK_VALUE(problem.empty(), problem);
  return engine_for(active_isa());
}

// sum_s x[s] / d[s] in a fixed order: lane l takes s = l, l + kLanes, ...; lanes are
// combined pairwise as in the engine's sums. Depends only on the input.
template <typename acc_t>
acc_t weighted_total(const acc_t* x, const acc_t* d, int64_t n) {
  constexpr int kLanes = 32;
  acc_t lane[kLanes] = {};
  int64_t s = 0;
  for (; s + kLanes <= n; s += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      lane[l] += x[s + l] / d[s + l];
    }
  }
  for (; s < n; ++s) {
    lane[0] += x[s] / d[s];
  }
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) {
      lane[l] += lane[l + width];
    }
  }
  return lane[0];
}

at::Tensor segment_sum(const at::Tensor& values, const at::Tensor& mask, const std::optional<at::Tensor>& cu_seqlens) {
  const TokenCall call = segment_sum_call(values, mask, cu_seqlens);
  at::Tensor out = call.new_segment_sums(values.scalar_type());
  engine().segment_sums(kernel_args(call, values.scalar_type()), out.mutable_data_ptr());
  return out;
}

// sum_i segment_sum[i] / sample_denoms[i], samples added in a fixed order (weighted_total):
// deterministic whatever the thread count or instruction set.
at::Tensor reduce(
    const at::Tensor& values,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms) {
  const TokenCall call = reduce_call(values, mask, cu_seqlens, sample_denoms);
  const at::ScalarType acc_dtype = acc_scalar_type(values.scalar_type());
  const at::Tensor denoms = kernel_denoms(sample_denoms, values.scalar_type());
  at::Tensor sums = at::empty({call.layout.num_segments}, values.options().dtype(acc_dtype));
  engine().segment_sums(kernel_args(call, values.scalar_type()), sums.mutable_data_ptr());
  at::Tensor out = at::empty({}, values.options().dtype(acc_dtype));
  dispatch_values(acc_dtype, "values", [&]<typename A>(type_tag<A>) {
    *out.mutable_data_ptr<A>() = weighted_total(sums.const_data_ptr<A>(), denoms.const_data_ptr<A>(), call.layout.num_segments);
  });
  return out;
}

// Each segment's gradient broadcast to its tokens, weighted by the mask.
at::Tensor segment_sum_backward(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    at::ScalarType values_dtype) {
  const TokenCall call = segment_sum_backward_call(grad, mask, cu_seqlens, values_dtype);
  at::Tensor out = call.new_token_grad(values_dtype);
  const at::Tensor g = grad.to(acc_scalar_type(values_dtype)).contiguous();
  engine().expand_to_tokens(kernel_args(call, values_dtype), g.const_data_ptr(), out.mutable_data_ptr());
  return out;
}

// d reduce / d values[t] = grad * mask[t] / sample_denoms[s(t)].
at::Tensor reduce_backward(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms,
    at::ScalarType values_dtype) {
  const TokenCall call = reduce_backward_call(grad, mask, cu_seqlens, sample_denoms, values_dtype);
  at::Tensor out = call.new_token_grad(values_dtype);
  const at::ScalarType acc_dtype = acc_scalar_type(values_dtype);
  const at::Tensor denoms = kernel_denoms(sample_denoms, values_dtype);
  // one coefficient per sample, g / d[s] in the accumulation dtype
  at::Tensor coef = at::empty({call.layout.num_segments}, denoms.options());
  dispatch_values(acc_dtype, "values", [&]<typename A>(type_tag<A>) {
    const A g = grad.to(acc_dtype).item<A>();
    const A* d = denoms.const_data_ptr<A>();
    A* c = coef.mutable_data_ptr<A>();
    for (int64_t s = 0; s < call.layout.num_segments; ++s) {
      c[s] = g / d[s];
    }
  });
  engine().expand_to_tokens(kernel_args(call, values_dtype), coef.const_data_ptr(), out.mutable_data_ptr());
  return out;
}

at::Tensor token_counts(const at::Tensor& mask, const std::optional<at::Tensor>& cu_seqlens) {
  const TokenCall call = token_counts_call(mask, cu_seqlens);
  at::Tensor out = at::empty({call.layout.num_segments}, mask.options().dtype(at::kLong));
  engine().count_kept(kernel_args(call, at::kFloat), out.mutable_data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lossagg, CPU, m) {
  m.impl("token_counts", &token_counts);
  m.impl("segment_sum", &segment_sum);
  m.impl("segment_sum_backward", &segment_sum_backward);
  m.impl("reduce", &reduce);
  m.impl("reduce_backward", &reduce_backward);
}

}  // namespace lossagg::cpu
