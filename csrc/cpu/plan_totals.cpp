// The step totals and every term's d[i] of a plan made by one process (lossagg/totals.py defines each total,
// lossagg/denom_program.py each factor), from its samples' token counts and, where the mode reads them, their
// prompt-group and session labels, in a few passes over the samples: what lossagg.StepPlan reads to build
// its denominators without a process group (lossagg/step.py, the native route).
//
// Registered for the CPU only; every other case (a process group, counts on a device, weights, a mode whose
// d[i] is a function) takes the Python route, and so does a step this route declines (a status in 1..6 or 8
// below): the Python route then raises the error that names the problem, or serves the step. Sums are taken
// in the samples' order over whole-number counts, so they are exact, and each d[i] multiplies its factors in
// their declared order: the Python route's numbers bit for bit (tests/test_plan_native.py).
#include "plan_totals.h"

#include "../torch_api.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <unordered_map>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace lossagg::cpu {
namespace {

// What the route declines (the Python route then raises, naming it, or serves the step: 1..6 and 8), and 7, served.
enum Status : int64_t {
  kServed = 0,
  kCountNotWhole = 1,       // a count that is not finite, below 0 or not a whole number below 2**53
  kGroupSize = 2,           // a prompt group of another size than n_samples_per_prompt
  kSessionInGroups = 3,     // a session whose samples lie in several prompt groups
  kSessionsPerGroup = 4,    // a prompt group with another number of sessions than n_samples_per_prompt
  kTooManyForTheCheck = 5,  // beyond the exact range of the Python route's check that a session lies in one group
  kDenomNotPositive = 6,    // a d[i] that is not finite and > 0 (the Python route names it)
  kServedNotFloat32 = 7,    // served; some d[i] is not a normal finite float32, so the float32 table is d itself
  kTotalNotExact = 8        // the step's tokens add up to 2**53 or more, where a sum's order changes its rounding
};

// The scalars first in the output: status, N, N', T, L_max, P, P', S, S'.
constexpr int64_t kScalars = 9;
// The per-sample totals, by block: Sg[g(i)], K[s(i)], K'[s(i)], Ts[s(i)], Sp[g(i)], Sp'[g(i)].
constexpr int64_t kBlocks = 6;
// A factor's source (lossagg/step.py's _factor_codes): the divisor, the counts, a scalar's slot (1..8), or
// kScalars + a per-sample block; then three flags: read as a count (max(x, 1), skip's stand-in), clamped
// (c(x) = max(x, 1)), and 0 read as 1.
constexpr int64_t kDivisor = -1, kCounts = -2, kFactorFields = 4;
constexpr double kWhole = 9007199254740992.0;  // 2**53

// The runs of one set of labels (a run: consecutive samples of one label, as a step's samples of one prompt group
// or session usually lie): run k holds the samples [start[k], start[k + 1]); id[k] the dense id (0, 1, ... in any
// order) of run k's label, or none (nullptr) where each run is a label of its own, in order (id[k] = k); labels, how
// many distinct labels there are. Only finding the runs reads every label; the rest is done run by run. The runs are
// found here (held in own_start, own_id) or read from a layout made before (plan_layout; start and id point into it).
struct Runs {
  const int64_t* labels = nullptr;       // [n], as given (dense_ids reads each run's)
  const int64_t* start = nullptr;        // [runs + 1]
  const int64_t* id = nullptr;           // [runs], or nullptr
  std::unique_ptr<int64_t[]> own_start;  // uninitialised until written: no pass to zero it
  std::vector<int64_t> own_id;
  int64_t runs = 0, labels_count = 0;
};

void dense_ids(Runs& runs);

// The runs of `labels`: where each starts, in one pass over the samples without a branch (each sample's index is
// written to the slot after the last run found, which the next run's first sample keeps), then each run's label
// made dense.
void find_runs(const int64_t* labels, int64_t n, Runs& runs) {
  runs.labels = labels;
  runs.own_start.reset(new int64_t[n + 1]);
  int64_t* start = runs.own_start.get();
  runs.start = start;
  int64_t r = 0;
  start[0] = 0;
  for (int64_t i = 1; i < n; ++i) {
    start[r + 1] = i;
    r += labels[i] != labels[i - 1] ? 1 : 0;
  }
  runs.runs = n > 0 ? r + 1 : 0;
  start[runs.runs] = n;
  dense_ids(runs);
}

// The runs of the prompt groups and of the sessions together, in one pass as find_runs makes each; besides,
// whether a session run crosses a group boundary (a group's first sample is not a session's), and each group run's
// first session run (first [group runs + 1], its last slot the session runs' count).
bool find_both_runs(const int64_t* groups, const int64_t* sessions, int64_t n, Runs& g, Runs& s, std::unique_ptr<int64_t[]>& first) {
  g.labels = groups;
  s.labels = sessions;
  g.own_start.reset(new int64_t[n + 1]);
  s.own_start.reset(new int64_t[n + 1]);
  first.reset(new int64_t[n + 1]);
  int64_t* g_start = g.own_start.get();
  int64_t* s_start = s.own_start.get();
  int64_t* g_first = first.get();
  g.start = g_start;
  s.start = s_start;
  int64_t rg = 0, rs = 0, crosses = 0;
  g_start[0] = s_start[0] = g_first[0] = 0;
  for (int64_t i = 1; i < n; ++i) {
    const int64_t g_new = groups[i] != groups[i - 1] ? 1 : 0, s_new = sessions[i] != sessions[i - 1] ? 1 : 0;
    g_start[rg + 1] = i;
    s_start[rs + 1] = i;
    g_first[rg + 1] = rs + s_new;  // the session run holding sample i: kept where a group run starts
    crosses |= g_new & (s_new ^ 1);
    rg += g_new;
    rs += s_new;
  }
  g.runs = n > 0 ? rg + 1 : 0;
  s.runs = n > 0 ? rs + 1 : 0;
  g_start[g.runs] = s_start[s.runs] = n;
  g_first[g.runs] = s.runs;
  dense_ids(g);
  dense_ids(s);
  return crosses != 0;
}

// Each run's label made dense (runs.id, runs.labels_count).
void dense_ids(Runs& runs) {
  const int64_t* labels = runs.labels;
  const int64_t* start = runs.start;
  const int64_t count = runs.runs;
  runs.own_id.clear();
  runs.id = nullptr;
  // each run's label made dense. The common case first: labels rising run by run, so each run is a label of its own
  bool rising = true;
  for (int64_t k = 1; k < count; ++k) {
    rising &= labels[start[k]] > labels[start[k - 1]];
  }
  if (rising) {
    runs.labels_count = count;
    return;
  }
  runs.own_id.resize(count);
  int64_t* id = runs.own_id.data();
  runs.id = id;
  // else by direct address when the labels span little more than the runs, else by a hash map
  int64_t lo = labels[0], hi = labels[0];
  for (int64_t k = 1; k < count; ++k) {
    const int64_t label = labels[start[k]];
    lo = std::min(lo, label);
    hi = std::max(hi, label);
  }
  int64_t distinct = 0;
  const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);  // unsigned: no overflow
  if (span <= static_cast<uint64_t>(4 * count + 64)) {
    std::vector<int64_t> slot(span + 1, -1);
    for (int64_t k = 0; k < count; ++k) {
      int64_t& s = slot[static_cast<uint64_t>(labels[start[k]]) - static_cast<uint64_t>(lo)];
      s = s < 0 ? distinct++ : s;
      id[k] = s;
    }
  } else {
    std::unordered_map<int64_t, int64_t> slot;
    slot.reserve(static_cast<size_t>(count));
    for (int64_t k = 0; k < count; ++k) {
      auto [it, added] = slot.try_emplace(labels[start[k]], distinct);
      distinct += added ? 1 : 0;
      id[k] = it->second;
    }
  }
  runs.labels_count = distinct;
}

