#include "checks.h"

#include "denom_program.h"
#include "dtypes.h"

#include "lossagg.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

namespace lossagg {

namespace {

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "") != 0 && std::strcmp(v, "0") != 0;
}

std::atomic<bool>& device_checks_flag() {
  static std::atomic<bool> flag{env_flag("LOSSAGG_CHECK_INPUTS")};
  return flag;
}

bool wants_data_checks(const Tensor& t) { return t.is_cpu() || device_checks_enabled(); }

}  // namespace

void check_same_device(const char* op, const char* name, const Tensor& t, const Tensor& like, const char* like_name) {
  LOSSAGG_CHECK_VALUE(
      t.device() == like.device(), "lossagg.", op, ": ", name, " must be on the same device as ", like_name, " (", device_name(like), "), got ",
      device_name(t));
}

namespace {

void check_cu_seqlens_meta(const char* op, const Tensor& cu, const Tensor& like) {
  LOSSAGG_CHECK_TYPE(
      cu.scalar_type() == ScalarType::Int || cu.scalar_type() == ScalarType::Long, "lossagg.", op,
      ": cu_seqlens must have dtype int32 or int64, got ", cu.scalar_type());
  LOSSAGG_CHECK_VALUE(
      cu.dim() == 1 && cu.size(0) >= 1, "lossagg.", op, ": cu_seqlens must be a 1-D [B+1] tensor with at least one element, got shape ",
      shape_of(cu));
  check_same_device(op, "cu_seqlens", cu, like, "the token tensors");
}

}  // namespace

void set_device_checks(bool enabled) { device_checks_flag().store(enabled); }

bool device_checks_enabled() { return device_checks_flag().load(); }

bool built_with_cuda() {
#ifdef LOSSAGG_WITH_CUDA
  return true;
#else
  return false;
#endif
}

TokenLayout check_token_layout(
    const char* op,
    const Tensor& values,
    const Tensor& mask,
    const std::optional<Tensor>& cu_seqlens,
    bool allow_metric_dim,
    const char* values_name) {
  LOSSAGG_CHECK_TYPE(
      is_value_dtype(values.scalar_type()), "lossagg.", op, ": ", values_name, " must have dtype ", value_dtypes_text(), ", got ",
      values.scalar_type());
  LOSSAGG_CHECK_TYPE(is_mask_dtype(mask.scalar_type()), "lossagg.", op, ": mask must have dtype ", kMaskDtypesText, ", got ", mask.scalar_type());
  check_same_device(op, "mask", mask, values, values_name);

  TokenLayout layout{};
  layout.packed = cu_seqlens.has_value();
  const int64_t token_dims = layout.packed ? 1 : 2;
  const char* token_shape = layout.packed ? "[T]" : "[B, T]";
  const char* metric_shape = layout.packed ? "[K, T]" : "[K, B, T]";
  const bool ok_dim = values.dim() == token_dims || (allow_metric_dim && values.dim() == token_dims + 1);
  if (allow_metric_dim) {
    LOSSAGG_CHECK_VALUE(
        ok_dim, "lossagg.", op, ": values must be ", token_shape, " or ", metric_shape,
        layout.packed ? " when cu_seqlens is given (packed layout)" : " when cu_seqlens is None (padded layout)", ", got shape ", shape_of(values));
  } else {
    LOSSAGG_CHECK_VALUE(
        ok_dim, "lossagg.", op, ": ", values_name, " must be ", token_shape,
        layout.packed ? " when cu_seqlens is given (packed layout)" : " when cu_seqlens is None (padded layout)", ", got shape ", shape_of(values));
  }
  layout.has_metric_dim = values.dim() == token_dims + 1;
  layout.num_metrics = layout.has_metric_dim ? values.size(0) : 1;
  auto token_sizes = values.sizes().slice(layout.has_metric_dim ? 1 : 0);
  LOSSAGG_CHECK_VALUE(
      mask.sizes() == token_sizes, "lossagg.", op, ": mask must have the token shape of ", values_name, " ", Shape{token_sizes}, ", got shape ",
      shape_of(mask));

  if (layout.packed) {
    check_cu_seqlens_meta(op, *cu_seqlens, values);
    layout.num_segments = cu_seqlens->size(0) - 1;
    layout.num_tokens = token_sizes[0];
    layout.row_len = 0;
  } else {
    layout.num_segments = token_sizes[0];
    layout.row_len = token_sizes[1];
    layout.num_tokens = token_sizes[0] * token_sizes[1];
  }
  return layout;
}

