// CPU engine shared by the segmented ops.
//
// Summation order. A segment of at most kPieceTokens tokens is one "piece"; a longer one
// is cut into pieces of kPieceTokens tokens from its start. A piece is summed in a fixed
// order (below), and a segment's pieces are added left to right. The order depends only on
// the input, never on the thread count or the instruction set, so every build and every
// run gives the same bits.
//
// Work. A call below kSerialWork (tokens x metrics) runs on the calling thread. A larger
// one is cut into tasks of about equal token counts at piece boundaries. When no segment
// is longer than a piece (the usual RL batch) pieces are the segments themselves: no piece
// table is built and each segment's sum is written straight to the output.
#pragma once

#include "../kernel_common.h"
#include "isa.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#endif

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
constexpr int kLanes = 32;  // independent accumulators (two AVX-512 or four AVX2 registers)

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

// Masked sum of v[lo, hi), hi - lo >= kBlock. Tokens are converted a block at a time
// into a small buffer (a loop without a reduction, which vectorises), then added into
// kLanes fixed lanes: lane l takes tokens lo+l, lo+l+kLanes, ...; the tail goes to lane 0;
// lanes are combined in a fixed order. The order depends only on (lo, hi), so the AVX-512,
// AVX2 and baseline builds of this loop give the same bits. No build fuses a multiply and
// an add (-ffp-contract=off in setup.py and CMakeLists.txt: the AVX-512 target has FMA,
// and a fused multiply-add rounds once where the others round twice).
#define LOSSAGG_MASKED_SUM_BODY                                   \
  acc_t lane[kLanes] = {};                                        \
  int64_t i = lo;                                                 \
  for (; i + kBlock <= hi; i += kBlock) {                         \
    acc_t t[kBlock];                                              \
    for (int j = 0; j < kBlock; ++j) {                            \
      t[j] = masked_term(static_cast<acc_t>(v[i + j]), m[i + j]); \
    }                                                             \
    for (int j = 0; j < kBlock; j += kLanes) {                    \
      for (int l = 0; l < kLanes; ++l) {                          \
        lane[l] += t[j + l];                                      \
      }                                                           \
    }                                                             \
  }                                                               \
  for (; i < hi; ++i) {                                           \
    lane[0] += masked_term(static_cast<acc_t>(v[i]), m[i]);       \
  }                                                               \
  for (int width = kLanes / 2; width > 0; width /= 2) {           \
    for (int l = 0; l < width; ++l) {                             \
      lane[l] += lane[l + width];                                 \
    }                                                             \
  }                                                               \
  return lane[0];

