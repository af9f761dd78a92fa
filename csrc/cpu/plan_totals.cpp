// The step totals and every term's d[i] of a plan made by one process (lossagg/totals.py defines each total,
// lossagg/denom_program.py each factor), from its samples' token counts and, where the mode reads them, their
// prompt-group and session labels, in a few passes over the samples: what lossagg.StepPlan reads to build
// its denominators without a process group (lossagg/step.py, the native route).
//
// Registered for the CPU only; every other case (a process group, counts on a device, weights, a mode whose
// d[i] is a function) takes the Python route, and so does a step this route declines (a status in 1..6
// below): the Python route then raises the error that names the problem, or serves the step. Sums are taken
// in the samples' order over whole-number counts, so they are exact, and each d[i] multiplies its factors in
// their declared order: the Python route's numbers bit for bit (tests/test_plan_native.py).
#include "../torch_api.h"

#include <cmath>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace lossagg::cpu {
namespace {

// What the route declines (the Python route then raises, naming it, or serves the step), and 7, served.
enum Status : int64_t {
  kServed = 0,
  kCountNotWhole = 1,       // a count that is not finite, below 0 or not a whole number below 2**53
  kGroupSize = 2,           // a prompt group of another size than n_samples_per_prompt
  kSessionInGroups = 3,     // a session whose samples lie in several prompt groups
  kSessionsPerGroup = 4,    // a prompt group with another number of sessions than n_samples_per_prompt
  kTooManyForTheCheck = 5,  // beyond the exact range of the Python route's check that a session lies in one group
  kDenomNotPositive = 6,    // a d[i] that is not finite and > 0 (the Python route names it)
  kServedNotFloat32 = 7     // served; some d[i] is not a normal finite float32, so the float32 table is d itself
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
// the samples, else by a hash map. Returns the number of distinct labels.
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
    for (int64_t i = 0; i < n; ++i) {
      int64_t& s = slot[static_cast<uint64_t>(labels[i]) - static_cast<uint64_t>(lo)];
      if (s < 0) {
        s = distinct++;
      }
      ids[i] = s;
    }
    return distinct;
  }
  std::unordered_map<int64_t, int64_t> slot;
  slot.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    auto [it, added] = slot.try_emplace(labels[i], distinct);
    distinct += added ? 1 : 0;
    ids[i] = it->second;
  }
  return distinct;
}

// The step's samples as the passes read them: counts, labels' dense ids and what each label holds.
struct Step {
  int64_t n = 0;
  const int64_t* counts_long = nullptr;
  const double* counts_double = nullptr;
  std::vector<int64_t> g_id, s_id;
  std::vector<double> g_tokens, s_size, s_kept, s_tokens, g_held, g_held_kept;

  double count(int64_t i) const { return counts_long ? static_cast<double>(counts_long[i]) : counts_double[i]; }

  double per_sample(int64_t block, int64_t i) const {
    switch (block) {
      case 0:
        return g_tokens[g_id[i]];
      case 1:
        return s_size[s_id[i]];
      case 2:
        return s_kept[s_id[i]];
      case 3:
        return s_tokens[s_id[i]];
      case 4:
        return g_held.empty() ? 0.0 : g_held[g_id[i]];
      default:
        return g_held_kept.empty() ? 0.0 : g_held_kept[g_id[i]];
    }
  }
};

