// The per-sample denominators d[i] of a mode whose d[i] is a product of step totals and the
// sample's own token count (docs/modes.md), evaluated from the token counts of one pass: the
// native half of lossagg.aggregate. Its Python twin is lossagg/denom_program.py (the same
// codes, written there from kFactorCodes' symbols; tests/test_denom_program.py compares the
// two tables through lossagg_denom_factor_codes, csrc/c_api.cpp).
//
// A program is a list of 1 to kMaxFactors factor codes. d[i] is the left fold f1 * f2 * ...
// in float64, factor by factor, each a correctly rounded product: the bits of the same fold
// over float64 tensors (DenomProduct's Python evaluation, which StepPlan runs).
#pragma once

#include "torch_api.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace lossagg {

enum DenomFactor : int64_t {
  kFactorSamples = 1,          // N: samples in the batch
  kFactorNonemptySamples = 2,  // c(N'): samples with a counted token, at least 1 (empty_samples=skip)
  kFactorTokens = 3,           // c(T): counted tokens of the batch, at least 1
  kFactorMaxTokens = 4,        // c(L_max): counted tokens of the longest sample, at least 1
  kFactorDivisor = 5,          // L: the constant divisor (finite, > 0)
  kFactorOwnTokens = 6,        // c(M[i]): the sample's own counted tokens, at least 1
};

struct FactorCode {
  DenomFactor code;
  const char* symbol;  // as docs/modes.md and lossagg/denom_program.py write it
};
inline constexpr FactorCode kFactorCodes[] = {
    {kFactorSamples, "N"}, {kFactorNonemptySamples, "c(N')"}, {kFactorTokens, "c(T)"}, {kFactorMaxTokens, "c(L_max)"},
    {kFactorDivisor, "L"}, {kFactorOwnTokens, "c(M[i])"},
};
constexpr int64_t kNumFactorCodes = sizeof(kFactorCodes) / sizeof(kFactorCodes[0]);
// Starts the message of the error for a d[i] that is not finite and > 0 (lossagg/aggregate.py
// reads it and names the numbers it was made of, as StepPlan does).
constexpr const char* kDenomsNotPositive = "a denominator is not finite and > 0";
constexpr int64_t kMaxFactors = 15;

// The program is well formed: 1 to kMaxFactors known codes; a divisor factor needs a finite
// divisor > 0. Errors name lossagg.<op> and the argument.
inline void check_denom_program(const char* op, const std::vector<int64_t>& program, double divisor) {
  const int64_t n = static_cast<int64_t>(program.size());
  LOSSAGG_CHECK_VALUE(
      n > 0 && n <= kMaxFactors, "lossagg.", op, ": denom_program must be a list of 1 to ", kMaxFactors, " factor codes (csrc/denom_program.h), got ",
      n);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t f = program[static_cast<size_t>(k)];
    LOSSAGG_CHECK_VALUE(
        f >= 1 && f <= kNumFactorCodes, "lossagg.", op, ": denom_program factor ", k, " must be a code of 1 to ", kNumFactorCodes, ", got ", f);
    if (f == kFactorDivisor) {
      LOSSAGG_CHECK_VALUE(
          std::isfinite(divisor) && divisor > 0, "lossagg.", op, ": divisor must be finite and > 0 (the program divides by L), got ", divisor);
    }
  }
}

// The program as Python writes a list, for messages: "[1, 6]".
inline std::string program_text(const std::vector<int64_t>& program) {
  std::string text = "[";
  for (size_t k = 0; k < program.size(); ++k) {
    text += (k ? ", " : "") + std::to_string(program[k]);
  }
  return text + "]";
}

// d[i] for b samples with token counts `counts`, as the header describes: d is set to the first
// factor, then multiplied by each next one in turn (per element the left fold; each pass is a
// plain loop over b doubles); the step totals are counted only when the program reads them.
// Returns the index of the first d[i] that is not finite and > 0 (a product that overflowed), or
// -1. With `divisible` given, *divisible tells whether every d[i], rounded to the accumulation
// dtype (float64 when in_double, else float32), is finite and a normal number: the test
// check_sample_denoms_data makes before a division, so that a caller told true need not make it.
inline int64_t eval_denom_program(
    const std::vector<int64_t>& program,
    double divisor,
    const int64_t* counts,
    int64_t b,
    double* d,
    bool in_double = true,
    bool* divisible = nullptr) {
  bool reads[kFactorOwnTokens + 1] = {};
  for (const int64_t f : program) {
    reads[f] = true;
  }
  int64_t nonempty = 0, tokens = 0, max_tokens = 0;
  if (reads[kFactorNonemptySamples]) {
    for (int64_t i = 0; i < b; ++i) {
      nonempty += counts[i] > 0;
    }
  }
  if (reads[kFactorTokens]) {
    for (int64_t i = 0; i < b; ++i) {
      tokens += counts[i];
    }
  }
  if (reads[kFactorMaxTokens]) {
    for (int64_t i = 0; i < b; ++i) {
      max_tokens = std::max(max_tokens, counts[i]);
    }
  }
  const auto c = [](double x) { return std::max(x, 1.0); };
  double scalar[kFactorOwnTokens + 1] = {};
  scalar[kFactorSamples] = static_cast<double>(b);
  scalar[kFactorNonemptySamples] = c(static_cast<double>(nonempty));
  scalar[kFactorTokens] = c(static_cast<double>(tokens));
  scalar[kFactorMaxTokens] = c(static_cast<double>(max_tokens));
  scalar[kFactorDivisor] = divisor;
  for (size_t k = 0; k < program.size(); ++k) {
    const int64_t f = program[k];
    if (f == kFactorOwnTokens && k == 0) {
      for (int64_t i = 0; i < b; ++i) {
        d[i] = c(static_cast<double>(counts[i]));
      }
    } else if (f == kFactorOwnTokens) {
      for (int64_t i = 0; i < b; ++i) {
        d[i] *= c(static_cast<double>(counts[i]));
      }
    } else if (k == 0) {
      std::fill(d, d + b, scalar[f]);
    } else {
      const double v = scalar[f];
      for (int64_t i = 0; i < b; ++i) {
        d[i] *= v;
      }
    }
  }
  // counted branch-free in the accumulation dtype (a d[i] that passes there is finite and > 0 in float64 too), then
  // the first bad one looked for only when there is one
  bool ok = true;
  if (in_double) {
    for (int64_t i = 0; i < b; ++i) {
      ok &= (d[i] >= std::numeric_limits<double>::min()) & (d[i] <= std::numeric_limits<double>::max());
    }
  } else {
    for (int64_t i = 0; i < b; ++i) {
      const float x = static_cast<float>(d[i]);
      ok &= (x >= std::numeric_limits<float>::min()) & (x <= std::numeric_limits<float>::max());
    }
  }
  if (divisible) {
    *divisible = ok;
  }
  for (int64_t i = 0; !ok && i < b; ++i) {
    if (!(d[i] > 0 && d[i] < std::numeric_limits<double>::infinity())) {
      return i;
    }
  }
  return -1;
}

}  // namespace lossagg