TokenLayout check_mask_layout(const char* op, const Tensor& mask, const std::optional<Tensor>& cu_seqlens, int64_t num_metrics, bool has_metric_dim) {
  LOSSAGG_CHECK_TYPE(is_mask_dtype(mask.scalar_type()), "lossagg.", op, ": mask must have dtype ", kMaskDtypesText, ", got ", mask.scalar_type());
  TokenLayout layout{};
  layout.packed = cu_seqlens.has_value();
  layout.has_metric_dim = has_metric_dim;
  layout.num_metrics = num_metrics;
  if (layout.packed) {
    LOSSAGG_CHECK_VALUE(mask.dim() == 1, "lossagg.", op, ": mask must be [T] when cu_seqlens is given (packed layout), got shape ", shape_of(mask));
    check_cu_seqlens_meta(op, *cu_seqlens, mask);
    layout.num_segments = cu_seqlens->size(0) - 1;
    layout.num_tokens = mask.size(0);
  } else {
    LOSSAGG_CHECK_VALUE(mask.dim() == 2, "lossagg.", op, ": mask must be [B, T] when cu_seqlens is None (padded layout), got shape ", shape_of(mask));
    layout.num_segments = mask.size(0);
    layout.row_len = mask.size(1);
    layout.num_tokens = mask.size(0) * mask.size(1);
  }
  return layout;
}

void check_sample_denoms(const char* op, const Tensor& sample_denoms, const TokenLayout& layout, const Tensor& like) {
  LOSSAGG_CHECK_TYPE(
      is_value_dtype(sample_denoms.scalar_type()), "lossagg.", op, ": sample_denoms must have a floating dtype, got ", sample_denoms.scalar_type());
  LOSSAGG_CHECK_VALUE(
      sample_denoms.dim() == 1 && sample_denoms.size(0) == layout.num_segments, "lossagg.", op,
      ": sample_denoms must be a 1-D tensor of length B = ", layout.num_segments, " (one denominator per sample), got shape ",
      shape_of(sample_denoms));
  check_same_device(op, "sample_denoms", sample_denoms, like, "the token tensors");
}

namespace {

// Reads p[0..n) (stride in elements) of a host tensor of integer type O. One pass without
// early exit (it vectorises); the first bad entry is looked for only to word an error.
template <typename O>
int64_t check_offsets(const char* op, const O* p, int64_t n, int64_t stride, int64_t num_tokens) {
  LOSSAGG_CHECK_VALUE(p[0] == 0, "lossagg.", op, ": cu_seqlens[0] must be 0, got ", static_cast<int64_t>(p[0]));
  int64_t longest = 0;
  int64_t shortest = 0;
  if (stride == 1) {
    for (int64_t i = 1; i < n; ++i) {
      const int64_t len = static_cast<int64_t>(p[i]) - static_cast<int64_t>(p[i - 1]);
      longest = std::max(longest, len);
      shortest = std::min(shortest, len);
    }
  } else {
    for (int64_t i = 1; i < n; ++i) {
      const int64_t len = static_cast<int64_t>(p[i * stride]) - static_cast<int64_t>(p[(i - 1) * stride]);
      longest = std::max(longest, len);
      shortest = std::min(shortest, len);
    }
  }
  if (shortest < 0) {
    for (int64_t i = 1; i < n; ++i) {
      const int64_t hi = static_cast<int64_t>(p[i * stride]);
      const int64_t lo = static_cast<int64_t>(p[(i - 1) * stride]);
      LOSSAGG_CHECK_VALUE(
          hi >= lo, "lossagg.", op, ": cu_seqlens must be non-decreasing, got cu_seqlens[", i, "] = ", hi, " < cu_seqlens[", i - 1, "] = ", lo);
    }
  }
  const int64_t last = static_cast<int64_t>(p[(n - 1) * stride]);
  LOSSAGG_CHECK_VALUE(last == num_tokens, "lossagg.", op, ": cu_seqlens[-1] must equal the number of tokens T = ", num_tokens, ", got ", last);
  return longest;
}

// x is finite and > 0 (NaN fails both comparisons); written without a library call so
// the loop below vectorises.
template <typename A>
inline bool positive_finite(A x) {
  // normal, not subnormal: a subnormal divisor loses the quotient's precision (and the forward's and the
  // backward's roundings part ways); x / d with d >= the smallest normal number keeps every bit it can
  return x >= std::numeric_limits<A>::min() && x <= std::numeric_limits<A>::max();
}

}  // namespace

