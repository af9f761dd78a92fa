// The per-sample denominators d[i] of a mode whose d[i] is a product of step totals and the
// sample's own token count (docs/modes.md), evaluated from the token counts of one pass: the
// native half of lossagg.aggregate (lossagg/modes.py, DenomProduct, writes the program).
//
// A program is a product of factors, 4 bits each, the first factor in the lowest bits; the
// first zero nibble ends it. d[i] is the left fold f1 * f2 * ... in float64, factor by factor,
// each a correctly rounded product: the bits of the same fold over float64 tensors
// (DenomProduct's Python evaluation, which StepPlan runs).
//
//   1  N          samples in the batch
//   2  c(N')      samples with at least one counted token, at least 1 (empty_samples=skip)
//   3  c(T)       counted tokens of the batch, at least 1
//   4  c(L_max)   counted tokens of the longest sample, at least 1
//   5  L          the constant divisor (finite, > 0)
//   6  c(M[i])    the sample's own counted tokens, at least 1
#pragma once

#include "torch_api.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace lossagg {

enum DenomFactor : int64_t {
  kFactorSamples = 1,
  kFactorNonemptySamples = 2,
  kFactorTokens = 3,
  kFactorMaxTokens = 4,
  kFactorDivisor = 5,
  kFactorOwnTokens = 6,
};
constexpr int kFactorBits = 4;
// Starts the message of the error for a d[i] that is not finite and > 0 (lossagg/ops.py reads it
// and names the numbers it was made of, as StepPlan does).
constexpr const char* kDenomsNotPositive = "a denominator is not finite and > 0";
constexpr int kMaxFactors = 15;  // 60 bits of the int64 program

inline int64_t program_factor(int64_t program, int k) { return (program >> (kFactorBits * k)) & ((int64_t{1} << kFactorBits) - 1); }

// The program is well formed: 1..15 factors of 1..6, then zeros; a divisor factor needs a
// finite divisor > 0. Errors name lossagg.<op> and the argument.
inline void check_denom_program(const char* op, int64_t program, double divisor) {
  LOSSAGG_CHECK_VALUE(
      program > 0 && program < (int64_t{1} << (kFactorBits * kMaxFactors)), "lossagg.", op,
      ": denom_program must be a product of 1 to 15 factors, 4 bits each (csrc/denom_program.h), got ", program);
  bool ended = false;
  for (int k = 0; k < kMaxFactors; ++k) {
    const int64_t f = program_factor(program, k);
    if (f == 0) {
      ended = true;
      continue;
    }
    LOSSAGG_CHECK_VALUE(
        !ended && f <= kFactorOwnTokens, "lossagg.", op, ": denom_program factor ", k, " must be 1 to 6 with no gap before it, got ", f, " (program ",
        program, ")");
    if (f == kFactorDivisor) {
      LOSSAGG_CHECK_VALUE(
          std::isfinite(divisor) && divisor > 0, "lossagg.", op, ": divisor must be finite and > 0 (the program divides by L), got ", divisor);
    }
  }
}

// d[i] for b samples with token counts `counts`, as the header describes: d is set to the first
// factor, then multiplied by each next one in turn (per element the left fold; each pass is a
// plain loop over b doubles). Returns the index of the first d[i] that is not finite and > 0
// (a product that overflowed), or -1.
inline int64_t eval_denom_program(int64_t program, double divisor, const int64_t* counts, int64_t b, double* d) {
  int64_t nonempty = 0, tokens = 0, max_tokens = 0;
  for (int64_t i = 0; i < b; ++i) {
    nonempty += counts[i] > 0;
    tokens += counts[i];
    max_tokens = std::max(max_tokens, counts[i]);
  }
  const auto c = [](double x) { return std::max(x, 1.0); };
  double scalar[kFactorOwnTokens + 1] = {};
  scalar[kFactorSamples] = static_cast<double>(b);
  scalar[kFactorNonemptySamples] = c(static_cast<double>(nonempty));
  scalar[kFactorTokens] = c(static_cast<double>(tokens));
  scalar[kFactorMaxTokens] = c(static_cast<double>(max_tokens));
  scalar[kFactorDivisor] = divisor;
  for (int k = 0; k < kMaxFactors; ++k) {
    const int64_t f = program_factor(program, k);
    if (f == 0) {
      break;
    }
    if (f == kFactorOwnTokens) {
      for (int64_t i = 0; i < b; ++i) {
        const double m = c(static_cast<double>(counts[i]));
        d[i] = k == 0 ? m : d[i] * m;
      }
    } else {
      const double v = scalar[f];
      for (int64_t i = 0; i < b; ++i) {
        d[i] = k == 0 ? v : d[i] * v;
      }
    }
  }
  int64_t ok = 0;  // counted branch-free, then the first bad one looked for only when there is one
  for (int64_t i = 0; i < b; ++i) {
    ok += d[i] > 0 && d[i] < std::numeric_limits<double>::infinity();
  }
  if (ok == b) {
    return -1;
  }
  for (int64_t i = 0;; ++i) {
    if (!(d[i] > 0 && d[i] < std::numeric_limits<double>::infinity())) {
      return i;
    }
  }
}

}  // namespace lossagg
