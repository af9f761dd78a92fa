// Input validation shared by every backend. Messages name the op, the argument, what
// was expected and what was given.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace lossagg {

// What the token layout of a call looks like once its shapes are checked.
struct TokenLayout {
  bool packed;          // cu_seqlens given (THD) or padded [B, T] rows
  int64_t num_segments; // B
  int64_t num_tokens;   // size of the token index space: T (packed) or B*T (padded)
  int64_t row_len;      // padded T; 0 when packed
  int64_t num_metrics;  // K; 1 without a leading metric dimension
  bool has_metric_dim;
};

// Checks values/mask/cu_seqlens shapes, dtypes and devices (no data access).
// allow_metric_dim: segment_sum accepts a leading K dimension on values.
TokenLayout check_token_layout(
    const char* op,
    const at::Tensor& values,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    bool allow_metric_dim);

// Same as check_token_layout but for backward ops, which see the mask and the
// incoming gradient instead of values.
TokenLayout check_mask_layout(
    const char* op,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    int64_t num_metrics,
    bool has_metric_dim);

// All checks of the forward ops (shapes, dtypes, devices, and the data checks).
TokenLayout check_segment_sum_inputs(
    const at::Tensor& values,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens);
TokenLayout check_reduce_inputs(
    const at::Tensor& values,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms);

// All checks of the backward ops (shapes, dtypes, devices, and the data checks).
TokenLayout check_reduce_backward_inputs(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens,
    const at::Tensor& sample_denoms);
TokenLayout check_segment_sum_backward_inputs(
    const at::Tensor& grad,
    const at::Tensor& mask,
    const std::optional<at::Tensor>& cu_seqlens);

void check_sample_denoms(const char* op, const at::Tensor& sample_denoms, const TokenLayout& layout, const at::Tensor& like);

// Data checks: run always for CPU tensors, for CUDA tensors only when
// device_checks_enabled() (they copy to the host and synchronise).
void check_cu_seqlens_data(const char* op, const std::optional<at::Tensor>& cu_seqlens, const TokenLayout& layout);
void check_sample_denoms_data(const char* op, const at::Tensor& sample_denoms);

// Output shapes: per-segment sums [B] or [K, B]; per-token gradients in the token
// layout of the mask, with the leading K when there is one.
inline std::vector<int64_t> segment_sums_shape(const TokenLayout& layout) {
  if (layout.has_metric_dim) {
    return {layout.num_metrics, layout.num_segments};
  }
  return {layout.num_segments};
}
inline std::vector<int64_t> token_grad_shape(const at::Tensor& mask, const TokenLayout& layout) {
  std::vector<int64_t> shape(mask.sizes().begin(), mask.sizes().end());
  if (layout.has_metric_dim) {
    shape.insert(shape.begin(), layout.num_metrics);
  }
  return shape;
}

inline std::optional<at::Tensor> contiguous_offsets(const std::optional<at::Tensor>& cu_seqlens) {
  return cu_seqlens.has_value() ? std::optional<at::Tensor>(cu_seqlens->contiguous()) : std::nullopt;
}

}  // namespace lossagg