int64_t check_cu_seqlens_data(const char* op, const std::optional<Tensor>& cu_seqlens, const TokenLayout& layout) {
  if (!cu_seqlens.has_value()) {
    return layout.row_len;
  }
  if (!wants_data_checks(*cu_seqlens)) {
    return -1;
  }
  // Read where it is (no copy) on the CPU; a CUDA tensor is copied to the host.
  const Tensor cu = cu_seqlens->is_cpu() ? *cu_seqlens : torch::stable::to(*cu_seqlens, Device(DeviceType::CPU));
  const int64_t n = cu.size(0);
  const int64_t stride = cu.stride(0);
  if (cu.scalar_type() == ScalarType::Int) {
    return check_offsets(op, cu.const_data_ptr<int32_t>(), n, stride, layout.num_tokens);
  }
  return check_offsets(op, cu.const_data_ptr<int64_t>(), n, stride, layout.num_tokens);
}

void check_sample_denoms_data(const char* op, const Tensor& sample_denoms, ScalarType values_dtype) {
  if (!wants_data_checks(sample_denoms)) {
    return;
  }
  // The kernels divide in the accumulation dtype: each value is checked as converted to
  // it, read in place (no copy) on the CPU. The value as given words the error.
  const bool in_double = values_dtype == ScalarType::Double;
  // [K, B] is read as one contiguous run of K * B entries
  const Tensor host = sample_denoms.is_cpu() ? sample_denoms : torch::stable::to(sample_denoms, Device(DeviceType::CPU));
  const bool rows = host.dim() == 2;
  const Tensor d = rows && !host.is_contiguous() ? torch::stable::contiguous(host) : host;
  const int64_t n = rows ? d.size(0) * d.size(1) : d.size(0);
  const int64_t stride = rows ? 1 : d.stride(0);
  const int64_t row_len = rows ? std::max<int64_t>(d.size(1), 1) : 0;
  auto fail = [&](int64_t i, double given, double converted) {
    const std::string at = rows ? std::to_string(i / row_len) + ", " + std::to_string(i % row_len) : std::to_string(i);
    LOSSAGG_CHECK_VALUE(
        std::isfinite(given) && given > 0.0, "lossagg.", op, ": sample_denoms must be finite and > 0, got sample_denoms[", at, "] = ", given);
    LOSSAGG_CHECK_VALUE(
        false, "lossagg.", op, ": sample_denoms[", at, "] = ", given, " is ", converted, " in ", in_double ? "Double" : "Float",
        ", the dtype the division happens in for ", values_dtype, " values; it must be finite and at least the smallest normal number there (",
        in_double ? std::numeric_limits<double>::min() : std::numeric_limits<float>::min(),
        ": a subnormal divisor loses the quotient's precision); rescale the denominators or use float64 values");
  };
  auto check = [&]<typename D>(const D* p) {
    auto scan = [&]<typename A>(A) {
      bool all_ok = true;
      if (stride == 1) {
        for (int64_t i = 0; i < n; ++i) {
          all_ok &= positive_finite(static_cast<A>(p[i]));
        }
      } else {
        for (int64_t i = 0; i < n; ++i) {
          all_ok &= positive_finite(static_cast<A>(p[i * stride]));
        }
      }
      if (all_ok) {
        return;
      }
      for (int64_t i = 0; i < n; ++i) {
        const A x = static_cast<A>(p[i * stride]);
        if (!positive_finite(x)) {
          fail(i, static_cast<double>(p[i * stride]), static_cast<double>(x));
        }
      }
    };
    if (in_double) {
      scan(double{});
    } else {
      scan(float{});
    }
  };
  switch (d.scalar_type()) {
    case ScalarType::Double:
      return check(d.const_data_ptr<double>());
    case ScalarType::Float:
      return check(d.const_data_ptr<float>());
    case ScalarType::Half:
      return check(d.const_data_ptr<c10::Half>());
    case ScalarType::BFloat16:
      return check(d.const_data_ptr<c10::BFloat16>());
    default:
      LOSSAGG_CHECK_TYPE(false, "lossagg.", op, ": sample_denoms must have a floating dtype, got ", d.scalar_type());
  }
}

