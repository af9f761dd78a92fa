// How the CPU engine splits a call into pieces and threads. ISA-neutral: included by the
// engine's translation units before their target is set, so this is baseline code shared
// by all of them.
//
// A call below kSerialWork (tokens x metrics) runs on the calling thread. A larger one is
// cut into tasks of about equal token counts at piece boundaries. When no segment is
// longer than a piece (the usual RL batch) pieces are the segments themselves: no piece
// table is built and each segment's sum is written straight to the output.
#pragma once

#include "../kernel_common.h"

#include "../torch_api.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace lossagg::cpu {

constexpr int64_t kPieceTokens = 16384;

// Below this much work (tokens x metrics) a call stays on the calling thread: opening a
// parallel region costs more than it saves, and under load it waits for a busy core.
constexpr int64_t kSerialWork = int64_t(1) << 16;
// A parallel task gets at least about this much work.
constexpr int64_t kTaskWork = int64_t(1) << 15;

// The pieces of a call. When no segment is longer than kPieceTokens, piece p is segment p
// and nothing is stored; otherwise offsets_[s] .. offsets_[s+1] are the pieces of segment s.
class PiecePlan {
 public:
  PiecePlan(const Segments& seg, int64_t num_segments, int64_t max_segment_tokens) : seg_(seg), num_segments_(num_segments) {
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

  bool pieces_are_segments() const { return offsets_.empty(); }
  int64_t num_pieces() const { return offsets_.empty() ? num_segments_ : offsets_.back(); }
  int64_t first_piece(int64_t s) const { return offsets_.empty() ? s : offsets_[s]; }
  // The segment holding piece p.
  int64_t segment_of(int64_t p) const { return offsets_.empty() ? p : std::upper_bound(offsets_.begin(), offsets_.end(), p) - offsets_.begin() - 1; }
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
  Segments seg_;
  int64_t num_segments_;
  std::vector<int64_t> offsets_;
};

// Calls g(first, last) for ranges of pieces covering every piece once: one range on the
// calling thread for small calls, else tasks of about equal token counts. Each piece's
// result depends on the piece alone, so the bits never depend on the partition.
template <typename G>
void for_each_task(const PiecePlan& plan, int64_t num_tokens, int64_t work_per_token, G&& g, int64_t serial_work = kSerialWork) {
  const int64_t num_pieces = plan.num_pieces();
  const int64_t work = num_tokens * std::max<int64_t>(work_per_token, 1) + num_pieces;
  // (inside another parallel region, torch's parallel_for runs the tasks inline)
  const int64_t threads = static_cast<int64_t>(torch::stable::get_num_threads());
  if (num_pieces <= 1 || threads <= 1 || work < serial_work) {
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
  torch::stable::parallel_for(0, tasks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      g(bounds[c], bounds[c + 1]);
    }
  });
}

// Calls f(segment, piece, lo, hi) for every piece (see for_each_task).
template <typename F>
void for_each_piece(const PiecePlan& plan, int64_t num_tokens, int64_t work_per_token, F&& f) {
  for_each_task(plan, num_tokens, work_per_token, [&](int64_t first, int64_t last) { plan.run(first, last, f); });
}

// Short segments are handled a batch at a time: consecutive segments of at most kWindow
// tokens, kBatchTokens tokens at most in all. Their terms are computed in one
// vectorised pass into a buffer, then each segment is summed from the buffer (or, for
// the gradient, each segment's coefficient is written over its window of the buffer, then
// one vectorised pass writes the tokens).
constexpr int kWindow = 16;
constexpr int64_t kBatchTokens = 2048;

// The end of the batch of short segments starting at s (< last): the first segment
// that is too long or would overflow the batch.
inline int64_t short_batch_end(const Segments& seg, int64_t s, int64_t last) {
  const int64_t first_token = seg.begin(s);
  int64_t e = s;
  while (e < last && seg.end(e) - seg.begin(e) <= kWindow && seg.end(e) - first_token <= kBatchTokens) {
    ++e;
  }
  return e;
}

}  // namespace lossagg::cpu
