// CPU engine shared by the segmented ops. Work is cut into fixed "pieces": each segment
// is split into runs of at most kPieceTokens tokens, so the order of every floating-point
// addition depends only on the input, never on the number of threads.
#pragma once

#include "../common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace lossagg::cpu {

constexpr int64_t kPieceTokens = 16384;
constexpr int kLanes = 8;

// Masked sum of v[lo, hi) with fixed lanes: lane l takes tokens lo+l, lo+l+kLanes, ...;
// the tail goes to lane 0; lanes are combined pairwise. Lanes are independent, so the
// compiler vectorises the loop without reordering any addition.
template <typename acc_t, typename scalar_t, typename mask_t>
acc_t masked_sum(const scalar_t* v, const mask_t* m, int64_t lo, int64_t hi) {
  acc_t lane[kLanes] = {};
  int64_t i = lo;
  for (; i + kLanes <= hi; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const acc_t w = mask_weight<acc_t>(m[i + l]);
      const acc_t x = static_cast<acc_t>(v[i + l]);
      lane[l] += (w != acc_t(0)) ? x * w : acc_t(0);
    }
  }
  for (; i < hi; ++i) {
    const acc_t w = mask_weight<acc_t>(m[i]);
    lane[0] += (w != acc_t(0)) ? static_cast<acc_t>(v[i]) * w : acc_t(0);
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
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

// Calls f(segment, piece, lo, hi) for every piece, in parallel over pieces.
template <typename offset_t, typename F>
void for_each_piece(const Segments<offset_t>& seg, const std::vector<int64_t>& piece_offsets, F&& f) {
  const int64_t num_pieces = piece_offsets.back();
  at::parallel_for(0, num_pieces, 1, [&](int64_t first, int64_t last) {
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
  });
}

// out[k * B + s] = sum over tokens t of segment s of mask_weight(m[t]) * v[k * ntok + t],
// masked-out tokens selected away.
template <typename acc_t, typename scalar_t, typename mask_t, typename offset_t>
void segment_sums(
    const scalar_t* v,
    const mask_t* m,
    int64_t num_metrics,
    int64_t num_tokens,
    const Segments<offset_t>& seg,
    int64_t num_segments,
    acc_t* out) {
  const std::vector<int64_t> pieces = plan_pieces(seg, num_segments);
  const int64_t num_pieces = pieces.back();
  std::vector<acc_t> partial(static_cast<size_t>(num_metrics * num_pieces));
  for_each_piece(seg, pieces, [&](int64_t, int64_t p, int64_t lo, int64_t hi) {
    for (int64_t k = 0; k < num_metrics; ++k) {
      partial[k * num_pieces + p] = masked_sum<acc_t>(v + k * num_tokens, m, lo, hi);
    }
  });
  at::parallel_for(0, num_segments, 256, [&](int64_t first, int64_t last) {
    for (int64_t k = 0; k < num_metrics; ++k) {
      for (int64_t s = first; s < last; ++s) {
        acc_t total = acc_t(0);
        for (int64_t p = pieces[s]; p < pieces[s + 1]; ++p) {
          total += partial[k * num_pieces + p];
        }
        out[k * num_segments + s] = total;
      }
    }
  });
}

// out[k * ntok + t] = mask_weight(m[t]) * coef(k, s) for t in segment s (0 where the mask
// is 0), written in the values dtype.
template <typename scalar_t, typename acc_t, typename mask_t, typename offset_t, typename Coef>
void expand_to_tokens(
    scalar_t* out,
    const mask_t* m,
    int64_t num_metrics,
    int64_t num_tokens,
    const Segments<offset_t>& seg,
    int64_t num_segments,
    Coef&& coef) {
  const std::vector<int64_t> pieces = plan_pieces(seg, num_segments);
  for_each_piece(seg, pieces, [&](int64_t s, int64_t, int64_t lo, int64_t hi) {
    for (int64_t k = 0; k < num_metrics; ++k) {
      const acc_t c = coef(k, s);
      scalar_t* o = out + k * num_tokens;
      for (int64_t i = lo; i < hi; ++i) {
        const acc_t w = mask_weight<acc_t>(m[i]);
        o[i] = static_cast<scalar_t>((w != acc_t(0)) ? c * w : acc_t(0));
      }
    }
  });
}

}  // namespace lossagg::cpu
