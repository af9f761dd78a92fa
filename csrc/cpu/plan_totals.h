// What the plan's native passes (plan_totals.cpp) lend the other CPU kernels.
#pragma once

#include <cstdint>
#include <vector>

namespace lossagg::cpu {

// Starts the message of aggregate_planned's error for a step the plan declines (lossagg/ops.py reads it and takes the
// Python route, which raises naming the problem or serves the step).
constexpr const char* kPlanDeclines = "the plan declines the step";

// One term's d [n] (float64) of a one-process step, from its int64 token counts and the labels its factors read
// (nullptr where the mode reads none), by plan_totals' own passes: the same numbers as lossagg.StepPlan's d, bit for
// bit. `program` is one term's entry of plan_totals' program (its factor count, then its factors), `divisor` its L.
// Returns plan_totals' status: 0 or 7 served (d written; 7: some d[i] is not a normal float32), else declined.
int64_t plan_denoms(
    const int64_t* counts,
    int64_t n,
    const int64_t* groups,
    const int64_t* sessions,
    int64_t per_prompt,
    bool check_groups,
    bool sessions_in_groups,
    const std::vector<int64_t>& program,
    double divisor,
    double* d);

}  // namespace lossagg::cpu