template <typename acc_t, typename scalar_t, typename mask_t>
acc_t masked_sum_baseline(const scalar_t* __restrict v, const mask_t* __restrict m, int64_t lo, int64_t hi) {
  LOSSAGG_MASKED_SUM_BODY
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LOSSAGG_HAVE_X86_PATHS 1
// The targets every per-ISA clone below is compiled for (the same source each time).
#define LOSSAGG_TARGET_AVX2 __attribute__((target("avx2,f16c")))
#define LOSSAGG_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,prefer-vector-width=512")))
template <typename acc_t, typename scalar_t, typename mask_t>
LOSSAGG_TARGET_AVX2 acc_t masked_sum_avx2(const scalar_t* __restrict v, const mask_t* __restrict m, int64_t lo, int64_t hi) {
  LOSSAGG_MASKED_SUM_BODY
}

template <typename acc_t, typename scalar_t, typename mask_t>
LOSSAGG_TARGET_AVX512 acc_t
masked_sum_avx512(const scalar_t* __restrict v, const mask_t* __restrict m, int64_t lo, int64_t hi) {
  LOSSAGG_MASKED_SUM_BODY
}
#endif

// The masked sum of a short run (fewer than kBlock tokens, more than kWindow): the loop
// above sends all of them to lane 0 in token order, and adding the other lanes' +0.0
// changes nothing (a sum started at +0.0 is never -0.0), so this plain loop gives the
// same bits.
template <typename acc_t, typename scalar_t, typename mask_t>
inline acc_t masked_sum_short(const scalar_t* v, const mask_t* m, int64_t lo, int64_t hi) {
  acc_t total = acc_t(0);
  for (int64_t i = lo; i < hi; ++i) {
    total += masked_term(static_cast<acc_t>(v[i]), m[i]);
  }
  return total;
}

// Segments of at most kWindow tokens are summed as a fixed tree over a window of
// kWindow terms, the terms past the segment being +0.0: t[j] + t[j + 8] (j < 8), then the
// 8 results pairwise (j with j + 4, then j + 2, then j + 1), then +0.0 added (so the sum is
// never -0.0, as for every other segment). The padding terms are +0.0, so a window of 8
// gives the same bits as one of 16 for a segment of at most 8 tokens. The tree is written
// once as scalar code (window_tree) and once with SSE2 (x86-64's baseline, so every x86
// build has it); both do the same additions in the same order.
constexpr int kWindow = 16;

// Scalar tree over t[0, 16) (t past the segment must be +0.0).
template <typename acc_t>
inline acc_t window_tree(const acc_t* t) {
  acc_t u[8];
  for (int j = 0; j < 8; ++j) {
    u[j] = t[j] + t[j + 8];
  }
  const acc_t a0 = u[0] + u[4], a1 = u[1] + u[5], a2 = u[2] + u[6], a3 = u[3] + u[7];
  return acc_t(0) + ((a0 + a2) + (a1 + a3));
}

// The window sum of a segment's terms, read from a buffer of terms: buf[0, len) are the
// segment's, and buf may be read up to buf + kWindow (what lies past len is ignored).
template <typename acc_t>
inline acc_t window_sum(const acc_t* buf, int64_t len) {
  acc_t t[kWindow];
  for (int j = 0; j < kWindow; ++j) {
    t[j] = j < len ? buf[j] : acc_t(0);
  }
  return window_tree(t);
}

#if defined(__SSE2__)
template <>
inline float window_sum<float>(const float* buf, int64_t len) {
  const __m128i n = _mm_set1_epi32(static_cast<int32_t>(len));
  auto part = [&](int j) {  // terms j .. j+3, +0.0 past len
    const __m128i keep = _mm_cmplt_epi32(_mm_setr_epi32(j, j + 1, j + 2, j + 3), n);
    return _mm_and_ps(_mm_loadu_ps(buf + j), _mm_castsi128_ps(keep));
  };
  __m128 a;  // a_j = u_j + u_{j+4}, u_j = t_j + t_{j+8}
  if (len <= 8) {
    a = _mm_add_ps(part(0), part(4));  // t_{j+8} = +0.0: u_j + 0 only changes a -0.0, which the last +0.0 clears
  } else {
    a = _mm_add_ps(_mm_add_ps(part(0), part(8)), _mm_add_ps(part(4), part(12)));
  }
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));           // b0 = a0 + a2, b1 = a1 + a3
  const __m128 c = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));        // b0 + b1
  return 0.0f + _mm_cvtss_f32(c);
}
#endif

// The window sum of v[lo, hi) read directly (for segments met outside the batched path).
template <typename acc_t, typename scalar_t, typename mask_t>
inline acc_t masked_sum_window(const scalar_t* v, const mask_t* m, int64_t lo, int64_t hi) {
  acc_t t[kWindow] = {};
  for (int64_t i = lo; i < hi; ++i) {
    t[i - lo] = masked_term(static_cast<acc_t>(v[i]), m[i]);
  }
  return window_tree(t);
}

#ifdef LOSSAGG_HAVE_X86_PATHS
// float32 values with a bool or float32 mask, the usual case, written with AVX2
// intrinsics: the same lanes (four 8-float registers hold lanes 0..31), the same block
// order, the same tail and combine as LOSSAGG_MASKED_SUM_BODY, so the same bits; the
// compiler's own vectorisation of that body spends most of its time widening the mask.
// Also used on AVX-512 CPUs (AVX2 instructions run there).
static_assert(kLanes == 32 && kBlock == 64, "masked_sum_f32_avx2 hard-codes 32 lanes and 64-token blocks");

