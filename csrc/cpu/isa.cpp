#include "isa.h"

#include "../lossagg.h"

#include "../torch_api.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

namespace lossagg::cpu {
namespace {

Isa detect() {
#if defined(LOSSAGG_X86_TARGETS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("popcnt")) {
    return Isa::avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("popcnt")) {
    return Isa::avx2;
  }
#endif
  return Isa::baseline;
}

bool parse(const char* name, Isa* out) {
  for (Isa isa : {Isa::baseline, Isa::avx2, Isa::avx512}) {
    if (std::strcmp(name, isa_name(isa)) == 0) {
      *out = isa;
      return true;
    }
  }
  return false;
}

std::atomic<int>& cap() {
  static std::atomic<int> value{[] {
    const char* env = std::getenv("LOSSAGG_CPU_ISA");
    Isa isa = Isa::avx512;
    if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0 || !parse(env, &isa)) {
      return static_cast<int>(Isa::avx512);  // no cap (the CPU ops raise isa_env_problem() for an unknown name)
    }
    return static_cast<int>(isa);
  }()};
  return value;
}

std::atomic<bool>& set_explicitly() {
  static std::atomic<bool> value{false};
  return value;
}

}  // namespace

const std::string& isa_env_problem() {
  static const std::string empty;
  static const std::string problem = [] {
    const char* env = std::getenv("LOSSAGG_CPU_ISA");
    Isa isa = Isa::avx512;
    if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0 || parse(env, &isa)) {
      return std::string();
    }
    return "LOSSAGG_CPU_ISA must be one of auto, avx512, avx2, baseline, got '" + std::string(env) +
           "' (fix or unset it; lossagg.set_cpu_isa() overrides it)";
  }();
  return set_explicitly().load(std::memory_order_relaxed) ? empty : problem;
}

Isa best_isa() {
  static const Isa best = detect();
  return best;
}

Isa active_isa() {
  const int capped = cap().load(std::memory_order_relaxed);
  return static_cast<Isa>(std::min(capped, static_cast<int>(best_isa())));
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    default:
      return "baseline";
  }
}

}  // namespace lossagg::cpu

namespace lossagg {

std::string cpu_isa() { return cpu::isa_name(cpu::active_isa()); }

std::string cpu_best_isa() { return cpu::isa_name(cpu::best_isa()); }

void set_cpu_isa(const std::string& name) {
  cpu::Isa isa = cpu::Isa::avx512;
  if (name != "auto") {
    bool ok = false;
    for (cpu::Isa candidate : {cpu::Isa::baseline, cpu::Isa::avx2, cpu::Isa::avx512}) {
      if (name == cpu::isa_name(candidate)) {
        isa = candidate;
        ok = true;
      }
    }
    LOSSAGG_CHECK_VALUE(ok, "lossagg.set_cpu_isa: isa must be one of auto, avx512, avx2, baseline, got '", name, "'");
  }
  cpu::cap().store(static_cast<int>(isa));
  cpu::set_explicitly().store(true, std::memory_order_relaxed);
}

}  // namespace lossagg
