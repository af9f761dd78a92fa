// Every lossagg op schema, in one place. Each backend registers its kernels in one file
// (csrc/cpu/ops_cpu.cpp, csrc/cuda/ops_cuda.cu); autograd and the fake kernels are
// registered in Python (lossagg/ops.py), over the backward ops defined here.
#include "torch_api.h"

STABLE_TORCH_LIBRARY(lossagg, m) {
  // Per-segment masked sums: [T] or [K, T] packed (with cu_seqlens), [B, T] or [K, B, T]
  // padded -> [B] or [K, B]; float32 (float64 for float64 values).
  m.def("segment_sum(Tensor values, Tensor mask, Tensor? cu_seqlens) -> Tensor");
  // segment_sum and token_counts from one read of values and mask, values [T] or [B, T] as
  // for reduce: (sums [B], kept tokens int64 [B]). Not differentiable: lossagg.aggregate
  // uses it (lossagg/aggregate.py).
  m.def("segment_sum_and_count(Tensor values, Tensor mask, Tensor? cu_seqlens) -> (Tensor, Tensor)");
  // J of a mode whose d[i] is a product of step totals and M[i] (csrc/denom_program.h), the
  // batch being the whole step: sums, counts, d and J from one read of values and mask, values
  // [T] or [B, T] as for reduce -> (J 0-dim, d float64 [B]). J has the bits of reduce with that
  // d; its gradient is reduce_backward with d (registered in lossagg/ops.py). lossagg.aggregate
  // calls it (lossagg/aggregate.py, the one-pass route). denom_program is the list of factor
  // codes (csrc/denom_program.h, lossagg/denom_program.py). CPU kernel; other devices in
  // lossagg/ops.py.
  m.def("aggregate(Tensor values, Tensor mask, Tensor? cu_seqlens, int[] denom_program, float divisor) -> (Tensor, Tensor)");
  // aggregate for a one-process step whose d[i] is a plan's product, prompt groups and sessions included: sums,
  // counts, d and J from one read of values and mask, d by the plan's own passes over the counts and the labels
  // (int64 [B] or None), the same d as lossagg.StepPlan's; program and divisor are one term's, as plan_totals takes
  // them -> (J 0-dim, d float64 [B]). A step the plan declines raises (lossagg/ops.py then takes the Python route).
  // Gradient as aggregate's. CPU kernel only (csrc/cpu/ops_cpu.cpp).
  m.def(
      "aggregate_planned(Tensor values, Tensor mask, Tensor? cu_seqlens, Tensor? group_index, Tensor? session_index, int per_prompt, "
      "bool check_groups, bool sessions_in_groups, int[] program, float divisor) -> (Tensor, Tensor)");
  // Gradient of segment_sum: grad [B] or [K, B] -> token layout of values.
  m.def("segment_sum_backward(Tensor grad, Tensor mask, Tensor? cu_seqlens, ScalarType values_dtype) -> Tensor");
  // sum_i segment_sum(values)[i] / sample_denoms[i] -> 0-dim tensor.
  m.def("reduce(Tensor values, Tensor mask, Tensor? cu_seqlens, Tensor sample_denoms) -> Tensor");
  // Gradient of reduce in values: grad * mask / sample_denoms[segment of the token].
  m.def(
      "reduce_backward(Tensor grad, Tensor mask, Tensor? cu_seqlens, Tensor sample_denoms, "
      "ScalarType values_dtype) -> Tensor");
  // The whole loss of K terms from one pass over their values and the mask: values is K
  // tensors of one dtype, each [T] or [B, T] as for reduce, read where they lie; sample_denoms
  // [K, B]; sample_weights [K, B] (None: 1); one coefficient per term. Returns
  // (J = sum_k c_k J_k 0-dim, parts [K] with J_k = sum_i w[k, i] S[k, i] / d[k, i]), the terms
  // added in order and each J_k as reduce adds its quotients. parts is not differentiable.
  m.def(
      "reduce_terms(Tensor[] values, Tensor mask, Tensor? cu_seqlens, Tensor sample_denoms, Tensor? sample_weights, "
      "float[] coefficients) -> (Tensor, Tensor)");
  // Gradient of reduce_terms' J in every term's values: out[k][t] = mask[t] * grad * c_k *
  // w[k, s(t)] / d[k, s(t)] -> K tensors of the token shape of mask, in values_dtype.
  m.def(
      "reduce_terms_backward(Tensor grad, Tensor mask, Tensor? cu_seqlens, Tensor sample_denoms, Tensor? sample_weights, "
      "float[] coefficients, ScalarType values_dtype) -> Tensor[]");
  // Tokens of each segment whose mask is non-zero: [T] packed / [B, T] padded -> int64 [B].
  // Not differentiable. CPU kernel in csrc/cpu/ops_cpu.cpp; other devices in lossagg/ops.py.
  m.def("token_counts(Tensor mask, Tensor? cu_seqlens) -> Tensor");
  // The step totals and every term's d[i] of a plan made by one process, from its samples' token counts [N]
  // (int64 or float64) and prompt-group and session labels (int64 [N] or None): [scalars float64 [9] (a status
  // first: 0 or 7 served, else the Python route takes the step), each block [N], the counts [N] (with_counts),
  // d float64 [K, N], d float32 [K, N]], csrc/cpu/plan_totals.cpp. CPU kernel only; lossagg/step.py calls it.
  m.def(
      "plan_totals(Tensor counts, Tensor? group_index, Tensor? session_index, int per_prompt, bool check_groups, "
      "bool sessions_in_groups, int[] blocks, bool with_counts, int[] program, float[] divisors, Tensor? layout=None) -> Tensor[]");
  // The labels' half of plan_totals (their runs, the checks on them) for its layout argument, from a step's labels
  // (int64 [N] each, at least one given) and plan_totals' arguments on them, done before the counts are known (a
  // one-process lossagg.DeferredPlan's, read when it closes). CPU kernel only.
  m.def(
      "plan_layout(Tensor? group_index, Tensor? session_index, int per_prompt, bool check_groups, bool sessions_in_groups, "
      "bool nonempty_read) -> Tensor");
}
