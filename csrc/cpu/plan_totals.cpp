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
#include "../torch_api.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <vector>

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

// Dense ids (0, 1, ...) of the labels, in any order: by direct address when the labels span little more than
// the samples, else by a hash map. A label is looked up only where it differs from the sample before (a step's
// samples of one prompt group or session usually lie side by side). Returns the number of distinct labels.
int64_t dense_ids(const int64_t* labels, int64_t n, std::vector<int64_t>& ids) {
  ids.resize(n);
  if (n == 0) {
    return 0;
  }
  int64_t lo = labels[0], hi = labels[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, labels[i]);
    hi = std::max(hi, labels[i]);
  }
  int64_t distinct = 0;
  const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);  // unsigned: no overflow
  if (span <= static_cast<uint64_t>(4 * n + 64)) {
    std::vector<int64_t> slot(span + 1, -1);
    int64_t current = -1;
    for (int64_t i = 0; i < n; ++i) {
      if (i == 0 || labels[i] != labels[i - 1]) {
        int64_t& s = slot[static_cast<uint64_t>(labels[i]) - static_cast<uint64_t>(lo)];
        if (s < 0) {
          s = distinct++;
        }
        current = s;
      }
      ids[i] = current;
    }
    return distinct;
  }
  std::unordered_map<int64_t, int64_t> slot;
  slot.reserve(static_cast<size_t>(n));
  int64_t current = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (i == 0 || labels[i] != labels[i - 1]) {
      auto [it, added] = slot.try_emplace(labels[i], distinct);
      distinct += added ? 1 : 0;
      current = it->second;
    }
    ids[i] = current;
  }
  return distinct;
}

// Each label's samples, non-empty samples and tokens, added run by run (a run: consecutive samples of one label),
// so that consecutive additions to one label's total do not wait on each other. Every addend is a whole number
// and every total below 2**53 (the counts are checked so), so the sums are exact in any order.
void label_sums(
    const std::vector<int64_t>& id,
    const double* counts,
    int64_t labels,
    std::vector<double>& size,
    std::vector<double>& kept,
    std::vector<double>& tokens) {
  size.assign(labels, 0.0);
  kept.assign(labels, 0.0);
  tokens.assign(labels, 0.0);
  const int64_t n = static_cast<int64_t>(id.size());
  const int64_t* ids = id.data();
  const double* c = counts;
  for (int64_t i = 0; i < n;) {
    const int64_t label = ids[i];
    int64_t nonempty = 0;
    double sum = 0.0;
    int64_t j = i;
    for (; j < n && ids[j] == label; ++j) {
      nonempty += c[j] > 0.0;
      sum += c[j];
    }
    size[label] += static_cast<double>(j - i);
    kept[label] += static_cast<double>(nonempty);
    tokens[label] += sum;
    i = j;
  }
}

// The step's samples as the passes read them: counts (as float64), labels' dense ids and what each label holds.
struct Step {
  int64_t n = 0;
  double* counts = nullptr;  // [n]: the output's counts where it returns them, else `own`
  std::vector<double> own;
  std::vector<int64_t> g_id, s_id;
  std::vector<double> g_tokens, s_size, s_kept, s_tokens, g_held, g_held_kept;

  // Per-sample block b (0..5, see kBlocks) into out [n].
  void per_sample(int64_t block, double* out) const {
    const std::vector<double>& table = block == 0   ? g_tokens
                                       : block == 1 ? s_size
                                       : block == 2 ? s_kept
                                       : block == 3 ? s_tokens
                                       : block == 4 ? g_held
                                                    : g_held_kept;
    const std::vector<int64_t>& id = block == 0 || block >= 4 ? g_id : s_id;
    if (table.empty()) {  // the groups' sessions of a mode that does not read them
      std::fill(out, out + n, 0.0);
      return;
    }
    for (int64_t i = 0; i < n; ++i) {
      out[i] = table[id[i]];
    }
  }
};

// Two doubles at a time, as GCC and Clang vector types (SSE2 on x86-64, NEON on arm64): the scalar loops below
// compile to a compare and a flag per element, with a branch to clamp.
using Double2 = double __attribute__((vector_size(16)));
using Long2 = int64_t __attribute__((vector_size(16)));
using Float2 = float __attribute__((vector_size(8)));

// The counts as float64 into step.counts; false when one is not a whole number in [0, 2**53). Each loop has no
// branch and only 8-byte lanes, so it vectorises (SSE2 has no int64 -> double conversion: the exact one below).
bool read_counts(Step& step, const int64_t* counts_long, const double* counts_double) {
  const int64_t n = step.n;
  double* c = step.counts;
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
  Long2 not_whole = {0, 0};
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    Double2 x;
    std::memcpy(&x, counts_double + i, sizeof(x));
    not_whole |= ~((x >= 0.0) & (x < kWhole) & ((x >= kTwo52) | ((x + kTwo52) - kTwo52 == x)));
    std::memcpy(c + i, &x, sizeof(x));
  }
  bool whole = (not_whole[0] | not_whole[1]) == 0;
  for (; i < n; ++i) {
    const double x = counts_double[i];
    whole &= (x >= 0.0) & (x < kWhole) & ((x >= kTwo52) | ((x + kTwo52) - kTwo52 == x));
    c[i] = x;
  }
  return whole;
}