template <typename mask_t>
__attribute__((target("avx2"))) inline __m256 keep_f32_avx2(const float* v, const mask_t* m) {
  if constexpr (is_binary_mask_v<mask_t>) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)));
    const __m256i keep = _mm256_cmpgt_epi32(bytes, _mm256_setzero_si256());  // bytes are 0..255: non-zero is > 0
    return _mm256_and_ps(_mm256_loadu_ps(v), _mm256_castsi256_ps(keep));
  } else {
    const __m256 w = _mm256_loadu_ps(m);
    const __m256 keep = _mm256_cmp_ps(w, _mm256_setzero_ps(), _CMP_NEQ_UQ);  // w != 0, true for NaN as in select_kept
    return _mm256_mul_ps(_mm256_and_ps(_mm256_loadu_ps(v), keep), w);
  }
}

template <typename mask_t>
__attribute__((target("avx2"))) float masked_sum_f32_avx2(const float* v, const mask_t* m, int64_t lo, int64_t hi) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
  int64_t i = lo;
  for (; i + kBlock <= hi; i += kBlock) {
    acc0 = _mm256_add_ps(acc0, keep_f32_avx2(v + i, m + i));
    acc1 = _mm256_add_ps(acc1, keep_f32_avx2(v + i + 8, m + i + 8));
    acc2 = _mm256_add_ps(acc2, keep_f32_avx2(v + i + 16, m + i + 16));
    acc3 = _mm256_add_ps(acc3, keep_f32_avx2(v + i + 24, m + i + 24));
    acc0 = _mm256_add_ps(acc0, keep_f32_avx2(v + i + 32, m + i + 32));
    acc1 = _mm256_add_ps(acc1, keep_f32_avx2(v + i + 40, m + i + 40));
    acc2 = _mm256_add_ps(acc2, keep_f32_avx2(v + i + 48, m + i + 48));
    acc3 = _mm256_add_ps(acc3, keep_f32_avx2(v + i + 56, m + i + 56));
  }
  float lane[kLanes];
  _mm256_storeu_ps(lane, acc0);
  _mm256_storeu_ps(lane + 8, acc1);
  _mm256_storeu_ps(lane + 16, acc2);
  _mm256_storeu_ps(lane + 24, acc3);
  for (; i < hi; ++i) {
    lane[0] += masked_term(v[i], m[i]);
  }
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) {
      lane[l] += lane[l + width];
    }
  }
  return lane[0];
}
#endif

template <typename acc_t, typename scalar_t, typename mask_t>
inline acc_t masked_sum(Isa isa, const scalar_t* v, const mask_t* m, int64_t lo, int64_t hi) {
  if (hi - lo <= kWindow) {
    return masked_sum_window<acc_t>(v, m, lo, hi);
  }
  if (hi - lo < kBlock) {
    return masked_sum_short<acc_t>(v, m, lo, hi);
  }
#ifdef LOSSAGG_HAVE_X86_PATHS
  if constexpr (std::is_same_v<acc_t, float> && std::is_same_v<scalar_t, float> && (is_binary_mask_v<mask_t> || std::is_same_v<mask_t, float>)) {
    if (isa != Isa::baseline) {
      return masked_sum_f32_avx2(v, m, lo, hi);
    }
  }
  if (isa == Isa::avx512) {
    return masked_sum_avx512<acc_t>(v, m, lo, hi);
  }
  if (isa == Isa::avx2) {
    return masked_sum_avx2<acc_t>(v, m, lo, hi);
  }
#endif
  return masked_sum_baseline<acc_t>(v, m, lo, hi);
}

// buf[t - lo] = the masked term of token t, for t in [lo, hi): elementwise, so every
// build gives the same bits.
#define LOSSAGG_TERMS_BODY                                            \
  for (int64_t i = lo; i < hi; ++i) {                                 \
    buf[i - lo] = masked_term(static_cast<acc_t>(v[i]), m[i]);        \
  }

template <typename acc_t, typename scalar_t, typename mask_t>
void masked_terms_baseline(acc_t* __restrict buf, const scalar_t* __restrict v, const mask_t* __restrict m, int64_t lo, int64_t hi) {
  LOSSAGG_TERMS_BODY
}