// The totals into o[1..8] and the labels' tables into `step`; a status when the route declines the step.
Status totals(
    Step& step, const int64_t* groups_in, const int64_t* sessions_in, int64_t per_prompt, bool check_groups, bool sessions_in_groups, double* o) {
  const int64_t n = step.n;
  double total = 0.0, longest = 0.0;
  int64_t nonempty = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = step.count(i);
    if (!(x >= 0.0) || !(x < kWhole) || x != std::floor(x)) {
      return kCountNotWhole;
    }
    total += x;
    longest = std::max(longest, x);
    nonempty += x > 0.0 ? 1 : 0;
  }
  o[1] = static_cast<double>(n);
  o[2] = static_cast<double>(nonempty);
  o[3] = total;
  o[4] = longest;
  int64_t groups = 0;
  if (groups_in != nullptr) {
    groups = dense_ids(groups_in, n, step.g_id);
    std::vector<double> size(groups, 0.0), kept(groups, 0.0);
    step.g_tokens.assign(groups, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      const double x = step.count(i);
      size[step.g_id[i]] += 1.0;
      kept[step.g_id[i]] += x > 0.0 ? 1.0 : 0.0;
      step.g_tokens[step.g_id[i]] += x;
    }
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
    step.s_size.assign(sessions, 0.0);
    step.s_kept.assign(sessions, 0.0);
    step.s_tokens.assign(sessions, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      const double x = step.count(i);
      step.s_size[step.s_id[i]] += 1.0;
      step.s_kept[step.s_id[i]] += x > 0.0 ? 1.0 : 0.0;
      step.s_tokens[step.s_id[i]] += x;
    }
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

// Each term's d[i] into d [K, N]: the product of its factors in their order (every product rounds as
// lossagg.DenomProduct's), checked finite and > 0; whether every d[i] rounds to a normal finite float32.
Status denoms(const Step& step, const double* o, const std::vector<int64_t>& program, const std::vector<double>& divisors, double* d) {
  const int64_t n = step.n;
  constexpr double kNormalFrom = 1.1754942807573643e-38;   // 2**-126 - 2**-150: rounds to float32's smallest normal
  constexpr double kFiniteBelow = 3.4028235677973366e+38;  // 2**128 - 2**103: rounds to float32's infinity
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
      const auto read = [&](double v) {
        v = as_count ? std::max(v, 1.0) : v;
        v = clamped ? std::max(v, 1.0) : v;
        return zero_as_one && v == 0.0 ? 1.0 : v;
      };
      const bool per_sample = source == kCounts || source >= kScalars;
      const double scalar = source == kDivisor ? divisors[k] : per_sample ? 0.0 : read(o[source]);
      for (int64_t i = 0; i < n; ++i) {
        const double v = !per_sample ? scalar : read(source == kCounts ? step.count(i) : step.per_sample(source - kScalars, i));
        row[i] = f == 0 ? v : row[i] * v;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      if (!(row[i] > 0.0) || !std::isfinite(row[i])) {
        return kDenomNotPositive;
      }
      fits = fits && row[i] >= kNormalFrom && row[i] < kFiniteBelow;
    }
  }
  return fits ? kServed : kServedNotFloat32;
}

// counts [N] (int64 or float64, contiguous), group_index and session_index [N] int64 or None; per_prompt < 0 for
// none; check_groups: whether the step's groups must hold per_prompt samples (the mode reads P); sessions_in_groups:
// whether the mode reads the sessions of each group (Sp, Sp'), which must then hold per_prompt sessions; blocks:
// the per-sample totals to return (0..5, in this order); with_counts: whether to return the counts as float64;
// program and divisors: each term's d[i] (its factors' codes; its divisor). Returns float64
// [9 + (B + with_counts + K) N]: the scalars (status, N, N', T, L_max, P, P', S, S'), the blocks, the counts, d [K, N].
Tensor plan_totals(
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
  if (is_long) {
    step.counts_long = counts.const_data_ptr<int64_t>();
  } else {
    step.counts_double = counts.const_data_ptr<double>();
  }
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
  const int64_t width = static_cast<int64_t>(blocks.size()) + (with_counts ? 1 : 0) + static_cast<int64_t>(divisors.size());
  Tensor out = new_tensor(counts, {kScalars + width * n}, ScalarType::Double);
  double* o = out.mutable_data_ptr<double>();
  std::fill(o, o + kScalars, 0.0);
  Status status = totals(step, labels[0], labels[1], per_prompt, check_groups, sessions_in_groups, o);
  if (status == kServed) {
    double* at = o + kScalars;
    for (int64_t b : blocks) {
      for (int64_t i = 0; i < n; ++i) {
        at[i] = step.per_sample(b, i);
      }
      at += n;
    }
    if (with_counts) {
      for (int64_t i = 0; i < n; ++i) {
        at[i] = step.count(i);
      }
      at += n;
    }
    status = denoms(step, o, program, divisors, at);
  }
  o[0] = static_cast<double>(status);
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(lossagg, CPU, m) { m.impl("plan_totals", TORCH_BOX(&plan_totals)); }

}  // namespace lossagg::cpu
