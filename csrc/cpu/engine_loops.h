// The CPU engine's loops, written once. Included (with no include guard) by each of
// engine_baseline.cpp, engine_avx2.cpp and engine_avx512.cpp after their target is set,
// inside namespace lossagg::cpu::LOSSAGG_ISA; LOSSAGG_ISA_LEVEL is 0, 1 (AVX2) or 2
// (AVX-512). Each unit defines its table `kEngine` (engine.h).
//
// Every build adds in the same order (the order is a function of the input only), and no
// build fuses a multiply and an add (-ffp-contract=off in CMakeLists.txt: the AVX-512
// target has FMA, and a fused multiply-add rounds once where the others round twice).
//
// This file includes nothing but its intrinsics (vec/vec128.h, vec256.h, vec512.h, each
// guarded by LOSSAGG_ISA_LEVEL): engine_deps.h, included before the target is set, brings
// every other header, so their inline functions stay baseline code. The lanes (kLanes) and
// their combine are lanes.h's.

namespace lossagg::cpu::LOSSAGG_ISA {
namespace {

constexpr int kBlock = 64;  // tokens converted per step

// Metric k's row of values (T const) or of outputs: table[k] when the op gives K tensors of
// their own (reduce_terms and its backward), else base + k * stride (the rows of one [K, T]
// tensor). Looked up once per metric and piece, never per token, and built without an
// allocation (no heap, no throwing path, in the entry points).
template <typename T>
struct Rows {
  T* base;
  int64_t stride;
  const void* const* table;
  T* operator[](int64_t k) const { return table != nullptr ? static_cast<T*>(const_cast<void*>(table[k])) : base + k * stride; }
};

// Masked sum of v[lo, hi), hi - lo >= kBlock. Tokens are converted a block at a time
// into a small buffer (a loop without a reduction, which vectorises), then added into
// kLanes fixed lanes: lane l takes tokens lo+l, lo+l+kLanes, ...; the tail goes to lane 0;
// lanes are combined in a fixed order. The order depends only on (lo, hi).
template <typename acc_t, typename scalar_t, typename mask_t>
acc_t masked_sum_lanes(const scalar_t* __restrict v, const mask_t* __restrict m, int64_t lo, int64_t hi) {
  acc_t lane[kLanes] = {};
  int64_t i = lo;
  for (; i + kBlock <= hi; i += kBlock) {
    acc_t t[kBlock];
    for (int j = 0; j < kBlock; ++j) {
      t[j] = masked_term(static_cast<acc_t>(v[i + j]), m[i + j]);
    }
    for (int j = 0; j < kBlock; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        lane[l] += t[j + l];
      }
    }
  }
  for (; i < hi; ++i) {
    lane[0] += masked_term(static_cast<acc_t>(v[i]), m[i]);
  }
  return combine_lanes(lane);
}

// The masked sum of a short run (fewer than kBlock tokens, more than kWindow):
// masked_sum_lanes sends all of them to lane 0 in token order, and adding the other
// lanes' +0.0 changes nothing (a sum started at +0.0 is never -0.0), so this plain loop
// gives the same bits.
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
// once as scalar code (window_tree) and once with SSE2 (x86-64's baseline); both do the
// same additions in the same order.
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

// The intrinsics: one header per instruction set (vec/), each guarded by the unit's level, so
// this file holds the portable loops only and names what those headers define where the
// level has it.
#include "vec/vec128.h"
#include "vec/vec256.h"
#include "vec/vec512.h"

// The window sum of v[lo, hi) read directly (for segments met outside the batched path).
template <typename acc_t, typename scalar_t, typename mask_t>
inline acc_t masked_sum_window(const scalar_t* v, const mask_t* m, int64_t lo, int64_t hi) {
  acc_t t[kWindow] = {};
  for (int64_t i = lo; i < hi; ++i) {
    t[i - lo] = masked_term(static_cast<acc_t>(v[i]), m[i]);
  }
  return window_tree(t);
}

// Tokens of m[lo, hi) whose mask is non-zero, counted in 32-bit lanes over chunks (so
// the loop vectorises) and added up in 64 bits.
constexpr int64_t kCountChunk = int64_t(1) << 20;

template <typename mask_t>
int64_t count_kept_range(const mask_t* __restrict m, int64_t lo, int64_t hi) {
#if LOSSAGG_ISA_LEVEL >= 1
  if constexpr (sizeof(mask_t) == 1) {
    return count_kept_bytes_avx2(reinterpret_cast<const uint8_t*>(m), lo, hi);
  }
#endif
  int64_t total = 0;
  for (int64_t c = lo; c < hi; c += kCountChunk) {
    const int64_t e = std::min(hi, c + kCountChunk);
    uint32_t n = 0;
    for (int64_t t = c; t < e; ++t) {
      n += static_cast<uint32_t>(is_kept(m[t]));
    }
    total += n;
  }
  return total;
}

// The masked sum of v[lo, hi) and, when kept is not null, its kept tokens (*kept; an
// integer, so counted in any order).
template <typename acc_t, typename scalar_t, typename mask_t>
inline acc_t masked_sum(const scalar_t* v, const mask_t* m, int64_t lo, int64_t hi, int64_t* kept = nullptr) {
#if LOSSAGG_ISA_LEVEL >= 2
  if constexpr (std::is_same_v<acc_t, float> && std::is_same_v<scalar_t, float> && (is_binary_mask_v<mask_t> || std::is_same_v<mask_t, float>)) {
    if (hi - lo >= kBlock) {
      return kept ? masked_sum_f32_avx512<true>(v, m, lo, hi, kept) : masked_sum_f32_avx512<false>(v, m, lo, hi, kept);
    }
  }
#endif
  if (kept) {
    *kept = count_kept_range(m, lo, hi);  // the mask of [lo, hi) is read again from the cache
  }
  if (hi - lo <= kWindow) {
    return masked_sum_window<acc_t>(v, m, lo, hi);
  }
  if (hi - lo < kBlock) {
    return masked_sum_short<acc_t>(v, m, lo, hi);
  }
#if LOSSAGG_ISA_LEVEL == 1
  if constexpr (std::is_same_v<acc_t, float> && std::is_same_v<scalar_t, float> && (is_binary_mask_v<mask_t> || std::is_same_v<mask_t, float>)) {
    return masked_sum_f32_avx2(v, m, lo, hi);
  }
#endif
  return masked_sum_lanes<acc_t>(v, m, lo, hi);
}

// buf[t - lo] = the masked term of token t, for t in [lo, hi): elementwise.
template <typename acc_t, typename scalar_t, typename mask_t>
void masked_terms(acc_t* __restrict buf, const scalar_t* __restrict v, const mask_t* __restrict m, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    buf[i - lo] = masked_term(static_cast<acc_t>(v[i]), m[i]);
  }
}