// What each label holds: without the running sums (tokens_before nullptr), its samples into `first`, from its runs'
// bounds (the labels only); with them, its non-empty samples into `first` and its tokens into `second`, from the
// running sums of the counts and of the non-empty samples (`before[i]`: the samples before sample i), each run's
// the difference of two: exact, every sum a whole number below 2**53 (checked before). A label of several runs adds
// its runs' in their order.
void label_sums(
    const Runs& runs, const uint64_t* tokens_before, const uint64_t* kept_before, std::vector<double>& first, std::vector<double>& second) {
  const int64_t* start = runs.start;
  const int64_t* id = runs.id;
  first.assign(runs.labels_count, 0.0);
  double* one = first.data();
  if (tokens_before == nullptr) {
    for (int64_t k = 0; k < runs.runs; ++k) {
      one[id == nullptr ? k : id[k]] += static_cast<double>(start[k + 1] - start[k]);
    }
    return;
  }
  second.assign(runs.labels_count, 0.0);
  double* two = second.data();
  for (int64_t k = 0; k < runs.runs; ++k) {
    const int64_t a = start[k], b = start[k + 1], label = id == nullptr ? k : id[k];
    one[label] += static_cast<double>(kept_before[b] - kept_before[a]);
    two[label] += static_cast<double>(tokens_before[b] - tokens_before[a]);
  }
}

// The step's samples as the passes read them: counts (as float64), their running sums, labels' runs and what each
// label holds.
struct Step {
  int64_t n = 0;
  const double* counts = nullptr;  // [n]: float64 counts as given, else the output's counts where it returns them, else `own`
  std::unique_ptr<double[]> own;
  std::unique_ptr<uint64_t[]> tokens_before, kept_before;  // [n + 1], where labels are read
  Runs g, s;
  bool crosses = false;                  // with both labels: some session run crosses a group boundary
  const int64_t* first = nullptr;        // with both labels: each group run's first session run, [group runs + 1]
  std::unique_ptr<int64_t[]> own_first;  // where the runs are found here (not read from a layout)
  bool laid_out = false;                 // the runs (and crosses, first) read from a layout
  bool lean = false;                     // the layout's head only read: the labels' totals it holds, none from the counts
  Status layout_status = kServed;        // the labels' status a layout holds
  std::vector<double> g_size, g_tokens, s_size, s_kept, s_tokens, g_held, g_held_kept;
  std::vector<int64_t> s_group;  // each session's group, where a session is several runs (sessions_of_groups)

  // Per-sample block b (0..5, see kBlocks) into out [n]: each sample's run's label's value.
  void per_sample(int64_t block, double* out) const {
    const std::vector<double>& table = block == 0   ? g_tokens
                                       : block == 1 ? s_size
                                       : block == 2 ? s_kept
                                       : block == 3 ? s_tokens
                                       : block == 4 ? g_held
                                                    : g_held_kept;
    const Runs& runs = block == 0 || block >= 4 ? g : s;
    if (table.empty() || n == 0) {  // the groups' sessions of a mode that does not read them
      std::fill(out, out + n, 0.0);
      return;
    }
    const double* v = table.data();
    const int64_t* id = runs.id;
    if (laid_out) {  // a layout's runs: filled run by run from their bounds (the labels are not read)
      const int64_t* start = runs.start;
      for (int64_t k = 0; k < runs.runs; ++k) {
        std::fill(out + start[k], out + start[k + 1], v[id == nullptr ? k : id[k]]);
      }
      return;
    }
    // else the runs counted again along the labels, with no branch (no per-sample table of runs kept)
    const int64_t* labels = runs.labels;
    int64_t r = 0;
    out[0] = v[id == nullptr ? 0 : id[0]];
    for (int64_t i = 1; i < n; ++i) {
      r += labels[i] != labels[i - 1] ? 1 : 0;
      out[i] = v[id == nullptr ? r : id[r]];
    }
  }
};