// The totals into o[1..8] and the labels' tables into `step`; a status when the route declines the step.
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
  int64_t groups = 0;
  if (groups_in != nullptr) {
    groups = dense_ids(groups_in, n, step.g_id);
    std::vector<double> size, kept;
    label_sums(step.g_id, step.counts, groups, size, kept, step.g_tokens);
    int64_t groups_nonempty = 0;
    for (int64_t g = 0; g < groups; ++g) {
      if (check_groups && per_prompt >= 0 && size[g] != static_cast<double>(per_prompt)) {
        return kGroupSize;
      }
      groups_nonempty += kept[g] > 0.0 ? 1 : 0;
    }
    o[5] = static_cast<double>(groups);
    o[6] = static_cast<double>(groups_nonempty);
  }
  if (sessions_in != nullptr) {
    const int64_t sessions = dense_ids(sessions_in, n, step.s_id);
    label_sums(step.s_id, step.counts, sessions, step.s_size, step.s_kept, step.s_tokens);
    int64_t sessions_nonempty = 0;
    double largest = 0.0;
    for (int64_t s = 0; s < sessions; ++s) {
      sessions_nonempty += step.s_kept[s] > 0.0 ? 1 : 0;
      largest = std::max(largest, step.s_size[s]);
    }
    o[7] = static_cast<double>(sessions);
    o[8] = static_cast<double>(sessions_nonempty);
    if (sessions_in_groups && groups_in != nullptr) {
      const double labels = static_cast<double>(std::max<int64_t>(groups, 1) - 1);
      if (labels * labels * largest >= kWhole) {
        return kTooManyForTheCheck;
      }
      std::vector<int64_t> group_of(sessions, -1);
      for (int64_t i = 0; i < n; ++i) {
        int64_t& g = group_of[step.s_id[i]];
        if (g < 0) {
          g = step.g_id[i];
        } else if (g != step.g_id[i]) {
          return kSessionInGroups;
        }
      }
      step.g_held.assign(groups, 0.0);
      step.g_held_kept.assign(groups, 0.0);
      for (int64_t s = 0; s < sessions; ++s) {
        step.g_held[group_of[s]] += 1.0;
        step.g_held_kept[group_of[s]] += step.s_kept[s] > 0.0 ? 1.0 : 0.0;
      }
      if (per_prompt >= 0) {
        for (int64_t g = 0; g < groups; ++g) {
          if (step.g_held[g] != static_cast<double>(per_prompt)) {
            return kSessionsPerGroup;
          }
        }
      }
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
  Long2 bad = {0, 0}, unfit = {0, 0};
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    Double2 x;
    std::memcpy(&x, row + i, sizeof(x));
    bad |= ~((x > 0.0) & (x <= kDoubleMax));  // each compare: all ones where it holds
    unfit |= ~((x >= kNormalFrom) & (x < kFiniteBelow));
    const Long2 below = x < kFloatMax;
    const Double2 max2 = {kFloatMax, kFloatMax};
    Double2 clamped;
    const Long2 picked = (std::bit_cast<Long2>(x) & below) | (std::bit_cast<Long2>(max2) & ~below);
    std::memcpy(&clamped, &picked, sizeof(clamped));
    const Float2 rounded = __builtin_convertvector(clamped, Float2);
    std::memcpy(row32 + i, &rounded, sizeof(rounded));
  }
  bool not_positive = (bad[0] | bad[1]) != 0, not_normal = (unfit[0] | unfit[1]) != 0;
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
    std::vector<double> divisors) {
  LOSSAGG_CHECK_VALUE(counts.dim() == 1 && counts.is_contiguous(), "lossagg.plan_totals: counts must be a contiguous [N] tensor");
  const bool is_long = counts.scalar_type() == ScalarType::Long;
  LOSSAGG_CHECK_VALUE(is_long || counts.scalar_type() == ScalarType::Double, "lossagg.plan_totals: counts must be int64 or float64");
  Step step;
  step.n = counts.numel();
  const int64_t n = step.n;
  const int64_t* labels[2] = {nullptr, nullptr};
  int li = 0;
  for (const std::optional<Tensor>* given : {&group_index, &session_index}) {
    if (given->has_value()) {
      const Tensor& t = **given;
      LOSSAGG_CHECK_VALUE(
          t.dim() == 1 && t.numel() == n && t.is_contiguous() && t.scalar_type() == ScalarType::Long,
          "lossagg.plan_totals: each label tensor must be a contiguous int64 [N] tensor beside the counts");
      labels[li] = t.const_data_ptr<int64_t>();
    }
    ++li;
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
  if (with_counts) {
    step.counts = out[1 + blocks.size()].mutable_data_ptr<double>();
  } else {
    step.own.resize(n);
    step.counts = step.own.data();
  }
  Status status = read_counts(step, is_long ? counts.const_data_ptr<int64_t>() : nullptr, is_long ? nullptr : counts.const_data_ptr<double>())
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

STABLE_TORCH_LIBRARY_IMPL(lossagg, CPU, m) { m.impl("plan_totals", TORCH_BOX(&plan_totals)); }

}  // namespace lossagg::cpu