// o[t] = mask_weight(m[t]) * c for t in [lo, hi) (0 where the mask is 0), in the values
// dtype. Elementwise.
template <typename scalar_t, typename acc_t, typename mask_t>
void masked_fill(scalar_t* __restrict o, const mask_t* __restrict m, acc_t c, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    o[i] = static_cast<scalar_t>(masked_term(c, m[i]));
  }
}

// masked_fill with a coefficient per token: o[t] = mask_weight(m[t]) * c[t - lo].
template <typename scalar_t, typename acc_t, typename mask_t>
void masked_scale(scalar_t* __restrict o, const mask_t* __restrict m, const acc_t* __restrict c, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    o[i] = static_cast<scalar_t>(masked_term(c[i - lo], m[i]));
  }
}

// out[k * B + s]: the masked sums of metric k's values rows[k]; with counts not null (and
// K >= 1), also counts[s]: the kept tokens of segment s, counted as its mask is read (for
// metric 0). The metrics of a piece (or of a batch of short segments) are summed one after
// the other while its mask is in the cache: the mask is read from memory once for all K.
template <typename acc_t, typename scalar_t, typename mask_t>
void segment_sums(const Rows<const scalar_t>& rows, const mask_t* m, const TokenLayout& layout, const Segments& seg, acc_t* out, int64_t* counts) {
  const int64_t num_metrics = layout.num_metrics;
  const int64_t num_tokens = layout.num_tokens;
  const int64_t num_segments = layout.num_segments;
  const PiecePlan plan(seg, num_segments, layout.max_segment_tokens);
  if (plan.pieces_are_segments()) {
    for_each_task(plan, num_tokens, num_metrics, [&](int64_t first, int64_t last) {
      acc_t buf[kBatchTokens + kWindow];
#if LOSSAGG_ISA_LEVEL >= 2
      TailBatch tails;  // used by float32 sums only
#endif
      int64_t s = first;
      while (s < last) {
        const int64_t e = short_batch_end(seg, s, last);
#if LOSSAGG_ISA_LEVEL >= 2
        if constexpr (
            std::is_same_v<acc_t, float> && std::is_same_v<scalar_t, float> && (is_binary_mask_v<mask_t> || std::is_same_v<mask_t, float>)) {
          // segments of kBlock tokens or more: kGroup consecutive ones have their blocks
          // alternate; every one's tail goes to the batch
          if (const int64_t run = long_segments_f32_avx512(rows, m, layout, seg, s, last, out, counts, tails)) {
            s += run;
            continue;
          }
        }
#endif
        if (e == s) {  // a longer segment
          for (int64_t k = 0; k < num_metrics; ++k) {
            out[k * num_segments + s] = masked_sum<acc_t>(rows[k], m, seg.begin(s), seg.end(s), k == 0 && counts ? counts + s : nullptr);
          }
          ++s;
          continue;
        }
        const int64_t lo = seg.begin(s), hi = seg.end(e - 1);
        for (int64_t k = 0; k < num_metrics; ++k) {
          masked_terms<acc_t>(buf, rows[k], m, lo, hi);
          for (int j = 0; j < kWindow; ++j) {  // window_sum may read up to kWindow past the batch (and ignores it)
            buf[hi - lo + j] = acc_t(0);
          }
          for (int64_t r = s; r < e; ++r) {
            out[k * num_segments + r] = window_sum(buf + (seg.begin(r) - lo), seg.end(r) - seg.begin(r));
          }
        }
        if (counts) {
          for (int64_t r = s; r < e; ++r) {
            counts[r] = count_kept_range(m, seg.begin(r), seg.end(r));
          }
        }
        s = e;
      }
#if LOSSAGG_ISA_LEVEL >= 2
      tails.flush();
#endif
    });
    return;
  }
  const int64_t num_pieces = plan.num_pieces();
  std::vector<acc_t> partial(static_cast<size_t>(num_metrics * num_pieces));
  std::vector<int64_t> partial_counts(counts ? static_cast<size_t>(num_pieces) : 0);
  for_each_piece(plan, num_tokens, num_metrics, [&](int64_t, int64_t p, int64_t lo, int64_t hi) {
    for (int64_t k = 0; k < num_metrics; ++k) {
      partial[k * num_pieces + p] = masked_sum<acc_t>(rows[k], m, lo, hi, k == 0 && counts ? &partial_counts[p] : nullptr);
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
    if (counts) {
      for (int64_t s = first; s < last; ++s) {
        int64_t total = 0;
        for (int64_t p = plan.first_piece(s); p < plan.first_piece(s + 1); ++p) {
          total += partial_counts[p];
        }
        counts[s] = total;
      }
    }
  };
  if (num_segments * num_metrics < kSerialWork) {
    combine(0, num_segments);
  } else {
    torch::stable::parallel_for(0, num_segments, 4096, combine);
  }
}

// rows[k]: metric k's output.
template <typename scalar_t, typename acc_t, typename mask_t>
void expand_to_tokens(const Rows<scalar_t>& rows, const mask_t* m, const TokenLayout& layout, const Segments& seg, const acc_t* coef) {
  const int64_t num_segments = layout.num_segments;
  const int64_t num_tokens = layout.num_tokens;
  const PiecePlan plan(seg, num_segments, layout.max_segment_tokens);
  if (plan.pieces_are_segments()) {
    for_each_task(plan, num_tokens, layout.num_metrics, [&](int64_t first, int64_t last) {
      acc_t buf[kBatchTokens + kWindow];
      int64_t s = first;
      while (s < last) {
        const int64_t e = short_batch_end(seg, s, last);
        if (e == s) {
          for (int64_t k = 0; k < layout.num_metrics; ++k) {
            masked_fill<scalar_t, acc_t>(rows[k], m, coef[k * num_segments + s], seg.begin(s), seg.end(s));
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
          masked_scale<scalar_t, acc_t>(rows[k], m, buf, lo, hi);
        }
        s = e;
      }
    });
    return;
  }
  for_each_piece(plan, num_tokens, layout.num_metrics, [&](int64_t s, int64_t, int64_t lo, int64_t hi) {
    for (int64_t k = 0; k < layout.num_metrics; ++k) {
      masked_fill<scalar_t, acc_t>(rows[k], m, coef[k * num_segments + s], lo, hi);
    }
  });
}

template <typename mask_t>
void count_kept(const mask_t* m, const TokenLayout& layout, const Segments& seg, int64_t* out) {
  const PiecePlan plan(seg, layout.num_segments, 0);  // integers: one piece per segment, any order is exact
  // counting is cheap: a thread is worth waking only for about a million tokens
  for_each_task(
      plan, layout.num_tokens, 1,
      [&](int64_t first, int64_t last) {
        for (int64_t s = first; s < last; ++s) {
          out[s] = count_kept_range(m, seg.begin(s), seg.end(s));
        }
      },
      int64_t(1) << 20);
}

// The type-erased entry points: the kernel types are chosen here, once per op.
void segment_sums_entry(const KernelArgs& a, void* out, int64_t* counts) {
  dispatch_kernel_types(a.values_dtype, a.mask_kind, [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    const Rows<const S> rows{static_cast<const S*>(a.values), a.layout.num_tokens, a.value_rows};
    segment_sums<acc_t>(rows, static_cast<const M*>(a.mask), a.layout, a.seg, static_cast<acc_t*>(out), counts);
  });
}

void expand_to_tokens_entry(const KernelArgs& a, const void* coef, void* out, void* const* out_rows) {
  dispatch_kernel_types(a.values_dtype, a.mask_kind, [&]<typename S, typename M>(type_tag<S>, type_tag<M>) {
    using acc_t = acc_t_of<S>;
    const Rows<S> rows{static_cast<S*>(out), a.layout.num_tokens, out_rows};
    expand_to_tokens<S, acc_t>(rows, static_cast<const M*>(a.mask), a.layout, a.seg, static_cast<const acc_t*>(coef));
  });
}

void count_kept_entry(const KernelArgs& a, int64_t* out) {
  dispatch_mask_kind(a.mask_kind, [&]<typename M>(type_tag<M>) { count_kept(static_cast<const M*>(a.mask), a.layout, a.seg, out); });
}

}  // namespace

extern const Engine kEngine = {&segment_sums_entry, &expand_to_tokens_entry, &count_kept_entry};

}  // namespace lossagg::cpu::LOSSAGG_ISA
