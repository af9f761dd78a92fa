// CPU engine shared by the segmented ops. Work is cut into fixed "pieces": each segment
// is split into runs of at most kPieceTokens tokens, so the order of every floating-point
// addition depends only on the input, never on the number of threads.
#pragma once

#include "../kernel_common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <type_traits>
#include <cstdint>
#include <vector>

namespace lossagg::cpu {

constexpr int64_t kPieceTokens = 16384;

// x where w != 0, else +0.0 (also when x is NaN or inf). Done on the bits so the loops
// below have no control flow and vectorise.
template <typename acc_t>
inline acc_t select_kept(acc_t x, acc_t w) {
  using bits_t = std::conditional_t<sizeof(acc_t) == 8, uint64_t, uint32_t>;
  const bits_t keep = bits_t(0) - static_cast<bits_t>(w != acc_t(0));
  return std::bit_cast<acc_t>(static_cast<bits_t>(std::bit_cast<bits_t>(x) & keep));
}

constexpr int kBlock = 64;  // tokens converted per step
constexpr int kLanes = 16;  // independent accumulators

// x where the bool mask byte b is non-zero, else +0.0. Any non-zero byte is true (a bool
// tensor viewed from uint8 may hold other bytes than 1).
template <typename acc_t>
inline acc_t select_bit(acc_t x, uint8_t b) {
  using bits_t = std::conditional_t<sizeof(acc_t) == 8, uint64_t, uint32_t>;
  return std::bit_cast<acc_t>(static_cast<bits_t>(std::bit_cast<bits_t>(x) & (bits_t(0) - static_cast<bits_t>(b != 0))));
}

// m[i] * x with masked-out tokens selected away: for bool masks the weight is 1, so the
// multiply is skipped.
template <typename acc_t, typename mask_t>
inline acc_t masked_term(acc_t x, mask_t m) {
  if constexpr (is_binary_mask_v<mask_t>) {
    return select_bit(x, m.value);
  } else {
    const acc_t w = mask_weight<acc_t>(m);
    return select_kept(x, w) * w;
  }
}

// Masked sum of v[lo, hi). Tokens are converted a block at a time into a small buffer
// (a loop without a reduction, which vectorises), then added into kLanes fixed lanes:
// lane l takes tokens lo+l, lo+l+kLanes, ...; the tail goes to lane 0; lanes are
// combined in a fixed order. The summation order depends only on (lo, hi), so the
// AVX2 and the baseline builds of this loop give the same bits.
#define LOSSAGG_MASKED_SUM_BODY                                         \
  acc_t lane[kLanes] = {};                                              \
  int64_t i = lo;                                                       \
  for (; i + kBlock <= hi; i += kBlock) {                               \
    acc_t t[kBlock];                                                    \
    for (int j = 0; j < kBlock; ++j) {                                  \
      t[j] = masked_term(static_cast<acc_t>(v[i + j]), m[i + j]);       \
    }                                                                   \
    for (int j = 0; j < kBlock; j += kLanes) {                          \
      for (int l = 0; l < kLanes; ++l) {                                \
        lane[l] += t[j + l];                                            \
      }                                                                 \
    }                                                                   \
  }                                                                     \
  for (; i < hi; ++i) {                                                 \
    lane[0] += masked_term(static_cast<acc_t>(v[i]), m[i]);             \
  }                                                                     \
  for (int width = kLanes / 2; width > 0; width /= 2) {                 \
    for (int l = 0; l < width; ++l) {                                   \
      lane[l] += lane[l + width];                                       \
    }                                                                   \
  }                                                                     \
  return lane[0];

template <typename acc_t, typename scalar_t, typename mask_t>
acc_t masked_sum_baseline(const scalar_t* __restrict v, const mask_t* __restrict m, int64_t lo, int64_t hi) {
  LOSSAGG_MASKED_SUM_BODY
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LOSSAGG_HAVE_AVX2_PATH 1
// The same loop compiled for AVX2 (no FMA: a fused multiply-add would round differently
// from the baseline build), picked at run time.
template <typename acc_t, typename scalar_t, typename mask_t>
__attribute__((target("avx2,f16c"))) acc_t
masked_sum_avx2(const scalar_t* __restrict v, const mask_t* __restrict m, int64_t lo, int64_t hi) {
  LOSSAGG_MASKED_SUM_BODY
}

inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}
#endif

template <typename acc_t, typename scalar_t, typename mask_t>
acc_t masked_sum(const scalar_t* v, const mask_t* m, int64_t lo, int64_t hi) {
#ifdef LOSSAGG_HAVE_AVX2_PATH
  if (cpu_has_avx2()) {
    return masked_sum_avx2<acc_t>(v, m, lo, hi);
  }
#endif
  return masked_sum_baseline<acc_t>(v, m, lo, hi);
}

// piece_offsets[s] .. piece_offsets[s+1] are the pieces of segment s.
template <typename offset_t>
std::vector<int64_t> plan_pieces(const Segments<offset_t>& seg, int64_t num_segments) {
  std::vector<int64_t> offsets(num_segments + 1);
  offsets[0] = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t len = seg.end(s) - seg.begin(s);
    offsets[s + 1] = offsets[s] + (len + kPieceTokens - 1) / kPieceTokens;
  }
  return offsets;
}

