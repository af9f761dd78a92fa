// C++ check of the ops through the dispatcher, as a libtorch user calls them: the forward
// ops and their backward ops (autograd is registered in Python, lossagg/ops.py).
#include "lossagg.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "ok  " : "FAIL", what.c_str());
  failures += ok ? 0 : 1;
}

}  // namespace

int main() {
  auto reduce = c10::Dispatcher::singleton()
                    .findSchemaOrThrow("lossagg::reduce", "")
                    .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&)>();
  auto segment_sum = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("lossagg::segment_sum", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();

  // Two samples: tokens [1, 2, nan(masked)] and [4, 5]; denominators 2 and 4.
  at::Tensor values = at::tensor({1.0f, 2.0f, NAN, 4.0f, 5.0f});
  at::Tensor mask = at::tensor({1, 1, 0, 1, 1}, at::kInt).to(at::kBool);
  at::Tensor cu = at::tensor({0, 3, 5}, at::kInt);
  at::Tensor denoms = at::tensor({2.0f, 4.0f});

  at::Tensor sums = segment_sum.call(values, mask, cu);
  expect(sums.size(0) == 2 && sums[0].item<float>() == 3.0f && sums[1].item<float>() == 9.0f, "segment_sum packed");

  const float j = reduce.call(values, mask, cu, denoms).item<float>();
  expect(std::fabs(j - (3.0f / 2.0f + 9.0f / 4.0f)) < 1e-6f, "reduce packed = 3/2 + 9/4");

  at::Tensor padded = at::tensor({1.0f, 2.0f, 3.0f, 4.0f}).reshape({2, 2});
  at::Tensor padded_mask = at::ones({2, 2}, at::kByte);
  const float jp = reduce.call(padded, padded_mask, std::nullopt, at::tensor({1.0f, 7.0f})).item<float>();
  expect(std::fabs(jp - (3.0f + 1.0f)) < 1e-6f, "reduce padded");

  // The gradient a libtorch user computes with the backward op: grad * mask / d[i].
  auto reduce_backward =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("lossagg::reduce_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, at::ScalarType)>();
  const at::Tensor grad = reduce_backward.call(at::scalar_tensor(1.0f), mask, cu, denoms, at::kFloat);
  const at::Tensor expected_grad = at::tensor({0.5f, 0.5f, 0.0f, 0.25f, 0.25f});
  expect(at::equal(grad, expected_grad), "reduce_backward: grad = mask / d[i]");

  bool raised = false;
  try {
    reduce.call(values, mask, at::tensor({0, 3, 4}, at::kInt), denoms);
  } catch (const std::exception& e) {  // the kernel's std::runtime_error (Python sees a RuntimeError)
    raised = std::string(e.what()).find("ValueError: lossagg.reduce: cu_seqlens[-1]") != std::string::npos;
  }
  expect(raised, "bad cu_seqlens raises an error naming cu_seqlens[-1]");

  std::printf("built_with_cuda = %s\n", lossagg::built_with_cuda() ? "true" : "false");
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
