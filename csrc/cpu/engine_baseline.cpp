// The CPU engine for every CPU: engine_loops.h with the compiler's baseline target
// (x86-64: SSE2).
#include "engine_deps.h"

#define LOSSAGG_ISA baseline
#define LOSSAGG_ISA_LEVEL 0
#include "engine_loops.h"