// The running sums of the counts and of the non-empty samples into step.tokens_before and step.kept_before, in
// integers (each count a whole number below 2**53, their total too: checked before), so that no addition waits on
// a floating-point one.
void running_sums(Step& step) {
  const int64_t n = step.n;
  step.tokens_before.reset(new uint64_t[n + 1]);
  step.kept_before.reset(new uint64_t[n + 1]);
  uint64_t* t = step.tokens_before.get();
  uint64_t* k = step.kept_before.get();
  const double* c = step.counts;
  uint64_t tokens = 0, kept = 0;
  t[0] = 0;
  k[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t x = static_cast<uint64_t>(static_cast<int64_t>(c[i]));
    tokens += x;
    kept += x != 0 ? 1 : 0;
    t[i + 1] = tokens;
    k[i + 1] = kept;
  }
}

// Two doubles at a time: SSE2's own intrinsics on x86-64, GCC and Clang vector types elsewhere (NEON on arm64).
// Scalar loops compile to a compare and a flag per element, with a branch to clamp; on x86-64, vector types
// compile each compare's mask to a blend, which SSE2 lacks, so to scalar code again (measured: 2.3x slower).
using Double2 = double __attribute__((vector_size(16)));
using Long2 = int64_t __attribute__((vector_size(16)));
using Float2 = float __attribute__((vector_size(8)));

// The counts as float64 into `into` (none: float64 counts read where they are); false when one is not a whole number
// in [0, 2**53). Each loop has no
// branch and only 8-byte lanes, so it vectorises (SSE2 has no int64 -> double conversion: the exact one below).
bool read_counts(int64_t n, const int64_t* counts_long, const double* counts_double, double* into) {
  double* c = into;
  constexpr double kTwo52 = 4503599627370496.0;            // 2**52
  constexpr uint64_t kExponent52 = 0x4330000000000000ULL;  // the bits of 2**52: 2**52 + m for m < 2**52 is exponent | m
  if (counts_long != nullptr) {
    uint64_t beyond = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t u = static_cast<uint64_t>(counts_long[i]);
      beyond |= u >> 53;  // non-zero for a count below 0 or at or above 2**53
      // u < 2**53 as hi · 2**32 + lo, each part exact as (2**52 + part) - 2**52, the sum exact below 2**53
      const double hi = std::bit_cast<double>((u >> 32) | kExponent52) - kTwo52;
      const double lo = std::bit_cast<double>((u & 0xFFFFFFFFULL) | kExponent52) - kTwo52;
      c[i] = hi * 4294967296.0 + lo;
    }
    return beyond == 0;
  }
  // whole in [0, 2**53): at or above 2**52 every double is whole; below it, (x + 2**52) - 2**52 is x rounded to a
  // whole number (no fused multiply-add: -ffp-contract=off), which is x exactly when x is whole
  const auto check = [&]<bool kCopy>() {
    int64_t i = 0;
#if defined(__SSE2__)
    __m128d whole2 = _mm_castsi128_pd(_mm_set1_epi64x(-1));  // all ones while every count holds
    const __m128d zero = _mm_setzero_pd(), whole_from = _mm_set1_pd(kWhole), two52 = _mm_set1_pd(kTwo52);
    for (; i + 2 <= n; i += 2) {
      const __m128d x = _mm_loadu_pd(counts_double + i);
      const __m128d rounded = _mm_sub_pd(_mm_add_pd(x, two52), two52);
      const __m128d is_whole = _mm_or_pd(_mm_cmpge_pd(x, two52), _mm_cmpeq_pd(rounded, x));
      whole2 = _mm_and_pd(whole2, _mm_and_pd(_mm_and_pd(_mm_cmpge_pd(x, zero), _mm_cmplt_pd(x, whole_from)), is_whole));
      if constexpr (kCopy) {
        _mm_storeu_pd(c + i, x);
      }
    }
    bool whole = _mm_movemask_pd(whole2) == 3;
#else
    Long2 whole2 = {-1, -1};  // all ones while every count holds
    for (; i + 2 <= n; i += 2) {
      Double2 x;
      std::memcpy(&x, counts_double + i, sizeof(x));
      whole2 &= (x >= 0.0) & (x < kWhole) & ((x >= kTwo52) | ((x + kTwo52) - kTwo52 == x));
      if constexpr (kCopy) {
        std::memcpy(c + i, &x, sizeof(x));
      }
    }
    bool whole = (whole2[0] & whole2[1]) == -1;
#endif
    for (; i < n; ++i) {
      const double x = counts_double[i];
      whole &= (x >= 0.0) & (x < kWhole) & ((x >= kTwo52) | ((x + kTwo52) - kTwo52 == x));
      if constexpr (kCopy) {
        c[i] = x;
      }
    }
    return whole;
  };
  return c == nullptr ? check.template operator()<false>() : check.template operator()<true>();
}

