// The checks every op's set-up is made of (op_setup.h fills each op's arguments with them),
// shared by every backend. Messages name the op, the argument, what was expected and what
// was given.
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

void check_sample_denoms(const char* op, const Tensor& sample_denoms, const TokenLayout& layout, const Tensor& like);

void check_same_device(const char* op, const char* name, const Tensor& t, const Tensor& like, const char* like_name);

// reduce_terms' [K, B] tables (sample_denoms, sample_weights): floating, [K, B], on the device of `like`.
void check_term_table(const char* op, const char* name, const Tensor& t, int64_t num_terms, int64_t num_segments, const Tensor& like);
// One finite coefficient per term.
void check_coefficients(const char* op, const std::vector<double>& coefficients, int64_t num_terms);
// The dtype a backward op writes its gradient in: a value dtype, named as the op's argument.
void check_values_dtype_argument(const char* op, ScalarType values_dtype);

// Data checks: run always for CPU tensors, for CUDA tensors only when
// device_checks_enabled() (they copy to the host and synchronise).
// check_cu_seqlens_data returns the longest segment's token count (the row length when
// padded), or -1 when the data was not read.
int64_t check_cu_seqlens_data(const char* op, const std::optional<Tensor>& cu_seqlens, const TokenLayout& layout);
// sample_denoms [B], or [K, B] (reduce_terms: the error names the entry [k, i]).
void check_sample_denoms_data(const char* op, const Tensor& sample_denoms, ScalarType values_dtype);
// Every weight finite (any sign), as given and in the accumulation dtype the numerators are scaled in.
void check_sample_weights_data(const char* op, const Tensor& weights, ScalarType values_dtype);

}  // namespace lossagg
