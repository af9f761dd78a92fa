// The CPU engine for AVX-512 CPUs (F, BW, VL): engine_loops.h compiled for AVX-512 with
// 512-bit vectors preferred. The target is set by a pragma after the headers, as in
// engine_avx2.cpp.
#include "engine_deps.h"

#if defined(LOSSAGG_X86_TARGETS)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,f16c,popcnt,prefer-vector-width=512")
#define LOSSAGG_ISA avx512
#define LOSSAGG_ISA_LEVEL 2
#include "engine_loops.h"
#pragma GCC pop_options
#else
namespace lossagg::cpu::avx512 {
extern const Engine kEngine = {};  // never chosen: best_isa() is baseline on such builds
}
#endif
