// What the kernels of every backend share: the token layout of a call, segment
// geometry, the kernel types, mask weights and the masked term. Header-only torch types only, so the
// CUDA kernels also compile for the host emulation in tests/cuda_host/.
//
// Kernel types. The op set-up (op_setup.h) converts the rare dtypes on the way in, so a
// kernel is instantiated for the value dtype (float32, float64, float16, bfloat16) and one
// of four mask kinds: bool, uint8, int64, or a floating mask in the accumulation dtype.
// Offsets are read as int32 or int64 through a flag (Segments) and denominators are always
// in the accumulation dtype. Every
// conversion is exact or the single rounding the kernels did before (see op_setup.h).
#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cstdint>
#include <type_traits>

#if !defined(__CUDA_ARCH__)
#include <bit>
#endif

#if defined(__CUDACC__) || defined(LOSSAGG_CUDA_HOST_EMULATION)
#define LOSSAGG_HD __host__ __device__ __forceinline__
#else
#define LOSSAGG_HD inline
#endif

namespace lossagg {

// What the token layout of a call looks like once its shapes are checked.
struct TokenLayout {
  bool packed;           // cu_seqlens given (THD) or padded [B, T] rows
  int64_t num_segments;  // B
  int64_t num_tokens;    // size of the token index space: T (packed) or B*T (padded)
  int64_t row_len;       // padded T; 0 when packed
  int64_t num_metrics;   // K; 1 without a leading metric dimension
  bool has_metric_dim;
  int64_t max_segment_tokens = -1;  // longest segment, when the checks read cu_seqlens; -1 if unknown
};

// Segments of the token index space. Packed (THD): segment s is [cu[s], cu[s+1]), the
// offsets read as int32 or int64 through a width flag (one kernel type for both; the
// branch is per segment, not per token, and the same for every segment of a call).
// Padded ([B, T] rows): cu == nullptr and segment s is [s*row_len, (s+1)*row_len).
struct Segments {
  const void* cu;
  bool cu_int64;
  int64_t row_len;

  LOSSAGG_HD int64_t offset(int64_t i) const {
    return cu_int64 ? static_cast<const int64_t*>(cu)[i] : static_cast<int64_t>(static_cast<const int32_t*>(cu)[i]);
  }
  LOSSAGG_HD int64_t begin(int64_t s) const { return cu ? offset(s) : s * row_len; }
  LOSSAGG_HD int64_t end(int64_t s) const { return cu ? offset(s + 1) : (s + 1) * row_len; }
};

// A bool mask element, read as its byte. Any non-zero byte is true (a bool tensor viewed
// from uint8 may hold other bytes than 1). Kernels skip the multiply by the weight, 1.
struct BoolMask {
  uint8_t value;
};
template <typename mask_t>
inline constexpr bool is_binary_mask_v = std::is_same_v<mask_t, BoolMask>;

// Accumulation type: float32 for every value dtype except float64.
template <typename scalar_t>
struct acc_type {
  using type = float;
};
template <>
struct acc_type<double> {
  using type = double;
};
template <typename scalar_t>
using acc_t_of = typename acc_type<scalar_t>::type;

// The mask kinds a kernel is built for. `floating` is float32 for float32/16/bf16 values
// (accumulated in float32) and float64 for float64 values; token_counts, which has no
// values, reads float32 and float64 masks as they are.
enum class MaskKind : int { boolean, uint8, int64, float32, float64 };

// The weight a mask element gives its token: its value, in the accumulation dtype.
// Integer masks (trainers' int64 masks, 0/1) read as their value; a floating mask is
// already in the accumulation dtype.
template <typename acc_t, typename mask_t>
LOSSAGG_HD acc_t mask_weight(mask_t m) {
  static_assert(std::is_integral_v<mask_t> || std::is_same_v<mask_t, acc_t>, "floating masks come in the accumulation dtype");
  return static_cast<acc_t>(m);
}

// x where keep, else +0.0 (also when x is NaN or inf): done on the bits, so loops have
// no control flow and vectorise, and a NaN loss under a zero mask contributes exactly 0.
LOSSAGG_HD float select_if(float x, bool keep) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(__float_as_uint(x) & (0u - static_cast<unsigned>(keep)));
#else
  return std::bit_cast<float>(std::bit_cast<uint32_t>(x) & (uint32_t(0) - static_cast<uint32_t>(keep)));
#endif
}
LOSSAGG_HD double select_if(double x, bool keep) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(__double_as_longlong(x) & static_cast<long long>(0ull - static_cast<unsigned long long>(keep)));
#else
  return std::bit_cast<double>(std::bit_cast<uint64_t>(x) & (uint64_t(0) - static_cast<uint64_t>(keep)));
#endif
}

// m * x with masked-out tokens selected away. Bool masks: no multiply (the weight is 1).
template <typename acc_t, typename mask_t>
LOSSAGG_HD acc_t masked_term(acc_t x, mask_t m) {
  if constexpr (is_binary_mask_v<mask_t>) {
    return select_if(x, m.value != 0);
  } else {
    const acc_t w = mask_weight<acc_t>(m);
    return select_if(x, w != acc_t(0)) * w;
  }
}

// Whether a token counts as kept (mask != 0; NaN counts).
template <typename mask_t>
LOSSAGG_HD bool is_kept(mask_t m) {
  if constexpr (is_binary_mask_v<mask_t>) {
    return m.value != 0;
  } else {
    return m != mask_t(0);
  }
}

// The per-(term, sample) numbers of reduce_terms (docs/ops.md, "Precision of the terms"). A float32
// accumulation computes each in float64 and rounds it once, so that an intermediate product or
// quotient that leaves float32's range cannot turn a representable result into inf or 0 (a
// weight of 1e30 times a sum of 1e20, a coefficient of 1e39); a float64 accumulation computes
// them in float64 as written. With weight 1 and coefficient 1 every one is reduce's own number
// (the quotient of two floats computed in float64 and rounded once is the float32 quotient).
template <typename acc_t>
LOSSAGG_HD acc_t weighted_quotient(acc_t sum, acc_t weight, acc_t denom) {  // w·S / d
  if constexpr (std::is_same_v<acc_t, float>) {
    return static_cast<float>(static_cast<double>(sum) * static_cast<double>(weight) / static_cast<double>(denom));
  } else {
    return (sum * weight) / denom;
  }
}
template <typename acc_t>
LOSSAGG_HD acc_t scaled_part(acc_t part, double coefficient) {  // c_k · J_k
  return static_cast<acc_t>(static_cast<double>(part) * coefficient);
}
template <typename acc_t>
LOSSAGG_HD acc_t term_grad(acc_t grad, double coefficient, acc_t denom, const acc_t* weight) {  // ((g·c_k) / d) · w
  if constexpr (std::is_same_v<acc_t, float>) {
    const double q = static_cast<double>(grad) * coefficient / static_cast<double>(denom);
    return static_cast<float>(weight != nullptr ? q * static_cast<double>(*weight) : q);
  } else {
    const double q = (grad * coefficient) / denom;
    return weight != nullptr ? q * *weight : q;
  }
}

}  // namespace lossagg