// Below this much work (tokens x metrics) a call stays on the calling thread: opening a
// parallel region costs more than it saves, and under load it waits for a busy core.
constexpr int64_t kSerialWork = int64_t(1) << 16;
// A parallel task gets at least about this much work.
constexpr int64_t kTaskWork = int64_t(1) << 15;

// Token where piece p starts (pieces follow the segments in token order).
template <typename offset_t>
int64_t piece_start(const Segments<offset_t>& seg, const std::vector<int64_t>& piece_offsets, int64_t p) {
  const int64_t s = std::upper_bound(piece_offsets.begin(), piece_offsets.end(), p) - piece_offsets.begin() - 1;
  return seg.begin(s) + (p - piece_offsets[s]) * kPieceTokens;
}

// Calls f(segment, piece, lo, hi) for every piece. Small calls run on the calling thread;
// larger ones are cut into tasks of about equal token counts (not piece counts). Each
// piece's result depends on the piece alone, so the bits never depend on the partition.
template <typename offset_t, typename F>
void for_each_piece(const Segments<offset_t>& seg, const std::vector<int64_t>& piece_offsets, int64_t num_tokens, int64_t work_per_token, F&& f) {
  const int64_t num_pieces = piece_offsets.back();
  auto run = [&](int64_t first, int64_t last) {
    // The segment holding piece `first`: the last s with piece_offsets[s] <= first.
    int64_t s = std::upper_bound(piece_offsets.begin(), piece_offsets.end(), first) - piece_offsets.begin() - 1;
    for (int64_t p = first; p < last; ++p) {
      while (piece_offsets[s + 1] <= p) {
        ++s;
      }
      const int64_t lo = seg.begin(s) + (p - piece_offsets[s]) * kPieceTokens;
      const int64_t hi = std::min(seg.end(s), lo + kPieceTokens);
      f(s, p, lo, hi);
    }
  };
  const int64_t work = num_tokens * std::max<int64_t>(work_per_token, 1);
  const int64_t threads = at::get_num_threads();
  if (num_pieces <= 1 || threads <= 1 || work < kSerialWork || at::in_parallel_region()) {
    run(0, num_pieces);
    return;
  }
  const int64_t tasks = std::min({num_pieces, threads * 4, std::max<int64_t>(1, work / kTaskWork)});
  std::vector<int64_t> bounds(tasks + 1, num_pieces);
  bounds[0] = 0;
  for (int64_t c = 1; c < tasks; ++c) {
    // first piece starting at or after the c-th equal share of the tokens
    const int64_t target = num_tokens * c / tasks;
    int64_t lo = bounds[c - 1], hi = num_pieces;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (piece_start(seg, piece_offsets, mid) < target) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    bounds[c] = lo;
  }
  at::parallel_for(0, tasks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      run(bounds[c], bounds[c + 1]);
    }
  });
}

