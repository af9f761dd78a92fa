// Autograd for the lossagg ops, registered in C++ under the
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

// The ops are differentiable in values (and the backward ops in grad) only: a gradient
// asked of the mask or the denominators is refused, never silently left at None.
void check_not_differentiable(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(
      !t.defined() || !t.requires_grad(), "lossagg.", op, ": not differentiable in ", name, ", which requires grad; pass ",
      name, ".detach() (the gradient flows to values only)");
}

at::Tensor call_reduce(const at::Tensor& values, const at::Tensor& mask, const std::optional<at::Tensor>& cu, const at::Tensor& d) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lossagg::reduce", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&)>();
  return op.call(values, mask, cu, d);
}

at::Tensor call_segment_sum(const at::Tensor& values, const at::Tensor& mask, const std::optional<at::Tensor>& cu) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lossagg::segment_sum", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op.call(values, mask, cu);
}

at::Tensor call_reduce_backward(
    const at::Tensor& grad, const at::Tensor& mask, const std::optional<at::Tensor>& cu, const at::Tensor& d, at::ScalarType dtype) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lossagg::reduce_backward", "")
                       .typed<at::Tensor(
                           const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, at::ScalarType)>();
  return op.call(grad, mask, cu, d, dtype);
}

at::Tensor call_segment_sum_backward(
    const at::Tensor& grad, const at::Tensor& mask, const std::optional<at::Tensor>& cu, at::ScalarType dtype) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("lossagg::segment_sum_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::ScalarType)>();
  return op.call(grad, mask, cu, dtype);
}

class ReduceFunction : public torch::autograd::Function<ReduceFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& values,
      const at::Tensor& mask,
      const std::optional<at::Tensor>& cu_seqlens,
      const at::Tensor& sample_denoms) {
    check_not_differentiable("reduce", mask, "mask");
    check_not_differentiable("reduce", sample_denoms, "sample_denoms");
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({mask, or_undefined(cu_seqlens), sample_denoms});
    ctx->saved_data["values_dtype"] = static_cast<int64_t>(values.scalar_type());
    return call_reduce(values, mask, cu_seqlens, sample_denoms);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    at::Tensor grad_values;
    if (ctx->needs_input_grad(0)) {
      const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["values_dtype"].toInt());
      grad_values = call_reduce_backward(grad_outputs[0], saved[0], optional_if_defined(saved[1]), saved[2], dtype);
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
    check_not_differentiable("segment_sum", mask, "mask");
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({mask, or_undefined(cu_seqlens)});
    ctx->saved_data["values_dtype"] = static_cast<int64_t>(values.scalar_type());
    return call_segment_sum(values, mask, cu_seqlens);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    at::Tensor grad_values;
    if (ctx->needs_input_grad(0)) {
      const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["values_dtype"].toInt());
      grad_values = call_segment_sum_backward(grad_outputs[0].contiguous(), saved[0], optional_if_defined(saved[1]), dtype);
    }
    return {grad_values, at::Tensor(), at::Tensor()};
  }
};

// reduce_backward(grad) = grad * mask[t] / d[s(t)] is linear in grad: its gradient in grad
// is reduce(upstream, mask, d). This makes double backward exact (the second derivative of
// reduce in values is 0; the derivative of its gradient in the incoming grad is not).
class ReduceBackwardFunction : public torch::autograd::Function<ReduceBackwardFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& grad,
      const at::Tensor& mask,
      const std::optional<at::Tensor>& cu_seqlens,
      const at::Tensor& sample_denoms,
      at::ScalarType values_dtype) {
    check_not_differentiable("reduce_backward", mask, "mask");
    check_not_differentiable("reduce_backward", sample_denoms, "sample_denoms");
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({mask, or_undefined(cu_seqlens), sample_denoms});
    ctx->saved_data["grad_dtype"] = static_cast<int64_t>(grad.scalar_type());
    return call_reduce_backward(grad, mask, cu_seqlens, sample_denoms, values_dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    at::Tensor grad_grad;
    if (ctx->needs_input_grad(0)) {
      const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["grad_dtype"].toInt());
      grad_grad = call_reduce(grad_outputs[0], saved[0], optional_if_defined(saved[1]), saved[2]).to(dtype);
    }
    return {grad_grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// segment_sum_backward(grad) broadcasts grad [K, B] to tokens: its gradient in grad is
// segment_sum(upstream, mask).
class SegmentSumBackwardFunction : public torch::autograd::Function<SegmentSumBackwardFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& grad,
      const at::Tensor& mask,
      const std::optional<at::Tensor>& cu_seqlens,
      at::ScalarType values_dtype) {
    check_not_differentiable("segment_sum_backward", mask, "mask");
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({mask, or_undefined(cu_seqlens)});
    ctx->saved_data["grad_dtype"] = static_cast<int64_t>(grad.scalar_type());
    return call_segment_sum_backward(grad, mask, cu_seqlens, values_dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    at::Tensor grad_grad;
    if (ctx->needs_input_grad(0)) {
      const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["grad_dtype"].toInt());
      grad_grad = call_segment_sum(grad_outputs[0].contiguous(), saved[0], optional_if_defined(saved[1])).to(dtype);
    }
    return {grad_grad, at::Tensor(), at::Tensor(), at::Tensor()};
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

at::Tensor reduce_backward_autograd(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms,
    at::ScalarType values_dtype) {
  return ReduceBackwardFunction::apply(grad, mask, cu_seqlens, sample_denoms, values_dtype);
}

at::Tensor segment_sum_backward_autograd(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    at::ScalarType values_dtype) {
  return SegmentSumBackwardFunction::apply(grad, mask, cu_seqlens, values_dtype);
}

TORCH_LIBRARY_IMPL(lossagg, Autograd, m) {
  m.impl("reduce", &reduce_autograd);
  m.impl("segment_sum", &segment_sum_autograd);
  m.impl("reduce_backward", &reduce_backward_autograd);
  m.impl("segment_sum_backward", &segment_sum_backward_autograd);
}

}  // namespace lossagg