// The sessions each prompt group holds (step.g_held), from the labels only; a status where a session holds samples
// of several groups, or a group another number of sessions than per_prompt (>= 0).
Status sessions_of_groups(Step& step, int64_t per_prompt) {
  const int64_t groups = step.g.labels_count, sessions = step.s.labels_count;
  double lane_largest[4] = {};  // in four lanes: no maximum waits on the one before
  int64_t i = 0;
  for (; i + 4 <= sessions; i += 4) {
    for (int l = 0; l < 4; ++l) {
      lane_largest[l] = lane_largest[l] < step.s_size[i + l] ? step.s_size[i + l] : lane_largest[l];
    }
  }
  for (; i < sessions; ++i) {
    lane_largest[0] = std::max(lane_largest[0], step.s_size[i]);
  }
  const double largest = std::max(std::max(lane_largest[0], lane_largest[1]), std::max(lane_largest[2], lane_largest[3]));
  const double labels = static_cast<double>(std::max<int64_t>(groups, 1) - 1);
  if (labels * labels * largest >= kWhole) {
    return kTooManyForTheCheck;
  }
  if (step.crosses) {
    return kSessionInGroups;
  }
  // no session run crosses a group boundary, so group run r holds the session runs first[r] .. first[r + 1] - 1
  const int64_t* first = step.first;
  step.g_held.assign(groups, 0.0);
  const int64_t* g_id = step.g.id;
  if (step.s.id == nullptr) {  // each session one run: a group run's sessions are the session runs from its first on
    for (int64_t r = 0; r < step.g.runs; ++r) {
      step.g_held[g_id == nullptr ? r : g_id[r]] += static_cast<double>(first[r + 1] - first[r]);
    }
  } else {  // a session of several runs: each in the same group
    step.s_group.assign(sessions, -1);
    for (int64_t r = 0; r < step.g.runs; ++r) {
      const int64_t group = g_id == nullptr ? r : g_id[r];
      for (int64_t k = first[r]; k < first[r + 1]; ++k) {
        int64_t& g = step.s_group[step.s.id[k]];
        if (g >= 0 && g != group) {
          return kSessionInGroups;
        }
        g = group;
      }
    }
    for (int64_t s = 0; s < sessions; ++s) {
      step.g_held[step.s_group[s]] += 1.0;
    }
  }
  if (per_prompt >= 0) {
    for (int64_t g = 0; g < groups; ++g) {
      if (step.g_held[g] != static_cast<double>(per_prompt)) {
        return kSessionsPerGroup;
      }
    }
  }
  return kServed;
}

// Of the sessions each prompt group holds, the non-empty (step.g_held_kept), after sessions_of_groups served.
void kept_sessions_of_groups(Step& step) {
  const int64_t sessions = step.s.labels_count;
  const int64_t* first = step.first;
  const int64_t* g_id = step.g.id;
  step.g_held_kept.assign(step.g.labels_count, 0.0);
  if (step.s.id == nullptr) {
    const int64_t s_runs = step.s.runs;
    std::vector<int64_t> kept_before(s_runs + 1);  // the non-empty sessions before each session run
    for (int64_t k = 0; k < s_runs; ++k) {
      kept_before[k + 1] = kept_before[k] + (step.s_kept[k] > 0.0 ? 1 : 0);
    }
    for (int64_t r = 0; r < step.g.runs; ++r) {
      step.g_held_kept[g_id == nullptr ? r : g_id[r]] += static_cast<double>(kept_before[first[r + 1]] - kept_before[first[r]]);
    }
    return;
  }
  for (int64_t s = 0; s < sessions; ++s) {
    step.g_held_kept[step.s_group[s]] += step.s_kept[s] > 0.0 ? 1.0 : 0.0;
  }
}

// The runs of the labels given (groups, sessions: nullptr where the mode reads none) into step.g and step.s, and
// with both, whether a session run crosses a group boundary and each group run's first session run.
void find_label_runs(Step& step, const int64_t* groups, const int64_t* sessions) {
  if (groups != nullptr && sessions != nullptr) {
    step.crosses = find_both_runs(groups, sessions, step.n, step.g, step.s, step.own_first);
    step.first = step.own_first.get();
  } else if (groups != nullptr || sessions != nullptr) {
    find_runs(groups != nullptr ? groups : sessions, step.n, groups != nullptr ? step.g : step.s);
  }
}

// The labels' half of the totals, from their runs alone: each label's samples, P and S into o[5] and o[7], and the
// checks on them (each group's samples, each group's sessions); a status when the route declines the step. A
// layout holds what this found for its labels (plan_layout).
Status label_totals(Step& step, bool groups, bool sessions, int64_t per_prompt, bool check_groups, bool sessions_in_groups, double* o) {
  if (groups) {
    label_sums(step.g, nullptr, nullptr, step.g_size, step.g_size);
    o[5] = static_cast<double>(step.g.labels_count);
    bool sized = true;
    for (const double size : step.g_size) {
      sized &= size == static_cast<double>(per_prompt);
    }
    if (check_groups && per_prompt >= 0 && !sized) {
      return kGroupSize;
    }
  }
  if (sessions) {
    label_sums(step.s, nullptr, nullptr, step.s_size, step.s_size);
    o[7] = static_cast<double>(step.s.labels_count);
    if (sessions_in_groups && groups) {
      return sessions_of_groups(step, per_prompt);
    }
  }
  return kServed;
}