// out[k * B + s] = sum over tokens t of segment s of mask_weight(m[t]) * v[k * ntok + t],
// masked-out tokens selected away.
template <typename acc_t, typename scalar_t, typename mask_t, typename offset_t>
void segment_sums(const scalar_t* v, const mask_t* m, const TokenLayout& layout, const Segments<offset_t>& seg, acc_t* out) {
  const int64_t num_metrics = layout.num_metrics;
  const int64_t num_tokens = layout.num_tokens;
  const int64_t num_segments = layout.num_segments;
  const std::vector<int64_t> pieces = plan_pieces(seg, num_segments);
  const int64_t num_pieces = pieces.back();
  std::vector<acc_t> partial(static_cast<size_t>(num_metrics * num_pieces));
  for_each_piece(seg, pieces, num_tokens, num_metrics, [&](int64_t, int64_t p, int64_t lo, int64_t hi) {
    for (int64_t k = 0; k < num_metrics; ++k) {
      partial[k * num_pieces + p] = masked_sum<acc_t>(v + k * num_tokens, m, lo, hi);
    }
  });
  auto combine = [&](int64_t first, int64_t last) {
    for (int64_t k = 0; k < num_metrics; ++k) {
      for (int64_t s = first; s < last; ++s) {
        acc_t total = acc_t(0);
        for (int64_t p = pieces[s]; p < pieces[s + 1]; ++p) {
          total += partial[k * num_pieces + p];
        }
        out[k * num_segments + s] = total;
      }
    }
  };
  if (num_segments * num_metrics < kSerialWork) {
    combine(0, num_segments);
  } else {
    at::parallel_for(0, num_segments, 4096, combine);
  }
}

// o[t] = mask_weight(m[t]) * c for t in [lo, hi) (0 where the mask is 0), in the values
// dtype. Baseline and AVX2 builds of the same loop, as for masked_sum.
#define LOSSAGG_FILL_BODY                          \
  for (int64_t i = lo; i < hi; ++i) {              \
    o[i] = static_cast<scalar_t>(masked_term(c, m[i])); \
  }

template <typename scalar_t, typename acc_t, typename mask_t>
void masked_fill_baseline(scalar_t* __restrict o, const mask_t* __restrict m, acc_t c, int64_t lo, int64_t hi) {
  LOSSAGG_FILL_BODY
}

#ifdef LOSSAGG_HAVE_AVX2_PATH
template <typename scalar_t, typename acc_t, typename mask_t>
__attribute__((target("avx2,f16c"))) void
masked_fill_avx2(scalar_t* __restrict o, const mask_t* __restrict m, acc_t c, int64_t lo, int64_t hi) {
  LOSSAGG_FILL_BODY
}
#endif

template <typename scalar_t, typename acc_t, typename mask_t>
void masked_fill(scalar_t* o, const mask_t* m, acc_t c, int64_t lo, int64_t hi) {
#ifdef LOSSAGG_HAVE_AVX2_PATH
  if (cpu_has_avx2()) {
    return masked_fill_avx2(o, m, c, lo, hi);
  }
#endif
  masked_fill_baseline(o, m, c, lo, hi);
}

// out[k * ntok + t] = mask_weight(m[t]) * coef(k, s) for t in segment s (0 where the mask
// is 0), written in the values dtype.
template <typename scalar_t, typename acc_t, typename mask_t, typename offset_t, typename Coef>
void expand_to_tokens(scalar_t* out, const mask_t* m, const TokenLayout& layout, const Segments<offset_t>& seg, Coef&& coef) {
  const std::vector<int64_t> pieces = plan_pieces(seg, layout.num_segments);
  for_each_piece(seg, pieces, layout.num_tokens, layout.num_metrics, [&](int64_t s, int64_t, int64_t lo, int64_t hi) {
    for (int64_t k = 0; k < layout.num_metrics; ++k) {
      masked_fill<scalar_t, acc_t>(out + k * layout.num_tokens, m, coef(k, s), lo, hi);
    }
  });
}

}  // namespace lossagg::cpu
