// The CPU engine for AVX2 CPUs: engine_loops.h compiled for AVX2 (+F16C, POPCNT). The
// target is set by a pragma after the headers (engine_deps.h), not by a command-line flag,
// so no inline function of a header is compiled for AVX2 (see engine_deps.h).
#include "engine_deps.h"

#if defined(LOSSAGG_X86_TARGETS)
#pragma GCC push_options
#pragma GCC target("avx2,f16c,popcnt")
#define LOSSAGG_ISA avx2
#define LOSSAGG_ISA_LEVEL 1
#include "engine_loops.h"
#pragma GCC pop_options
#else
namespace lossagg::cpu::avx2 {
extern const Engine kEngine = {};  // never chosen: best_isa() is baseline on such builds
}
#endif