#ifdef LOSSAGG_HAVE_X86_PATHS
template <typename acc_t, typename scalar_t, typename mask_t>
LOSSAGG_TARGET_AVX2 void
masked_terms_avx2(acc_t* __restrict buf, const scalar_t* __restrict v, const mask_t* __restrict m, int64_t lo, int64_t hi) {
  LOSSAGG_TERMS_BODY
}

template <typename acc_t, typename scalar_t, typename mask_t>
LOSSAGG_TARGET_AVX512 void
masked_terms_avx512(acc_t* __restrict buf, const scalar_t* __restrict v, const mask_t* __restrict m, int64_t lo, int64_t hi) {
  LOSSAGG_TERMS_BODY
}
#endif

template <typename acc_t, typename scalar_t, typename mask_t>
inline void masked_terms(Isa isa, acc_t* buf, const scalar_t* v, const mask_t* m, int64_t lo, int64_t hi) {
#ifdef LOSSAGG_HAVE_X86_PATHS
  if (isa == Isa::avx512) {
    return masked_terms_avx512(buf, v, m, lo, hi);
  }
  if (isa == Isa::avx2) {
    return masked_terms_avx2(buf, v, m, lo, hi);
  }
#endif
  masked_terms_baseline(buf, v, m, lo, hi);
}

// o[t] = mask_weight(m[t]) * c for t in [lo, hi) (0 where the mask is 0), in the values
// dtype. Elementwise, so every build gives the same bits.
#define LOSSAGG_FILL_BODY                                 \
  for (int64_t i = lo; i < hi; ++i) {                     \
    o[i] = static_cast<scalar_t>(masked_term(c, m[i]));   \
  }

template <typename scalar_t, typename acc_t, typename mask_t>
void masked_fill_baseline(scalar_t* __restrict o, const mask_t* __restrict m, acc_t c, int64_t lo, int64_t hi) {
  LOSSAGG_FILL_BODY
}

#ifdef LOSSAGG_HAVE_X86_PATHS
template <typename scalar_t, typename acc_t, typename mask_t>
LOSSAGG_TARGET_AVX2 void masked_fill_avx2(scalar_t* __restrict o, const mask_t* __restrict m, acc_t c, int64_t lo, int64_t hi) {
  LOSSAGG_FILL_BODY
}

template <typename scalar_t, typename acc_t, typename mask_t>
LOSSAGG_TARGET_AVX512 void
masked_fill_avx512(scalar_t* __restrict o, const mask_t* __restrict m, acc_t c, int64_t lo, int64_t hi) {
  LOSSAGG_FILL_BODY
}
#endif

template <typename scalar_t, typename acc_t, typename mask_t>
inline void masked_fill(Isa isa, scalar_t* o, const mask_t* m, acc_t c, int64_t lo, int64_t hi) {
  if (hi - lo < kBlock) {  // not worth a call into a wider clone
    return masked_fill_baseline(o, m, c, lo, hi);
  }
#ifdef LOSSAGG_HAVE_X86_PATHS
  if (isa == Isa::avx512) {
    return masked_fill_avx512(o, m, c, lo, hi);
  }
  if (isa == Isa::avx2) {
    return masked_fill_avx2(o, m, c, lo, hi);
  }
#endif
  masked_fill_baseline(o, m, c, lo, hi);
}

// o[t] = mask_weight(m[t]) * c[t - lo] for t in [lo, hi) (0 where the mask is 0), in the
// values dtype: masked_fill with a coefficient per token. Elementwise.
#define LOSSAGG_SCALE_BODY                                          \
  for (int64_t i = lo; i < hi; ++i) {                               \
    o[i] = static_cast<scalar_t>(masked_term(c[i - lo], m[i]));     \
  }

template <typename scalar_t, typename acc_t, typename mask_t>
void masked_scale_baseline(scalar_t* __restrict o, const mask_t* __restrict m, const acc_t* __restrict c, int64_t lo, int64_t hi) {
  LOSSAGG_SCALE_BODY
}

