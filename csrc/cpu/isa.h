// Which vector instruction set the CPU engine uses, decided at run time: the widest the
// CPU has (AVX-512, AVX2, or the baseline x86-64/other build), capped by the environment
// variable LOSSAGG_CPU_ISA (read once) or set_cpu_isa(). Every path adds in the same order,
// so the choice changes the speed, never a bit of the result.
#pragma once

#include <string>

// The AVX2 and AVX-512 units (engine_avx2.cpp, engine_avx512.cpp) set their target with
// `#pragma GCC target` after their headers, which only GCC implements (clang ignores the
// pragma). So they are built by GCC on x86-64; any other build (clang, another
// architecture) has the baseline unit only, and CMakeLists.txt says so when it configures.
// The one place this condition is written.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LOSSAGG_X86_TARGETS 1
#endif

namespace lossagg::cpu {

enum class Isa : int { baseline = 0, avx2 = 1, avx512 = 2 };

// The ISA the next call will use (the CPU's best, capped).
Isa active_isa();
// The widest ISA this CPU and this build support.
Isa best_isa();
const char* isa_name(Isa isa);
// Empty, or why LOSSAGG_CPU_ISA cannot be used (an unknown name): the CPU ops raise it, until
// set_cpu_isa() overrides the variable.
const std::string& isa_env_problem();

}  // namespace lossagg::cpu
