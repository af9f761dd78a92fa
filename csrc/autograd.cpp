// Autograd for lossagg::reduce and lossagg::segment_sum, registered in C++ under the
// Autograd key: libtorch users get gradients too, and a training step pays no Python
// round trip per micro-batch. The backward of each op is itself a registered op
// (reduce_backward, segment_sum_backward) with its own kernels and fake.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>

namespace lossagg {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const at::Tensor& or_undefined(const std::optional<at::Tensor>& t) {
  static const at::Tensor undefined;
  return t.has_value() ? *t : undefined;
}

std::optional<at::Tensor> optional_if_defined(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

class ReduceFunction : public torch::autograd::Function<ReduceFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& values,
      const at::Tensor& mask,
      const std::optional<at::Tensor>& cu_seqlens,
      const at::Tensor& sample_denoms) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("lossagg::reduce", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&)>();
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({mask, or_undefined(cu_seqlens), sample_denoms});
    ctx->saved_data["values_dtype"] = static_cast<int64_t>(values.scalar_type());
    return op.call(values, mask, cu_seqlens, sample_denoms);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("lossagg::reduce_backward", "")
                         .typed<at::Tensor(
                             const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                             at::ScalarType)>();
    const variable_list saved = ctx->get_saved_variables();
    at::Tensor grad_values;
    if (ctx->needs_input_grad(0)) {
      const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["values_dtype"].toInt());
      grad_values = op.call(grad_outputs[0], saved[0], optional_if_defined(saved[1]), saved[2], dtype);
    }
    return {grad_values, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class SegmentSumFunction : public torch::autograd::Function<SegmentSumFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& values,
      const at::Tensor& mask,
      const std::optional<at::Tensor>& cu_seqlens) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("lossagg::segment_sum", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({mask, or_undefined(cu_seqlens)});
    ctx->saved_data["values_dtype"] = static_cast<int64_t>(values.scalar_type());
    return op.call(values, mask, cu_seqlens);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("lossagg::segment_sum_backward", "")
                         .typed<at::Tensor(
                             const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::ScalarType)>();
    const variable_list saved = ctx->get_saved_variables();
    at::Tensor grad_values;
    if (ctx->needs_input_grad(0)) {
      const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["values_dtype"].toInt());
      grad_values = op.call(grad_outputs[0].contiguous(), saved[0], optional_if_defined(saved[1]), dtype);
    }
    return {grad_values, at::Tensor(), at::Tensor()};
  }
};

at::Tensor reduce_autograd(
    const at::Tensor& values,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms) {
  return ReduceFunction::apply(values, mask, cu_seqlens, sample_denoms);
}

at::Tensor segment_sum_autograd(
    const at::Tensor& values,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens) {
  return SegmentSumFunction::apply(values, mask, cu_seqlens);
}

}  // namespace

TORCH_LIBRARY_IMPL(lossagg, Autograd, m) {
  m.impl("reduce", &reduce_autograd);
  m.impl("segment_sum", &segment_sum_autograd);
}

}  // namespace lossagg