#ifdef LOSSAGG_HAVE_X86_PATHS
template <typename scalar_t, typename acc_t, typename mask_t>
LOSSAGG_TARGET_AVX2 void
masked_scale_avx2(scalar_t* __restrict o, const mask_t* __restrict m, const acc_t* __restrict c, int64_t lo, int64_t hi) {
  LOSSAGG_SCALE_BODY
}

template <typename scalar_t, typename acc_t, typename mask_t>
LOSSAGG_TARGET_AVX512 void
masked_scale_avx512(scalar_t* __restrict o, const mask_t* __restrict m, const acc_t* __restrict c, int64_t lo, int64_t hi) {
  LOSSAGG_SCALE_BODY
}
#endif

template <typename scalar_t, typename acc_t, typename mask_t>
inline void masked_scale(Isa isa, scalar_t* o, const mask_t* m, const acc_t* c, int64_t lo, int64_t hi) {
#ifdef LOSSAGG_HAVE_X86_PATHS
  if (isa == Isa::avx512) {
    return masked_scale_avx512(o, m, c, lo, hi);
  }
  if (isa == Isa::avx2) {
    return masked_scale_avx2(o, m, c, lo, hi);
  }
#endif
  masked_scale_baseline(o, m, c, lo, hi);
}

// Below this much work (tokens x metrics) a call stays on the calling thread: opening a
// parallel region costs more than it saves, and under load it waits for a busy core.
constexpr int64_t kSerialWork = int64_t(1) << 16;
// A parallel task gets at least about this much work.
constexpr int64_t kTaskWork = int64_t(1) << 15;

// The pieces of a call. When no segment is longer than kPieceTokens, piece p is segment p
// and nothing is stored; otherwise offsets_[s] .. offsets_[s+1] are the pieces of segment s.
template <typename offset_t>
class PiecePlan {
 public:
  PiecePlan(const Segments<offset_t>& seg, int64_t num_segments, int64_t max_segment_tokens) : seg_(seg), num_segments_(num_segments) {
    if (max_segment_tokens < 0) {  // not known from the checks: measure
      max_segment_tokens = 0;
      for (int64_t s = 0; s < num_segments; ++s) {
        max_segment_tokens = std::max(max_segment_tokens, seg.end(s) - seg.begin(s));
      }
    }
    if (max_segment_tokens > kPieceTokens) {
      offsets_.resize(num_segments + 1);
      offsets_[0] = 0;
      for (int64_t s = 0; s < num_segments; ++s) {
        offsets_[s + 1] = offsets_[s] + (seg.end(s) - seg.begin(s) + kPieceTokens - 1) / kPieceTokens;
      }
    }
  }

  bool pieces_are_segments() const {
    return offsets_.empty();
  }
  int64_t num_pieces() const {
    return offsets_.empty() ? num_segments_ : offsets_.back();
  }
  int64_t first_piece(int64_t s) const {
    return offsets_.empty() ? s : offsets_[s];
  }
  // The segment holding piece p.
  int64_t segment_of(int64_t p) const {
    return offsets_.empty() ? p : std::upper_bound(offsets_.begin(), offsets_.end(), p) - offsets_.begin() - 1;
  }
  // The token where piece p starts.
  int64_t start(int64_t p) const {
    const int64_t s = segment_of(p);
    return seg_.begin(s) + (p - first_piece(s)) * kPieceTokens;
  }

  // f(segment, piece, lo, hi) for pieces [first, last), in order.
  template <typename F>
  void run(int64_t first, int64_t last, F& f) const {
    if (offsets_.empty()) {
      for (int64_t s = first; s < last; ++s) {
        f(s, s, seg_.begin(s), seg_.end(s));
      }
      return;
    }
    int64_t s = segment_of(first);
    for (int64_t p = first; p < last; ++p) {
      while (offsets_[s + 1] <= p) {
        ++s;
      }
      const int64_t lo = seg_.begin(s) + (p - offsets_[s]) * kPieceTokens;
      f(s, p, lo, std::min(seg_.end(s), lo + kPieceTokens));
    }
  }