// The totals into o[1..8] and the labels' tables into `step`; a status when the route declines the step. The
// counts' own first (N, N', T, L_max); then the labels' half (label_totals), or what a layout read lean holds; the
// counts' half of the labels' totals last: each label's tokens and non-empty samples (P', S'), each group's
// non-empty sessions.
Status totals(
    Step& step, const int64_t* groups_in, const int64_t* sessions_in, int64_t per_prompt, bool check_groups, bool sessions_in_groups, double* o) {
  const int64_t n = step.n;
  const double* c = step.counts;
  // in four lanes, so that no addition waits on the one before: every count is a whole number below 2**53, so
  // the total is exact in any order while it stays below 2**53, and the step is declined beyond
  constexpr int kLanes = 4;
  double lane_total[kLanes] = {}, lane_longest[kLanes] = {}, lane_nonempty[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const double x = c[i + l];
      lane_total[l] += x;
      lane_longest[l] = lane_longest[l] < x ? x : lane_longest[l];
      lane_nonempty[l] += x > 0.0 ? 1.0 : 0.0;  // whole numbers below 2**53: exact
    }
  }
  for (; i < n; ++i) {
    lane_total[0] += c[i];
    lane_longest[0] = std::max(lane_longest[0], c[i]);
    lane_nonempty[0] += c[i] > 0.0 ? 1.0 : 0.0;
  }
  const double total = (lane_total[0] + lane_total[1]) + (lane_total[2] + lane_total[3]);
  const double longest = std::max(std::max(lane_longest[0], lane_longest[1]), std::max(lane_longest[2], lane_longest[3]));
  const double nonempty = (lane_nonempty[0] + lane_nonempty[1]) + (lane_nonempty[2] + lane_nonempty[3]);
  if (!(total < kWhole)) {
    return kTotalNotExact;
  }
  o[1] = static_cast<double>(n);
  o[2] = nonempty;
  o[3] = total;
  o[4] = longest;
  if (groups_in == nullptr && sessions_in == nullptr) {
    return kServed;
  }
  if (step.lean) {  // the labels' totals the layout holds; none from the counts: P', S' -1 (not read)
    o[5] = groups_in != nullptr ? static_cast<double>(step.g.labels_count) : 0.0;
    o[6] = o[8] = -1.0;
    o[7] = sessions_in != nullptr ? static_cast<double>(step.s.labels_count) : 0.0;
    return step.layout_status;
  }
  const bool groups = groups_in != nullptr, sessions = sessions_in != nullptr;
  if (!step.laid_out) {  // else read from a layout made before (read_layout)
    find_label_runs(step, groups_in, sessions_in);
  }
  const Status status = label_totals(step, groups, sessions, per_prompt, check_groups, sessions_in_groups, o);
  if (status != kServed) {
    return status;
  }
  running_sums(step);
  const uint64_t* tokens_before = step.tokens_before.get();
  const uint64_t* kept_before = step.kept_before.get();
  const auto nonempty_of = [](const std::vector<double>& kept) {
    int64_t count = 0;
    for (const double k : kept) {
      count += k > 0.0 ? 1 : 0;
    }
    return static_cast<double>(count);
  };
  if (groups) {
    std::vector<double> kept;
    label_sums(step.g, tokens_before, kept_before, kept, step.g_tokens);
    o[6] = nonempty_of(kept);
  }
  if (sessions) {
    label_sums(step.s, tokens_before, kept_before, step.s_kept, step.s_tokens);
    o[8] = nonempty_of(step.s_kept);
    if (sessions_in_groups && groups) {
      kept_sessions_of_groups(step);
    }
  }
  return kServed;
}

float* row32_of(float* d32, size_t k, int64_t n) { return d32 + static_cast<int64_t>(k) * n; }

struct Checked {
  bool not_positive;  // some d[i] is not finite and > 0
  bool not_normal;    // some d[i] does not round to a normal finite float32
};

// One term's d [n]: checked, and rounded to float32 into row32 (to nearest even, as torch's .to(float32); clamped
// first so the conversion is defined: a d[i] at or beyond kFiniteBelow, where clamping changes it, leaves the
// table unread, not_normal).
Checked check_and_round(const double* row, float* row32, int64_t n) {
  constexpr double kNormalFrom = 1.1754942807573643e-38;   // 2**-126 - 2**-150: rounds to float32's smallest normal
  constexpr double kFiniteBelow = 3.4028235677973366e+38;  // 2**128 - 2**103: rounds to float32's infinity
  constexpr double kFloatMax = static_cast<double>(std::numeric_limits<float>::max());
  constexpr double kDoubleMax = std::numeric_limits<double>::max();
  int64_t i = 0;
  bool not_positive = false, not_normal = false;
#if defined(__SSE2__)
  // SSE2 itself: with GCC's vector types each compare's mask becomes a blend, which SSE2 lacks: scalar code
  __m128d positive = _mm_castsi128_pd(_mm_set1_epi64x(-1)), normal = positive;  // all ones while every d[i] holds
  const __m128d zero = _mm_setzero_pd(), double_max = _mm_set1_pd(kDoubleMax), normal_from = _mm_set1_pd(kNormalFrom);
  const __m128d finite_below = _mm_set1_pd(kFiniteBelow), float_max = _mm_set1_pd(kFloatMax);
  for (; i + 2 <= n; i += 2) {
    const __m128d x = _mm_loadu_pd(row + i);
    positive = _mm_and_pd(positive, _mm_and_pd(_mm_cmpgt_pd(x, zero), _mm_cmple_pd(x, double_max)));
    normal = _mm_and_pd(normal, _mm_and_pd(_mm_cmpge_pd(x, normal_from), _mm_cmplt_pd(x, finite_below)));
    // x < float_max ? x : float_max (float_max where x is NaN), then rounded to nearest even
    _mm_storel_epi64(reinterpret_cast<__m128i*>(row32 + i), _mm_castps_si128(_mm_cvtpd_ps(_mm_min_pd(x, float_max))));
  }
  not_positive = _mm_movemask_pd(positive) != 3;
  not_normal = _mm_movemask_pd(normal) != 3;
#else
  Long2 positive = {-1, -1}, normal = {-1, -1};  // all ones while every d[i] holds
  for (; i + 2 <= n; i += 2) {
    Double2 x;
    std::memcpy(&x, row + i, sizeof(x));
    positive &= (x > 0.0) & (x <= kDoubleMax);  // each compare: all ones where it holds
    normal &= (x >= kNormalFrom) & (x < kFiniteBelow);
    const Double2 max2 = {kFloatMax, kFloatMax};
    const Float2 rounded = __builtin_convertvector(x < max2 ? x : max2, Float2);
    std::memcpy(row32 + i, &rounded, sizeof(rounded));
  }
  not_positive = (positive[0] & positive[1]) != -1;
  not_normal = (normal[0] & normal[1]) != -1;
#endif
  for (; i < n; ++i) {
    const double x = row[i];
    not_positive |= !((x > 0.0) & (x <= kDoubleMax));
    not_normal |= !((x >= kNormalFrom) & (x < kFiniteBelow));
    row32[i] = static_cast<float>(x < kFloatMax ? x : kFloatMax);
  }
  return {not_positive, not_normal};
}

