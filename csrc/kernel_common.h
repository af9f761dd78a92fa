// What the kernels of every backend share: the token layout of a call, segment
// geometry, mask weights and accumulation types. Free of ATen, so the CUDA kernels
// also compile for the host emulation in tests/cuda_host/.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

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

// Segments of the token index space. Packed (THD): segment s is
// [cu_seqlens[s], cu_seqlens[s+1]). Padded ([B, T] rows): cu == nullptr and segment s is
// [s*row_len, (s+1)*row_len). The padded case uses offset_t = int64_t.
template <typename offset_t>
struct Segments {
  const offset_t* cu;
  int64_t row_len;

  LOSSAGG_HD int64_t begin(int64_t s) const {
    return cu ? static_cast<int64_t>(cu[s]) : s * row_len;
  }
  LOSSAGG_HD int64_t end(int64_t s) const {
    return cu ? static_cast<int64_t>(cu[s + 1]) : (s + 1) * row_len;
  }
};

// A bool mask element, read as its byte (torch stores bool as 0 or 1). Kernels use
// is_binary_mask_v to skip the multiply by the weight, which is 1 for every kept token.
struct BoolMask {
  uint8_t value;
  LOSSAGG_HD explicit operator float() const {
    return static_cast<float>(value);
  }
};
template <typename mask_t>
inline constexpr bool is_binary_mask_v = std::is_same_v<mask_t, BoolMask>;

// The weight a mask element gives its token: its value. Tokens whose weight is 0 are
// selected out (never multiplied), so a NaN or inf loss under a zero mask contributes
// exactly 0. A float64 mask keeps its full precision for float64 values.
// Integer masks (trainers' int64 masks, 0/1) read as their value: outside {0, 1} a weight.
template <typename acc_t, typename mask_t>
LOSSAGG_HD acc_t mask_weight(mask_t m) {
  if constexpr (std::is_integral_v<mask_t>) {
    return static_cast<acc_t>(m);
  } else {
    return static_cast<acc_t>(static_cast<float>(m));
  }
}
template <>
LOSSAGG_HD double mask_weight<double, double>(double m) {
  return m;
}

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

}  // namespace lossagg
