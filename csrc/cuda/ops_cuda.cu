// The CUDA kernels of every lossagg op, registered in one place. Checks, layouts and
// dispatch are shared with the CPU (op_setup.h); launches go through launch.cuh on the
// current stream; nothing here synchronises with the host.
#include "../op_setup.h"
#include "../torch_api.h"
#include "cuda_device.cuh"
#include "launch.cuh"

#include <tuple>
#include <vector>

namespace lossagg::cuda {
namespace {

Tensor segment_sum(const TokenCall& call, ScalarType values_dtype) {
  Tensor out = call.new_segment_sums(values_dtype);
  if (out.numel() == 0) {
    return out;
  }
  CudaDevice dev(*call.values);
  call.dispatch(values_dtype, [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    launch_segment_sum<acc_t>(
        dev, call.layout, call.segments(), call.values->const_data_ptr<S>(), call.mask_data<M>(), out.mutable_data_ptr<acc_t>());
  });
  return out;
}

// The sums and the kept tokens of each segment from the same two launches.
std::tuple<Tensor, Tensor> segment_sum_and_count(
    const TokenCall& call, ScalarType values_dtype, const Tensor& mask, const std::optional<Tensor>& cu_seqlens) {
  Tensor out = call.new_segment_sums(values_dtype);
  Tensor counts = new_tensor(mask, {call.layout.num_segments}, ScalarType::Long);
  if (out.numel() == 0) {
    return {out, counts};
  }
  CudaDevice dev(*call.values);
  call.dispatch(values_dtype, [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    launch_segment_sum_and_count<acc_t>(
        dev, call.layout, call.segments(), call.values->const_data_ptr<S>(), call.mask_data<M>(), out.mutable_data_ptr<acc_t>(),
        counts.mutable_data_ptr<int64_t>());
  });
  if (counts_need_own_pass(mask, values_dtype)) {
    // the counts of the float64 mask as given (op_setup.h): the same kernel over (mask, mask),
    // float64 both, its sums discarded
    const TokenCall own = segment_sum_args(mask, mask, cu_seqlens, /*counting=*/true);
    Tensor scratch = own.new_segment_sums(ScalarType::Double);
    launch_segment_sum_and_count<double>(
        dev, own.layout, own.segments(), own.values->const_data_ptr<double>(), own.mask_data<double>(), scratch.mutable_data_ptr<double>(),
        counts.mutable_data_ptr<int64_t>());
  }
  return {out, counts};
}

// Two launches: the tile pass, and the fix-up with the final fixed-order combine.
Tensor reduce(const ReduceArgs& args, ScalarType values_dtype) {
  const TokenCall& call = args.call;
  const Tensor& d = args.denoms;
  Tensor out = new_tensor(*call.values, {}, acc_scalar_type(values_dtype));
  CudaDevice dev(*call.values);
  call.dispatch(values_dtype, [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    launch_reduce<acc_t>(
        dev, call.layout, call.segments(), call.values->const_data_ptr<S>(), call.mask_data<M>(), d.const_data_ptr<acc_t>(),
        out.mutable_data_ptr<acc_t>());
  });
  return out;
}

Tensor segment_sum_backward(const BackwardArgs& args, ScalarType values_dtype) {
  const TokenCall& call = args.call;
  const Tensor& g = args.grad;
  Tensor out = call.new_token_grad(values_dtype);
  CudaDevice dev(call.mask);
  call.dispatch(values_dtype, [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    launch_expand<S, acc_t>(
        dev, call.layout, call.segments(), out.mutable_data_ptr<S>(), call.mask_data<M>(),
        segment_grad(g.const_data_ptr<acc_t>(), call.layout.num_segments));
  });
  return out;
}

// One launch; the incoming gradient is read on the device.
Tensor reduce_backward(const BackwardArgs& args, ScalarType values_dtype) {
  const TokenCall& call = args.call;
  const Tensor& g = args.grad;
  const Tensor& d = *args.denoms;
  Tensor out = call.new_token_grad(values_dtype);
  CudaDevice dev(call.mask);
  call.dispatch(values_dtype, [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    launch_expand<S, acc_t>(
        dev, call.layout, call.segments(), out.mutable_data_ptr<S>(), call.mask_data<M>(),
        grad_over_denom(g.const_data_ptr<acc_t>(), d.const_data_ptr<acc_t>()));
  });
  return out;
}

// The whole loss of K terms: per chunk of kMaxTermRows terms, the tile pass over the chunk's
// values read where they lie (one read of the mask), the fix-up and the chunk's totals
// (launch_reduce_terms). The coefficients travel as kernel parameters: no host sync.
std::tuple<Tensor, Tensor> reduce_terms(const TermsArgs& terms) {
  const std::vector<double>& coefficients = terms.coefficients;
  const Tensor& first = terms.rows[0];
  const ScalarType values_dtype = terms.values_dtype;
  const ScalarType acc_dtype = acc_scalar_type(values_dtype);
  const Tensor& d = terms.denoms;
  const std::optional<Tensor>& w = terms.weights;
  Tensor out = new_tensor(first, {}, acc_dtype);
  Tensor parts = new_tensor(first, {terms.call.layout.num_metrics}, acc_dtype);
  CudaDevice dev(first);
  terms.call.dispatch(values_dtype, [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    std::vector<const S*> rows;
    for (const void* p : terms.row_data) {
      rows.push_back(static_cast<const S*>(p));
    }
    launch_reduce_terms<acc_t>(
        dev, terms.call.layout, terms.call.segments(), rows.data(), terms.call.mask_data<M>(), d.const_data_ptr<acc_t>(),
        w.has_value() ? w->const_data_ptr<acc_t>() : static_cast<const acc_t*>(nullptr), coefficients.data(), parts.mutable_data_ptr<acc_t>(),
        out.mutable_data_ptr<acc_t>());
  });
  return {out, parts};
}

// One launch per chunk of kMaxTermRows terms; the incoming gradient is read on the device.
std::vector<Tensor> reduce_terms_backward(const TermsArgs& terms) {
  const std::vector<double>& coefficients = terms.coefficients;
  const ScalarType values_dtype = terms.values_dtype;
  const TokenCall& call = terms.call;
  const Tensor& d = terms.denoms;
  const std::optional<Tensor>& w = terms.weights;
  const Tensor& g = *terms.grad;
  std::vector<Tensor> out = new_term_grads(call, values_dtype);
  CudaDevice dev(call.mask);
  call.dispatch(values_dtype, [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    std::vector<S*> rows;
    for (Tensor& t : out) {
      rows.push_back(t.mutable_data_ptr<S>());
    }
    launch_reduce_terms_backward<S, acc_t>(
        dev, call.layout, call.segments(), rows.data(), call.mask_data<M>(), g.const_data_ptr<acc_t>(), d.const_data_ptr<acc_t>(),
        w.has_value() ? w->const_data_ptr<acc_t>() : static_cast<const acc_t*>(nullptr), coefficients.data());
  });
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(lossagg, CUDA, m) {
  m.impl("segment_sum", TORCH_BOX(&segment_sum_op<&segment_sum>));
  m.impl("segment_sum_and_count", TORCH_BOX(&segment_sum_and_count_op<&segment_sum_and_count>));
  m.impl("segment_sum_backward", TORCH_BOX(&segment_sum_backward_op<&segment_sum_backward>));
  m.impl("reduce", TORCH_BOX(&reduce_op<&reduce>));
  m.impl("reduce_backward", TORCH_BOX(&reduce_backward_op<&reduce_backward>));
  m.impl("reduce_terms", TORCH_BOX(&reduce_terms_op<&reduce_terms>));
  m.impl("reduce_terms_backward", TORCH_BOX(&reduce_terms_backward_op<&reduce_terms_backward>));
}

}  // namespace lossagg::cuda