// Each term's d[i] into d [K, N]: the product of its factors in their order (every product rounds as
// lossagg.DenomProduct's), checked finite and > 0; whether every d[i] rounds to a normal finite float32. A
// per-sample factor is read from its block, made once for the call (`blocks`: the blocks already written to the
// output, by block; the others are made here).
Status denoms(
    const Step& step,
    const double* o,
    const std::vector<int64_t>& program,
    const std::vector<double>& divisors,
    const double* const* written,
    double* d,
    float* d32) {
  const int64_t n = step.n;
  std::vector<double> made[kBlocks];
  bool fits = true;
  size_t at = 0;
  for (size_t k = 0; k < divisors.size(); ++k) {
    LOSSAGG_CHECK(at < program.size(), "lossagg.plan_totals: the program is shorter than its terms");
    const int64_t factors = program[at++];
    LOSSAGG_CHECK(
        factors >= 1 && at + static_cast<size_t>(factors * kFactorFields) <= program.size(),
        "lossagg.plan_totals: a term's factors run past the program");
    double* row = d + static_cast<int64_t>(k) * n;
    for (int64_t f = 0; f < factors; ++f, at += kFactorFields) {
      const int64_t source = program[at];
      const bool as_count = program[at + 1] != 0, clamped = program[at + 2] != 0, zero_as_one = program[at + 3] != 0;
      LOSSAGG_CHECK(source >= kCounts && source < kScalars + kBlocks && source != 0, "lossagg.plan_totals: a factor's source is out of range");
      // read as lossagg.totals.read_as does: max(x, 1) as a count, max(x, 1) clamped, then 0 as 1; a loop for
      // each case, with no branch inside, so each vectorises
      const double floor_at = as_count || clamped ? 1.0 : -std::numeric_limits<double>::infinity();
      const double* src = nullptr;
      if (source == kCounts) {
        src = step.counts;
      } else if (source >= kScalars) {
        const int64_t b = source - kScalars;
        src = written[b];
        if (src == nullptr) {
          if (made[b].empty()) {
            made[b].resize(n);
            step.per_sample(b, made[b].data());
          }
          src = made[b].data();
        }
      }
      if (src == nullptr) {
        double v = source == kDivisor ? divisors[k] : std::max(o[source], floor_at);
        v = zero_as_one && v == 0.0 ? 1.0 : v;
        if (f == 0) {
          std::fill(row, row + n, v);
        } else {
          for (int64_t i = 0; i < n; ++i) {
            row[i] = row[i] * v;
          }
        }
        continue;
      }
      const auto apply = [&]<bool kZeroAsOne, bool kFirst>() {
        for (int64_t i = 0; i < n; ++i) {
          double v = std::max(src[i], floor_at);
          if constexpr (kZeroAsOne) {
            v = v == 0.0 ? 1.0 : v;
          }
          row[i] = kFirst ? v : row[i] * v;
        }
      };
      if (zero_as_one) {
        f == 0 ? apply.template operator()<true, true>() : apply.template operator()<true, false>();
      } else {
        f == 0 ? apply.template operator()<false, true>() : apply.template operator()<false, false>();
      }
    }
    const Checked checked = check_and_round(row, row32_of(d32, k, n), n);
    if (checked.not_positive) {
      return kDenomNotPositive;
    }
    fits &= !checked.not_normal;
  }
  return fits ? kServed : kServedNotFloat32;
}

// A layout: the labels' half of plan_totals (their runs, the checks on them), done once (plan_layout) where the
// labels are known before the counts (a one-process lossagg.DeferredPlan's, made with the plan), then read by
// plan_totals in place of that half. Where the call asks for nothing per label from the counts (no block, no term's
// d, no P' or S'), the close reads the counts and the layout's head only. int64: a head of kLayoutHead (n; for the
// groups, then the sessions: runs, -1 where not given, labels, 1 where ids follow; 1 where a session run crosses a
// group boundary; per_prompt, check_groups, sessions_in_groups, as given; 1 where P' or S' is read; the labels'
// status), then for each label set given its start [runs + 1] and, where its runs are not each a label of their
// own, its id [runs]; with both, first [group runs + 1].
constexpr int64_t kLayoutHead = 13;
constexpr const char* kNotLayout = "lossagg.plan_totals: layout must be the one lossagg.plan_layout made of these labels and arguments";

// The label tensor given (a contiguous int64 [n] one) as a pointer; nullptr for none.
const int64_t* labels_of(const std::optional<Tensor>& given, int64_t n, const char* op) {
  if (!given.has_value()) {
    return nullptr;
  }
  const Tensor& t = *given;
  LOSSAGG_CHECK_VALUE(
      t.dim() == 1 && t.numel() == n && t.is_contiguous() && t.scalar_type() == ScalarType::Long, "lossagg.", op,
      ": each label tensor must be a contiguous int64 [N] tensor of the step's N samples");
  return t.const_data_ptr<int64_t>();
}

