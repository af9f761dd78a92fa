// Input validation shared by every backend. Messages name the op, the argument, what
// was expected and what was given.
#pragma once

#include "kernel_common.h"
#include "torch_api.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace lossagg {

// Checks values/mask/cu_seqlens shapes, dtypes and devices (no data access).
// allow_metric_dim: segment_sum accepts a leading K dimension on values.
// values_name: how the errors name `values` (reduce_terms: "values[0]").
TokenLayout check_token_layout(
    const char* op,
    const Tensor& values,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    bool allow_metric_dim,
    const char* values_name = "values");

// Same as check_token_layout but for backward ops, which see the mask and the
// incoming gradient instead of values.
TokenLayout check_mask_layout(const char* op, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, int64_t num_metrics, bool has_metric_dim);

// All checks of the forward ops (shapes, dtypes, devices, and the data checks).
// allow_metric_dim: segment_sum (a leading K); without it, segment_sum_and_count ([T] or [B, T]
// values, as reduce), whose name the errors then give.
TokenLayout check_segment_sum_inputs(const Tensor& values, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, bool allow_metric_dim = true);
// lossagg.aggregate: values as for reduce, and a well-formed denominator program (denom_program.h).
TokenLayout check_aggregate_inputs(
    const Tensor& values, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, const std::vector<int64_t>& denom_program, double divisor);
TokenLayout check_reduce_inputs(const Tensor& values, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, const Tensor& sample_denoms);
// reduce_terms: K >= 1 value tensors of one dtype and device, each of the token shape of mask
// (the layout has K metrics); sample_denoms [K, B]; sample_weights, when given, [K, B] and
// finite; one finite coefficient per term.
TokenLayout check_reduce_terms_inputs(
    const std::vector<Tensor>& values,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    const Tensor& sample_denoms,
    const std::optional<Tensor>& sample_weights,
    const std::vector<double>& coefficients);

// All checks of the backward ops (shapes, dtypes, devices, and the data checks).
TokenLayout check_reduce_backward_inputs(
    const Tensor& grad, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, const Tensor& sample_denoms, ScalarType values_dtype);
TokenLayout check_segment_sum_backward_inputs(
    const Tensor& grad, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, ScalarType values_dtype);
TokenLayout check_reduce_terms_backward_inputs(
    const Tensor& grad,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    const Tensor& sample_denoms,
    const std::optional<Tensor>& sample_weights,
    const std::vector<double>& coefficients,
    ScalarType values_dtype);

TokenLayout check_token_counts_inputs(const Tensor& mask, const std::optional<Tensor>& cu_seqlens);

void check_sample_denoms(const char* op, const Tensor& sample_denoms, const TokenLayout& layout, const Tensor& like);

// Data checks: run always for CPU tensors, for CUDA tensors only when
// device_checks_enabled() (they copy to the host and synchronise).
// check_cu_seqlens_data returns the longest segment's token count (the row length when
// padded), or -1 when the data was not read.
int64_t check_cu_seqlens_data(const char* op, const std::optional<Tensor>& cu_seqlens, const TokenLayout& layout);
// sample_denoms [B], or [K, B] (reduce_terms: the error names the entry [k, i]).
void check_sample_denoms_data(const char* op, const Tensor& sample_denoms, ScalarType values_dtype);

}  // namespace lossagg