// The [K, B] per-term tensors of reduce_terms and its backward: floating, [K, B], on the device
// of `like`.
void check_term_table(const char* op, const char* name, const Tensor& t, int64_t num_terms, int64_t num_segments, const Tensor& like) {
  LOSSAGG_CHECK_TYPE(is_value_dtype(t.scalar_type()), "lossagg.", op, ": ", name, " must have a floating dtype, got ", t.scalar_type());
  LOSSAGG_CHECK_VALUE(
      t.dim() == 2 && t.size(0) == num_terms && t.size(1) == num_segments, "lossagg.", op, ": ", name, " must be [K, B] = [", num_terms, ", ",
      num_segments, "] (one entry per term and sample), got shape ", shape_of(t));
  check_same_device(op, name, t, like, "the token tensors");
}

// Every weight finite (any sign; 0 drops the sample from that term), as given and in the
// accumulation dtype the numerators are scaled in.
void check_sample_weights_data(const char* op, const Tensor& weights, ScalarType values_dtype) {
  if (!wants_data_checks(weights)) {
    return;
  }
  const Tensor host = weights.is_cpu() ? weights : torch::stable::to(weights, Device(DeviceType::CPU));
  const Tensor dense = host.is_contiguous() ? host : torch::stable::contiguous(host);
  const Tensor w = dense.scalar_type() == ScalarType::Double ? dense : torch::stable::to(dense, ScalarType::Double);
  const double* p = w.const_data_ptr<double>();
  const int64_t n = w.size(0) * w.size(1);
  const int64_t row_len = std::max<int64_t>(w.size(1), 1);
  const bool in_double = values_dtype == ScalarType::Double;
  // finite and, unless 0, normal in the accumulation dtype: a subnormal weight loses the product's precision
  auto finite_in_acc = [&](double x) {
    if (in_double) {
      return std::abs(x) <= std::numeric_limits<double>::max() && (x == 0.0 || std::abs(x) >= std::numeric_limits<double>::min());
    }
    const float f = std::abs(static_cast<float>(x));
    return f <= std::numeric_limits<float>::max() && (x == 0.0 || f >= std::numeric_limits<float>::min());
  };
  bool all_ok = true;
  for (int64_t i = 0; i < n; ++i) {
    all_ok &= finite_in_acc(p[i]);
  }
  if (all_ok) {
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    LOSSAGG_CHECK_VALUE(
        std::isfinite(p[i]), "lossagg.", op, ": sample_weights must be finite, got sample_weights[", i / row_len, ", ", i % row_len, "] = ", p[i]);
    LOSSAGG_CHECK_VALUE(
        finite_in_acc(p[i]), "lossagg.", op, ": sample_weights[", i / row_len, ", ", i % row_len, "] = ", p[i], " is ",
        in_double ? p[i] : static_cast<double>(static_cast<float>(p[i])), " in ", in_double ? "Double" : "Float", ", the dtype the ", values_dtype,
        " numerators are scaled in; it must be finite there, and 0 or at least its smallest normal number (a subnormal weight loses the "
        "product's precision): rescale the weights or use float64 values");
  }
}

void check_coefficients(const char* op, const std::vector<double>& coefficients, int64_t num_terms) {
  LOSSAGG_CHECK_VALUE(
      static_cast<int64_t>(coefficients.size()) == num_terms, "lossagg.", op, ": coefficients must hold one number per term (K = ", num_terms,
      "), got ", coefficients.size());
  for (size_t k = 0; k < coefficients.size(); ++k) {
    LOSSAGG_CHECK_VALUE(
        std::isfinite(coefficients[k]), "lossagg.", op, ": coefficients must be finite, got coefficients[", k, "] = ", coefficients[k]);
  }
}

// The dtype a backward op writes its gradient in: a value dtype, named as the op's argument.
void check_values_dtype_argument(const char* op, ScalarType values_dtype) {
  LOSSAGG_CHECK_TYPE(
      is_value_dtype(values_dtype), "lossagg.", op, ": values_dtype (the gradient's dtype, that of the values) must be ", value_dtypes_text(),
      ", got ", values_dtype);
}

}  // namespace lossagg