// group_index and session_index (int64 [N], at least one), and plan_totals' arguments on them -> their layout (above).
Tensor plan_layout(
    const std::optional<Tensor>& group_index,
    const std::optional<Tensor>& session_index,
    int64_t per_prompt,
    bool check_groups,
    bool sessions_in_groups,
    bool nonempty_read) {
  const std::optional<Tensor>& like = group_index.has_value() ? group_index : session_index;
  LOSSAGG_CHECK_VALUE(like.has_value(), "lossagg.plan_layout: group_index or session_index must be given, got neither");
  Step step;
  step.n = like->dim() == 1 ? like->numel() : -1;
  const int64_t* groups = labels_of(group_index, step.n, "plan_layout");
  const int64_t* sessions = labels_of(session_index, step.n, "plan_layout");
  find_label_runs(step, groups, sessions);
  double o[kScalars] = {};
  const Status status = label_totals(step, groups != nullptr, sessions != nullptr, per_prompt, check_groups, sessions_in_groups, o);
  const Runs* sets[2] = {groups != nullptr ? &step.g : nullptr, sessions != nullptr ? &step.s : nullptr};
  int64_t size = kLayoutHead + (groups != nullptr && sessions != nullptr ? step.g.runs + 1 : 0);
  for (const Runs* r : sets) {
    size += r == nullptr ? 0 : r->runs + 1 + (r->id != nullptr ? r->runs : 0);
  }
  Tensor out = new_tensor(*like, {size}, ScalarType::Long);
  int64_t* w = out.mutable_data_ptr<int64_t>();
  int64_t* at = w + kLayoutHead;
  w[0] = step.n;
  for (int k = 0; k < 2; ++k) {
    const Runs* r = sets[k];
    w[1 + 3 * k] = r == nullptr ? -1 : r->runs;
    w[2 + 3 * k] = r == nullptr ? 0 : r->labels_count;
    w[3 + 3 * k] = r != nullptr && r->id != nullptr ? 1 : 0;
    if (r != nullptr) {
      at = std::copy(r->start, r->start + r->runs + 1, at);
      at = r->id != nullptr ? std::copy(r->id, r->id + r->runs, at) : at;
    }
  }
  const int64_t head[] = {step.crosses ? 1 : 0, per_prompt, check_groups ? 1 : 0, sessions_in_groups ? 1 : 0, nonempty_read ? 1 : 0, status};
  std::copy(std::begin(head), std::end(head), w + 7);
  if (groups != nullptr && sessions != nullptr) {
    std::copy(step.first, step.first + step.g.runs + 1, at);
  }
  return out;
}

// A layout's head checked against plan_totals' arguments (the labels given, of n samples); then, unless the call
// reads the head only (`lean`: it asks for nothing per label from the counts), its runs into step, their tables
// pointing into it, each bound and id checked to lie in range, so that no pass reads outside a table. That the runs
// are these labels' is the caller's to know (lossagg/step.py reads a layout only with the labels it was made of).
// Returns the labels' status the layout holds.
Status read_layout(
    const Tensor& layout, Step& step, bool groups, bool sessions, int64_t per_prompt, bool check_groups, bool sessions_in_groups, bool asked) {
  LOSSAGG_CHECK_VALUE(
      layout.dim() == 1 && layout.is_contiguous() && layout.scalar_type() == ScalarType::Long && layout.numel() >= kLayoutHead, kNotLayout);
  const int64_t* w = layout.const_data_ptr<int64_t>();
  const int64_t n = step.n, size = layout.numel(), status = w[12];
  LOSSAGG_CHECK_VALUE(
      w[0] == n && (w[7] == 0 || w[7] == 1) && w[8] == per_prompt && w[9] == (check_groups ? 1 : 0) && w[10] == (sessions_in_groups ? 1 : 0) &&
          (w[11] == 0 || w[11] == 1) && status >= kServed && status <= kTooManyForTheCheck,
      kNotLayout);
  step.lean = !asked && w[11] == 0;
  int64_t at = kLayoutHead;
  Runs* sets[2] = {&step.g, &step.s};
  const bool given[2] = {groups, sessions};
  for (int k = 0; k < 2; ++k) {
    const int64_t runs = w[1 + 3 * k], labels = w[2 + 3 * k], dense = w[3 + 3 * k];
    if (!given[k]) {
      LOSSAGG_CHECK_VALUE(runs == -1, kNotLayout);
      continue;
    }
    // a run for each change of label (none for no sample), no more labels than runs (as many where each run is one)
    LOSSAGG_CHECK_VALUE(
        runs >= (n > 0 ? 1 : 0) && runs <= n && (dense == 0 || dense == 1) && labels >= (runs > 0 ? 1 : 0) && labels <= runs &&
            (dense == 1 || labels == runs) && size - at >= runs + 1 + dense * runs,
        kNotLayout);
    Runs& r = *sets[k];
    r.labels_count = labels;
    at += runs + 1 + dense * runs;
    if (step.lean) {
      continue;
    }
    r.start = w + at - (runs + 1 + dense * runs);
    r.id = dense == 1 ? r.start + runs + 1 : nullptr;
    r.runs = runs;
    bool ok = r.start[0] == 0 && r.start[runs] == n;
    for (int64_t j = 0; j < runs; ++j) {
      ok &= r.start[j] < r.start[j + 1];
    }
    for (int64_t j = 0; j < dense * runs; ++j) {
      ok &= static_cast<uint64_t>(r.id[j]) < static_cast<uint64_t>(labels);
    }
    LOSSAGG_CHECK_VALUE(ok, kNotLayout);
  }
  const int64_t g_runs = w[1];
  LOSSAGG_CHECK_VALUE(size - at == (groups && sessions ? g_runs + 1 : 0), kNotLayout);
  if (groups && sessions && !step.lean) {  // each group run's first session run: from 0 to the session runs, never falling
    const int64_t* first = w + at;
    bool ok = first[0] == 0 && first[g_runs] == step.s.runs;
    for (int64_t r = 0; r < g_runs; ++r) {
      ok &= first[r] <= first[r + 1];
    }
    LOSSAGG_CHECK_VALUE(ok, kNotLayout);
    step.first = first;
    step.crosses = w[7] == 1;
  }
  step.laid_out = !step.lean;
  return static_cast<Status>(status);
}

