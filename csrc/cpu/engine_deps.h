// Every header the engine's loops (engine_loops.h) use, included by each engine unit
// before it sets its target: the inline functions of these headers (torch's header-only
// types, the stable parallel_for, the standard library) are then compiled as baseline code in every unit, so
// whichever copy the linker keeps runs on any x86-64 CPU.
#pragma once

#include "../dispatch.h"
#include "../kernel_common.h"
#include "engine.h"
#include "lanes.h"
#include "work.h"

#include "../torch_api.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(LOSSAGG_X86_TARGETS)  // isa.h, through engine.h
#include <immintrin.h>
#endif
