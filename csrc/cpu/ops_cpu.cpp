// The CPU kernels of every lossagg op, registered in one place. Checks, conversions to
// kernel types and dispatch are shared with CUDA (op_setup.h); the loops are the engine
// (engine.h), whose instruction set is chosen once per op.
#include "../denom_program.h"
#include "lanes.h"
#include "../op_setup.h"
#include "../torch_api.h"
#include "engine.h"
#include "plan_totals.h"

#include <optional>
#include <tuple>
#include <vector>

namespace lossagg::cpu {
namespace {

KernelArgs kernel_args(const TokenCall& call, ScalarType values_dtype) {
  return KernelArgs{call.values_data(), values_dtype, call.mask.const_data_ptr(), call.mask_kind, call.layout, call.segments()};
}

const Engine& engine() {
  const std::string& problem = isa_env_problem();
  LOSSAGG_CHECK_VALUE(problem.empty(), problem);
  return engine_for(active_isa());
}

// sum_s x[s] / d[s] in a fixed order: lane l takes s = l, l + kLanes, ...; lanes are
// combined pairwise as in the engine's sums. Depends only on the input.
// d may be float64 for float32 x: each d[s] is then rounded to acc_t as it is read, the one
// rounding kernel_denoms does before reduce's call. Without kDivide, x holds the quotients
// already (a weighted term's, weighted_quotient) and they are added in the same order.
template <typename acc_t, typename d_t, bool kDivide = true>
acc_t weighted_total(const acc_t* x, const d_t* d, int64_t n) {
  const auto quotient = [&](int64_t s) {
    if constexpr (kDivide) {
      return x[s] / static_cast<acc_t>(d[s]);
    } else {
      return x[s];
    }
  };
  acc_t lane[kLanes] = {};
  int64_t s = 0;
  for (; s + kLanes <= n; s += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      lane[l] += quotient(s + l);
    }
  }
  for (; s < n; ++s) {
    lane[0] += quotient(s);
  }
  return combine_lanes(lane);
}

Tensor segment_sum(const TokenCall& call, ScalarType values_dtype) {
  Tensor out = call.new_segment_sums(values_dtype);
  engine().segment_sums(kernel_args(call, values_dtype), out.mutable_data_ptr(), nullptr);
  return out;
}

// segment_sum and token_counts from one read of values and mask ([T] or [B, T] values): the
// sums [B] and the kept tokens [B] (int64) of each segment.
std::tuple<Tensor, Tensor> segment_sum_and_count(
    const TokenCall& call, ScalarType values_dtype, const Tensor& mask, const std::optional<Tensor>& cu_seqlens) {
  Tensor out = call.new_segment_sums(values_dtype);
  Tensor counts = new_tensor(mask, {call.layout.num_segments}, ScalarType::Long);
  const bool own_pass = counts_need_own_pass(mask, values_dtype);
  engine().segment_sums(kernel_args(call, values_dtype), out.mutable_data_ptr(), own_pass ? nullptr : counts.mutable_data_ptr<int64_t>());
  if (own_pass) {
    engine().count_kept(kernel_args(token_counts_args(mask, cu_seqlens), ScalarType::Float), counts.mutable_data_ptr<int64_t>());
  }
  return {out, counts};
}

// sum_i segment_sum[i] / sample_denoms[i], samples added in a fixed order (weighted_total):
// deterministic whatever the thread count or instruction set.
Tensor reduce(const ReduceArgs& args, ScalarType values_dtype) {
  const TokenCall& call = args.call;
  const Tensor& denoms = args.denoms;
  const ScalarType acc_dtype = acc_scalar_type(values_dtype);
  const int64_t b = call.layout.num_segments;
  Tensor sums = new_tensor(*call.values, {b}, acc_dtype);
  engine().segment_sums(kernel_args(call, values_dtype), sums.mutable_data_ptr(), nullptr);
  Tensor out = new_tensor(*call.values, {}, acc_dtype);
  dispatch_values(acc_dtype, "values", [&]<typename A>(type_tag<A>) {
    *out.mutable_data_ptr<A>() = weighted_total(sums.const_data_ptr<A>(), denoms.const_data_ptr<A>(), b);
  });
  return out;
}

// The engine's sums [B] (accumulation dtype) and each segment's kept tokens into `counts`, from one read of values
// and mask (and one more of the mask for the rare pair of dtypes counts_need_own_pass names).
Tensor sums_and_counts(const TokenCall& call, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, std::vector<int64_t>& counts) {
  const Tensor& values = *call.values;
  Tensor sums = new_tensor(values, {call.layout.num_segments}, acc_scalar_type(values.scalar_type()));
  counts.resize(static_cast<size_t>(call.layout.num_segments));
  const bool own_pass = counts_need_own_pass(mask, values.scalar_type());
  engine().segment_sums(kernel_args(call, values.scalar_type()), sums.mutable_data_ptr(), own_pass ? nullptr : counts.data());
  if (own_pass) {
    engine().count_kept(kernel_args(token_counts_args(mask, cu_seqlens), ScalarType::Float), counts.data());
  }
  return sums;
}

// J from the sums and d [B] float64 as reduce adds the quotients (weighted_total, d rounded once to the accumulation
// dtype as kernel_denoms does). d is divided in the accumulation dtype: checked there by reduce's own check, so that
// these routes refuse what plan-then-reduce refuses, with its message (not checked again when the caller has
// `divisible` from eval_denom_program, the same test).
Tensor total_of(const Tensor& values, const Tensor& sums, const Tensor& d, bool divisible = false) {
  if (!divisible) {
    check_sample_denoms_data("reduce", d, values.scalar_type());
  }
  const ScalarType acc_dtype = acc_scalar_type(values.scalar_type());
  Tensor out = new_tensor(values, {}, acc_dtype);
  dispatch_values(acc_dtype, "values", [&]<typename A>(type_tag<A>) {
    *out.mutable_data_ptr<A>() = weighted_total(sums.const_data_ptr<A>(), d.const_data_ptr<double>(), sums.numel());
  });
  return out;
}

// J and d of a mode whose d[i] is a denominator program (denom_program.h), from one read of
// values and mask: the engine's sums and counts, d from the counts, then J as reduce adds the
// quotients, so J has the bits of reduce(values, mask, cu_seqlens, d).
std::tuple<Tensor, Tensor> aggregate(
    const TokenCall& call,
    ScalarType values_dtype,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    const std::vector<int64_t>& denom_program,
    double divisor) {
  std::vector<int64_t> counts;
  const Tensor sums = sums_and_counts(call, mask, cu_seqlens, counts);
  const int64_t b = call.layout.num_segments;
  Tensor d = new_tensor(*call.values, {b}, ScalarType::Double);
  double* dd = d.mutable_data_ptr<double>();
  bool divisible = false;
  const int64_t bad = eval_denom_program(denom_program, divisor, counts.data(), b, dd, values_dtype == ScalarType::Double, &divisible);
  LOSSAGG_CHECK_VALUE(
      bad < 0, "lossagg.aggregate: ", kDenomsNotPositive, ": d[", bad, "] = ", dd[bad < 0 ? 0 : bad], " (program ", program_text(denom_program),
      ", divisor ", divisor, ")");
  return {total_of(*call.values, sums, d, divisible), d};
}

// J and d of a one-process step whose d[i] is a plan's product (its prompt groups and sessions included), from one
// read of values and mask: the engine's sums and counts, d from the plan's own passes over the counts and labels
// (plan_totals.h: lossagg.StepPlan's d, bit for bit), then J as reduce adds the quotients. A step the plan declines
// raises kPlanDeclines with its status: lossagg/one_pass.py then takes the Python route, which names the problem.
std::tuple<Tensor, Tensor> aggregate_planned(const PlannedArgs& args) {
  const TokenCall& call = args.call;
  std::vector<int64_t> counts;
  const Tensor sums = sums_and_counts(call, args.mask, args.cu_seqlens, counts);
  const int64_t b = call.layout.num_segments;
  Tensor d = new_tensor(*call.values, {b}, ScalarType::Double);
  const auto labels = [](const std::optional<Tensor>& t) { return t.has_value() ? t->const_data_ptr<int64_t>() : nullptr; };
  const int64_t status = plan_denoms(
      counts.data(), b, labels(args.group_index), labels(args.session_index), args.per_prompt, args.check_groups, args.sessions_in_groups,
      args.program, args.divisor, d.mutable_data_ptr<double>());
  LOSSAGG_CHECK_VALUE(status == 0 || status == 7, "lossagg.aggregate_planned: ", kPlanDeclines, " (status ", status, ")");
  return {total_of(*call.values, sums, d), d};
}

// Each segment's gradient broadcast to its tokens, weighted by the mask.
Tensor segment_sum_backward(const BackwardArgs& args, ScalarType values_dtype) {
  Tensor out = args.call.new_token_grad(values_dtype);
  engine().expand_to_tokens(kernel_args(args.call, values_dtype), args.grad.const_data_ptr(), out.mutable_data_ptr(), nullptr);
  return out;
}

// d reduce / d values[t] = grad * mask[t] / sample_denoms[s(t)].
Tensor reduce_backward(const BackwardArgs& args, ScalarType values_dtype) {
  const TokenCall& call = args.call;
  const Tensor& denoms = *args.denoms;
  Tensor out = call.new_token_grad(values_dtype);
  const ScalarType acc_dtype = acc_scalar_type(values_dtype);
  // one coefficient per sample, g / d[s] in the accumulation dtype
  Tensor coef = new_tensor(denoms, {call.layout.num_segments}, denoms.scalar_type());
  dispatch_values(acc_dtype, "values", [&]<typename A>(type_tag<A>) {
    const A g = *args.grad.const_data_ptr<A>();
    const A* d = denoms.const_data_ptr<A>();
    A* c = coef.mutable_data_ptr<A>();
    for (int64_t s = 0; s < call.layout.num_segments; ++s) {
      c[s] = g / d[s];
    }
  });
  engine().expand_to_tokens(kernel_args(call, values_dtype), coef.const_data_ptr(), out.mutable_data_ptr(), nullptr);
  return out;
}

// The whole loss of K terms: the engine's sums of the K values read where they lie, from one
// read of the mask (each piece's mask stays in the cache while its K sums are made); then J_k as
// reduce adds its quotients (weighted_total; a weighted term's quotients w·S / d computed by
// weighted_quotient), and J = c_0 J_0 + c_1 J_1 + ... in term order, each product c_k J_k by
// scaled_part (kernel_common.h: in float64, rounded once). With one term, coefficient 1 and no
// weights, J has the bits of reduce.
std::tuple<Tensor, Tensor> reduce_terms(const TermsArgs& terms) {
  const std::vector<double>& coefficients = terms.coefficients;
  const Tensor& first = terms.rows[0];
  const ScalarType values_dtype = terms.values_dtype;
  const ScalarType acc_dtype = acc_scalar_type(values_dtype);
  const int64_t k_terms = terms.call.layout.num_metrics;
  const int64_t b = terms.call.layout.num_segments;
  const Tensor& denoms = terms.denoms;
  const std::optional<Tensor>& weights = terms.weights;
  KernelArgs args = kernel_args(terms.call, values_dtype);
  args.value_rows = terms.row_data.data();
  Tensor out = new_tensor(first, {}, acc_dtype);
  Tensor parts = new_tensor(first, {k_terms}, acc_dtype);
  dispatch_values(acc_dtype, "values", [&]<typename A>(type_tag<A>) {
    std::vector<A> sums(static_cast<size_t>(k_terms * b));  // host scratch: no tensor to allocate
    A* s = sums.data();
    engine().segment_sums(args, s, nullptr);
    const A* d = denoms.const_data_ptr<A>();
    A* part = parts.mutable_data_ptr<A>();
    A total = A(0);
    for (int64_t k = 0; k < k_terms; ++k) {
      if (weights.has_value()) {  // the quotients w·S / d (weighted_quotient), then added as reduce adds its own
        const A* w = weights->const_data_ptr<A>() + k * b;
        A* x = s + k * b;
        for (int64_t i = 0; i < b; ++i) {
          x[i] = weighted_quotient(x[i], w[i], d[k * b + i]);
        }
        part[k] = weighted_total<A, A, false>(x, nullptr, b);
      } else {
        part[k] = weighted_total(s + k * b, d + k * b, b);
      }
      const A scaled = scaled_part(part[k], coefficients[k]);
      total = k == 0 ? scaled : total + scaled;
    }
    *out.mutable_data_ptr<A>() = total;
  });
  return {out, parts};
}

// d J / d values_k[t] = mask[t] * ((grad * c_k) / d[k, s]) * w[k, s], the coefficient of each
// (term, sample) computed by term_grad (kernel_common.h: in float64, rounded once), then
// broadcast to the tokens: K tensors of the mask's shape, each its own allocation (a term's
// gradient is freed when that term's backward is done with it).
std::vector<Tensor> reduce_terms_backward(const TermsArgs& terms) {
  const std::vector<double>& coefficients = terms.coefficients;
  const ScalarType values_dtype = terms.values_dtype;
  const TokenCall& call = terms.call;
  std::vector<Tensor> out = new_term_grads(call, values_dtype);
  const ScalarType acc_dtype = acc_scalar_type(values_dtype);
  const Tensor& denoms = terms.denoms;
  const std::optional<Tensor>& weights = terms.weights;
  const int64_t k_terms = call.layout.num_metrics;
  const int64_t b = call.layout.num_segments;
  Tensor coef = new_tensor(denoms, {k_terms, b}, acc_dtype);
  dispatch_values(acc_dtype, "values", [&]<typename A>(type_tag<A>) {
    const A g = *terms.grad->const_data_ptr<A>();
    const A* d = denoms.const_data_ptr<A>();
    const A* w = weights.has_value() ? weights->const_data_ptr<A>() : nullptr;
    A* c = coef.mutable_data_ptr<A>();
    for (int64_t k = 0; k < k_terms; ++k) {
      for (int64_t s = 0; s < b; ++s) {
        c[k * b + s] = term_grad(g, coefficients[k], d[k * b + s], w ? w + k * b + s : nullptr);
      }
    }
  });
  std::vector<void*> rows;
  for (Tensor& t : out) {
    rows.push_back(t.mutable_data_ptr());
  }
  engine().expand_to_tokens(kernel_args(call, values_dtype), coef.const_data_ptr(), nullptr, rows.data());
  return out;
}

Tensor token_counts(const TokenCall& call) {
  Tensor out = new_tensor(call.mask, {call.layout.num_segments}, ScalarType::Long);
  engine().count_kept(kernel_args(call, ScalarType::Float), out.mutable_data_ptr<int64_t>());
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(lossagg, CPU, m) {
  m.impl("token_counts", TORCH_BOX(&token_counts_op<&token_counts>));
  m.impl("segment_sum", TORCH_BOX(&segment_sum_op<&segment_sum>));
  m.impl("segment_sum_and_count", TORCH_BOX(&segment_sum_and_count_op<&segment_sum_and_count>));
  m.impl("aggregate", TORCH_BOX(&aggregate_op<&aggregate>));
  m.impl("aggregate_planned", TORCH_BOX(&aggregate_planned_op<&aggregate_planned>));
  m.impl("segment_sum_backward", TORCH_BOX(&segment_sum_backward_op<&segment_sum_backward>));
  m.impl("reduce", TORCH_BOX(&reduce_op<&reduce>));
  m.impl("reduce_backward", TORCH_BOX(&reduce_backward_op<&reduce_backward>));
  m.impl("reduce_terms", TORCH_BOX(&reduce_terms_op<&reduce_terms>));
  m.impl("reduce_terms_backward", TORCH_BOX(&reduce_terms_backward_op<&reduce_terms_backward>));
}

}  // namespace lossagg::cpu