// counts [N] (int64 or float64, contiguous), group_index and session_index [N] int64 or None; per_prompt < 0 for
// none; check_groups: whether the step's groups must hold per_prompt samples (the mode reads P); sessions_in_groups:
// whether the mode reads the sessions of each group (Sp, Sp'), which must then hold per_prompt sessions; blocks:
// the per-sample totals to return (0..5, in this order); with_counts: whether to return the counts as float64;
// program and divisors: each term's d[i] (its factors' codes; its divisor). Returns, each its own tensor, so that
// the caller takes them as they are: the scalars float64 [9] (status, N, N', T, L_max, P, P', S, S'), each block
// float64 [N], the counts float64 [N] (with_counts), d float64 [K, N] and d float32 [K, N] (d rounded; the table
// the float32 kernels read where every d[i] is a normal finite float32, status 0). The others are read only where
// the status is 0 or 7.
std::vector<Tensor> plan_totals(
    const Tensor& counts,
    const std::optional<Tensor>& group_index,
    const std::optional<Tensor>& session_index,
    int64_t per_prompt,
    bool check_groups,
    bool sessions_in_groups,
    std::vector<int64_t> blocks,
    bool with_counts,
    std::vector<int64_t> program,
    std::vector<double> divisors,
    const std::optional<Tensor>& layout) {
  LOSSAGG_CHECK_VALUE(counts.dim() == 1 && counts.is_contiguous(), "lossagg.plan_totals: counts must be a contiguous [N] tensor");
  const bool is_long = counts.scalar_type() == ScalarType::Long;
  LOSSAGG_CHECK_VALUE(is_long || counts.scalar_type() == ScalarType::Double, "lossagg.plan_totals: counts must be int64 or float64");
  Step step;
  step.n = counts.numel();
  const int64_t n = step.n;
  const int64_t* labels[2] = {labels_of(group_index, n, "plan_totals"), labels_of(session_index, n, "plan_totals")};
  if (layout.has_value()) {
    const bool asked = !blocks.empty() || !program.empty();
    step.layout_status = read_layout(*layout, step, labels[0] != nullptr, labels[1] != nullptr, per_prompt, check_groups, sessions_in_groups, asked);
  }
  for (int64_t b : blocks) {
    LOSSAGG_CHECK_VALUE(b >= 0 && b < kBlocks, "lossagg.plan_totals: a block is out of range");
  }
  const int64_t terms = static_cast<int64_t>(divisors.size());
  std::vector<Tensor> out;
  out.reserve(blocks.size() + 4);
  out.push_back(new_tensor(counts, {kScalars}, ScalarType::Double));
  for (size_t b = 0; b < blocks.size() + (with_counts ? 1 : 0); ++b) {
    out.push_back(new_tensor(counts, {n}, ScalarType::Double));
  }
  out.push_back(new_tensor(counts, {terms, n}, ScalarType::Double));
  out.push_back(new_tensor(counts, {terms, n}, ScalarType::Float));
  double* o = out[0].mutable_data_ptr<double>();
  std::fill(o, o + kScalars, 0.0);
  double* into = nullptr;  // float64 counts are read where they are, and returned only as given (with_counts is for int64)
  if (with_counts) {
    into = out[1 + blocks.size()].mutable_data_ptr<double>();
  } else if (is_long) {
    step.own.reset(new double[std::max<int64_t>(n, 1)]);
    into = step.own.get();
  }
  step.counts = is_long || with_counts ? into : counts.const_data_ptr<double>();
  Status status = read_counts(n, is_long ? counts.const_data_ptr<int64_t>() : nullptr, is_long ? nullptr : counts.const_data_ptr<double>(), into)
                      ? totals(step, labels[0], labels[1], per_prompt, check_groups, sessions_in_groups, o)
                      : kCountNotWhole;
  if (status == kServed) {
    const double* written[kBlocks] = {};
    size_t at = 1;
    for (int64_t b : blocks) {
      double* block = out[at++].mutable_data_ptr<double>();
      step.per_sample(b, block);
      written[b] = block;
    }
    at += with_counts ? 1 : 0;  // read into the output
    status = denoms(step, o, program, divisors, written, out[at].mutable_data_ptr<double>(), out[at + 1].mutable_data_ptr<float>());
  }
  o[0] = static_cast<double>(status);
  return out;
}

}  // namespace

int64_t plan_denoms(
    const int64_t* counts,
    int64_t n,
    const int64_t* groups,
    const int64_t* sessions,
    int64_t per_prompt,
    bool check_groups,
    bool sessions_in_groups,
    const std::vector<int64_t>& program,
    double divisor,
    double* d) {
  Step step;
  step.n = n;
  step.own.reset(new double[std::max<int64_t>(n, 1)]);
  step.counts = step.own.get();
  double o[kScalars] = {};
  Status status = read_counts(n, counts, nullptr, step.own.get()) ? totals(step, groups, sessions, per_prompt, check_groups, sessions_in_groups, o)
                                                                  : kCountNotWhole;
  if (status == kServed) {
    std::unique_ptr<float[]> d32(new float[std::max<int64_t>(n, 1)]);  // the rounding's own check; the table unread
    const double* written[kBlocks] = {};
    status = denoms(step, o, program, {divisor}, written, d, d32.get());
  }
  return status;
}

STABLE_TORCH_LIBRARY_IMPL(lossagg, CPU, m) {
  m.impl("plan_totals", TORCH_BOX(&plan_totals));
  m.impl("plan_layout", TORCH_BOX(&plan_layout));
}

}  // namespace lossagg::cpu