 private:
  Segments<offset_t> seg_;
  int64_t num_segments_;
  std::vector<int64_t> offsets_;
};

// Calls g(first, last) for ranges of pieces covering every piece once: one range on the
// calling thread for small calls, else tasks of about equal token counts. Each piece's
// result depends on the piece alone, so the bits never depend on the partition.
template <typename offset_t, typename G>
void for_each_task(const PiecePlan<offset_t>& plan, int64_t num_tokens, int64_t work_per_token, G&& g, int64_t serial_work = kSerialWork) {
  const int64_t num_pieces = plan.num_pieces();
  const int64_t work = num_tokens * std::max<int64_t>(work_per_token, 1) + num_pieces;
  const int64_t threads = at::get_num_threads();
  if (num_pieces <= 1 || threads <= 1 || work < serial_work || at::in_parallel_region()) {
    g(int64_t(0), num_pieces);
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
      if (plan.start(mid) < target) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    bounds[c] = lo;
  }
  at::parallel_for(0, tasks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      g(bounds[c], bounds[c + 1]);
    }
  });
}

// Calls f(segment, piece, lo, hi) for every piece (see for_each_task).
template <typename offset_t, typename F>
void for_each_piece(const PiecePlan<offset_t>& plan, int64_t num_tokens, int64_t work_per_token, F&& f) {
  for_each_task(plan, num_tokens, work_per_token, [&](int64_t first, int64_t last) { plan.run(first, last, f); });
}

// Short segments are handled a batch at a time: consecutive segments of at most kWindow
// tokens, kBatchTokens tokens at most in all. Their terms are computed in one
// vectorised pass into a buffer, then each segment is summed from the buffer (or, for
// the gradient, each segment's coefficient is written over its window of the buffer, then
// one vectorised pass writes the tokens).
constexpr int64_t kBatchTokens = 2048;

// The end of the batch of short segments starting at s (< last): the first segment
// that is too long or would overflow the batch.
template <typename offset_t>
inline int64_t short_batch_end(const Segments<offset_t>& seg, int64_t s, int64_t last) {
  const int64_t first_token = seg.begin(s);
  int64_t e = s;
  while (e < last && seg.end(e) - seg.begin(e) <= kWindow && seg.end(e) - first_token <= kBatchTokens) {
    ++e;
  }
  return e;
}

