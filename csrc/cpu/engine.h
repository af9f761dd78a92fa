// The CPU engine's interface: three entry points per instruction set, chosen once per op.
//
// engine_loops.h holds the loops, written once. It is compiled three times, one
// translation unit per ISA (engine_baseline.cpp, engine_avx2.cpp, engine_avx512.cpp),
// each with its own target; each defines `kEngine` in its own namespace. ops_cpu.cpp picks
// the table of the active ISA (isa.h) at the start of an op. Every table adds in the same
// order, so the choice changes the speed, never a bit of the result.
//
// Summation order. A segment of at most kPieceTokens tokens is one "piece"; a longer one
// is cut into pieces of kPieceTokens tokens from its start. A piece is summed in a fixed
// order (engine_loops.h), and a segment's pieces are added left to right. The order
// depends only on the input, never on the thread count or the instruction set.
#pragma once

#include "../kernel_common.h"
#include "isa.h"

#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>

namespace lossagg::cpu {

// One op's inputs in kernel types (op_setup.h): values of `values_dtype` (undefined for
// the backward ops), a mask of `mask_kind`, and the segments. Metric k's values are at
// value_rows[k] when it is given (K tensors read where they lie: reduce_terms), else at
// values + k * num_tokens (the rows of one [K, T] tensor).
struct KernelArgs {
  const void* values;
  torch::headeronly::ScalarType values_dtype;
  const void* mask;
  MaskKind mask_kind;
  TokenLayout layout;
  Segments seg;
  const void* const* value_rows = nullptr;
};

struct Engine {
  // out[k * B + s] = sum over tokens t of segment s of mask_weight(m[t]) * v_k[t] (metric k's values),
  // in the accumulation dtype; masked-out tokens selected away. With counts not null, also
  // counts[s] = the tokens of segment s whose mask is non-zero (exact), from the same read.
  void (*segment_sums)(const KernelArgs& args, void* out, int64_t* counts);
  // o_k[t] = mask_weight(m[t]) * coef[k * B + s] for t in segment s (0 where the mask is 0),
  // written in values_dtype; coef is in the accumulation dtype. o_k is out_rows[k] when it is
  // given (K tensors of their own: reduce_terms_backward), else out + k * T.
  void (*expand_to_tokens)(const KernelArgs& args, const void* coef, void* out, void* const* out_rows);
  // out[s] = tokens of segment s whose mask is non-zero (exact).
  void (*count_kept)(const KernelArgs& args, int64_t* out);
};

namespace baseline {
extern const Engine kEngine;
}
namespace avx2 {
extern const Engine kEngine;  // empty where the build has no x86 targets
}
namespace avx512 {
extern const Engine kEngine;
}

inline const Engine& engine_for(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return avx512::kEngine;
    case Isa::avx2:
      return avx2::kEngine;
    default:
      return baseline::kEngine;
  }
}

}  // namespace lossagg::cpu