// out[k * B + s] = sum over tokens t of segment s of mask_weight(m[t]) * v[k * ntok + t],
// masked-out tokens selected away.
template <typename acc_t, typename scalar_t, typename mask_t, typename offset_t>
void segment_sums(const scalar_t* v, const mask_t* m, const TokenLayout& layout, const Segments<offset_t>& seg, acc_t* out) {
  const Isa isa = active_isa();
  const int64_t num_metrics = layout.num_metrics;
  const int64_t num_tokens = layout.num_tokens;
  const int64_t num_segments = layout.num_segments;
  const PiecePlan<offset_t> plan(seg, num_segments, layout.max_segment_tokens);
  if (plan.pieces_are_segments()) {
    for_each_task(plan, num_tokens, num_metrics, [&](int64_t first, int64_t last) {
      acc_t buf[kBatchTokens + kWindow];
      int64_t s = first;
      while (s < last) {
        const int64_t e = short_batch_end(seg, s, last);
        if (e == s) {  // a longer segment
          for (int64_t k = 0; k < num_metrics; ++k) {
            out[k * num_segments + s] = masked_sum<acc_t>(isa, v + k * num_tokens, m, seg.begin(s), seg.end(s));
          }
          ++s;
          continue;
        }
        const int64_t lo = seg.begin(s), hi = seg.end(e - 1);
        for (int64_t k = 0; k < num_metrics; ++k) {
          masked_terms<acc_t>(isa, buf, v + k * num_tokens, m, lo, hi);
          for (int j = 0; j < kWindow; ++j) {  // window_sum may read up to kWindow past the batch (and ignores it)
            buf[hi - lo + j] = acc_t(0);
          }
          for (int64_t r = s; r < e; ++r) {
            out[k * num_segments + r] = window_sum(buf + (seg.begin(r) - lo), seg.end(r) - seg.begin(r));
          }
        }
        s = e;
      }
    });
    return;
  }
  const int64_t num_pieces = plan.num_pieces();
  std::vector<acc_t> partial(static_cast<size_t>(num_metrics * num_pieces));
  for_each_piece(plan, num_tokens, num_metrics, [&](int64_t, int64_t p, int64_t lo, int64_t hi) {
    for (int64_t k = 0; k < num_metrics; ++k) {
      partial[k * num_pieces + p] = masked_sum<acc_t>(isa, v + k * num_tokens, m, lo, hi);
    }
  });
  auto combine = [&](int64_t first, int64_t last) {
    for (int64_t k = 0; k < num_metrics; ++k) {
      for (int64_t s = first; s < last; ++s) {
        acc_t total = acc_t(0);
        for (int64_t p = plan.first_piece(s); p < plan.first_piece(s + 1); ++p) {
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

// out[k * ntok + t] = mask_weight(m[t]) * coef[k * B + s] for t in segment s (0 where the
// mask is 0), written in the values dtype.
template <typename scalar_t, typename acc_t, typename mask_t, typename offset_t>
void expand_to_tokens(scalar_t* out, const mask_t* m, const TokenLayout& layout, const Segments<offset_t>& seg, const acc_t* coef) {
  const Isa isa = active_isa();
  const int64_t num_segments = layout.num_segments;
  const int64_t num_tokens = layout.num_tokens;
  const PiecePlan<offset_t> plan(seg, num_segments, layout.max_segment_tokens);
  if (plan.pieces_are_segments()) {
    for_each_task(plan, num_tokens, layout.num_metrics, [&](int64_t first, int64_t last) {
      acc_t buf[kBatchTokens + kWindow];
      int64_t s = first;
      while (s < last) {
        const int64_t e = short_batch_end(seg, s, last);
        if (e == s) {
          for (int64_t k = 0; k < layout.num_metrics; ++k) {
            masked_fill<scalar_t, acc_t>(isa, out + k * num_tokens, m, coef[k * num_segments + s], seg.begin(s), seg.end(s));
          }
          ++s;
          continue;
        }
        const int64_t lo = seg.begin(s), hi = seg.end(e - 1);
        for (int64_t k = 0; k < layout.num_metrics; ++k) {
          // each segment's coefficient over a whole window of the buffer; the next
          // segment's window overwrites what spilled past the segment
          for (int64_t r = s; r < e; ++r) {
            acc_t* w = buf + (seg.begin(r) - lo);
            const acc_t c = coef[k * num_segments + r];
            for (int j = 0; j < kWindow; ++j) {
              w[j] = c;
            }
          }
          masked_scale<scalar_t, acc_t>(isa, out + k * num_tokens, m, buf, lo, hi);
        }
        s = e;
      }
    });
    return;
  }
  for_each_piece(plan, num_tokens, layout.num_metrics, [&](int64_t s, int64_t, int64_t lo, int64_t hi) {
    for (int64_t k = 0; k < layout.num_metrics; ++k) {
      masked_fill<scalar_t, acc_t>(isa, out + k * num_tokens, m, coef[k * num_segments + s], lo, hi);
    }
  });
}

// Tokens of m[lo, hi) whose mask is non-zero, counted in 32-bit lanes over chunks (so
// the loop vectorises) and added up in 64 bits.
#define LOSSAGG_COUNT_BODY                                                     \
  int64_t total = 0;                                                           \
  for (int64_t c = lo; c < hi; c += kCountChunk) {                             \
    const int64_t e = std::min(hi, c + kCountChunk);                           \
    uint32_t n = 0;                                                            \
    for (int64_t t = c; t < e; ++t) {                                          \
      n += static_cast<uint32_t>(is_kept(m[t]));                               \
    }                                                                          \
    total += n;                                                                \
  }                                                                            \
  return total;

constexpr int64_t kCountChunk = int64_t(1) << 20;

template <typename mask_t>
inline bool is_kept(mask_t m) {
  if constexpr (is_binary_mask_v<mask_t>) {
    return m.value != 0;
  } else {
    return m != mask_t(0);
  }
}

template <typename mask_t>
int64_t count_kept_baseline(const mask_t* __restrict m, int64_t lo, int64_t hi) {
  LOSSAGG_COUNT_BODY
}

#ifdef LOSSAGG_HAVE_X86_PATHS
template <typename mask_t>
LOSSAGG_TARGET_AVX2 int64_t count_kept_avx2(const mask_t* __restrict m, int64_t lo, int64_t hi) {
  LOSSAGG_COUNT_BODY
}

template <typename mask_t>
LOSSAGG_TARGET_AVX512 int64_t
count_kept_avx512(const mask_t* __restrict m, int64_t lo, int64_t hi) {
  LOSSAGG_COUNT_BODY
}
#endif

#ifdef LOSSAGG_HAVE_X86_PATHS
// One-byte masks (bool, uint8, int8): 32 bytes compared with 0 at a time, the kept ones
// counted from the compare's bit mask.
__attribute__((target("avx2,popcnt"))) inline int64_t count_nonzero_bytes_avx2(const uint8_t* p, int64_t n) {
  int64_t total = 0;
  int64_t i = 0;
  const __m256i zero = _mm256_setzero_si256();
  for (; i + 32 <= n; i += 32) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
    const uint32_t zeros = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(x, zero)));
    total += 32 - __builtin_popcount(zeros);
  }
  for (; i < n; ++i) {
    total += p[i] != 0;
  }
  return total;
}
#endif

template <typename mask_t>
inline int64_t count_kept_range(Isa isa, const mask_t* m, int64_t lo, int64_t hi) {
#ifdef LOSSAGG_HAVE_X86_PATHS
  if constexpr (sizeof(mask_t) == 1) {
    if (isa != Isa::baseline && hi - lo >= 32) {
      return count_nonzero_bytes_avx2(reinterpret_cast<const uint8_t*>(m) + lo, hi - lo);
    }
  }
#endif
  if (hi - lo < 32) {
    int64_t n = 0;
    for (int64_t t = lo; t < hi; ++t) {
      n += is_kept(m[t]);
    }
    return n;
  }
#ifdef LOSSAGG_HAVE_X86_PATHS
  if (isa == Isa::avx512) {
    return count_kept_avx512(m, lo, hi);
  }
  if (isa == Isa::avx2) {
    return count_kept_avx2(m, lo, hi);
  }
#endif
  return count_kept_baseline(m, lo, hi);
}

// out[s] = number of tokens of segment s whose mask is non-zero (exact, int64).
template <typename mask_t, typename offset_t>
void count_kept(const mask_t* m, const TokenLayout& layout, const Segments<offset_t>& seg, int64_t* out) {
  const Isa isa = active_isa();
  const PiecePlan<offset_t> plan(seg, layout.num_segments, 0);  // integers: one piece per segment, any order is exact
  // counting is cheap: a thread is worth waking only for about a million tokens
  for_each_task(
      plan, layout.num_tokens, 1,
      [&](int64_t first, int64_t last) {
        for (int64_t s = first; s < last; ++s) {
          out[s] = count_kept_range(isa, m, seg.begin(s), seg.end(s));
        }
      },
      int64_t(1) << 20);
}

// sum_s x[s] / d[s] in a fixed order: lane l takes s = l, l + kLanes, ...; lanes are
// combined as in masked_sum. Depends only on the input (not threads, not the ISA).
template <typename acc_t, typename denom_t>
acc_t weighted_total(const acc_t* x, const denom_t* d, int64_t n) {
  acc_t lane[kLanes] = {};
  int64_t s = 0;
  for (; s + kLanes <= n; s += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      lane[l] += x[s + l] / static_cast<acc_t>(d[s + l]);
    }
  }
  for (; s < n; ++s) {
    lane[0] += x[s] / static_cast<acc_t>(d[s]);
  }
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) {
      lane[l] += lane[l + width];
    }
  }
  return lane[0];
}

}  // namespace lossagg::cpu
