"""Every op's outputs and gradients keep their bits: the corpus of tests/golden.py against
the hashes recorded before the kernel types were reduced, on every instruction set this
CPU has and with 1 and 2 threads."""

from __future__ import annotations

import json

import golden
import pytest
import torch
from tiers import full_tier

import lossagg

ISAS = [
    isa
    for isa in ("baseline", "avx2", "avx512")
    if ("baseline", "avx2", "avx512").index(isa) <= ("baseline", "avx2", "avx512").index(lossagg._native.cpu_best_isa())
]


def run_on(isa: str, threads: int, corpus):
    """``corpus()`` with the CPU kernels capped at ``isa`` and torch on ``threads`` threads."""
    before = torch.get_num_threads()
    try:
        lossagg.set_cpu_isa(isa)
        torch.set_num_threads(threads)
        return corpus()
    finally:
        lossagg.set_cpu_isa("auto")
        torch.set_num_threads(before)


#: every instruction set with 2 threads, the best one with 1 too; the full tier (tests/tiers.py) each with 1 and 2
ISA_THREADS = [pytest.param(isa, threads, marks=[full_tier] if threads == 1 and isa != ISAS[-1] else []) for isa in ISAS for threads in (1, 2)]


@pytest.fixture(scope="module")
def recorded():
    with open(golden.GOLDEN_PATH) as f:
        return json.load(f)["cases"]


def test_corpus_covers_every_admitted_dtype_combination(recorded):
    cases = {tuple(name.split("/")) for name in recorded}
    assert {c[0] for c in cases} == set(golden.LAYOUTS)
    assert {c[1] for c in cases} == set(golden.VALUE_DTYPES)
    assert {c[2] for c in cases} == set(golden.MASK_DTYPES)
    ops = next(iter(recorded.values()))
    assert {f"reduce_d{d}" for d in golden.DENOM_DTYPES} <= set(ops)
    assert len(cases) == len(golden.LAYOUTS) * len(golden.VALUE_DTYPES) * len(golden.MASK_DTYPES)


@pytest.mark.parametrize("isa,threads", ISA_THREADS)
def test_outputs_match_the_recorded_hashes(recorded, isa, threads):
    now = run_on(isa, threads, golden.corpus_hashes)
    changed = [f"{case}:{op}" for case, ops in recorded.items() for op, h in ops.items() if now[case][op] != h]
    assert not changed, f"{len(changed)} outputs changed bits on {isa} with {threads} threads, e.g. {changed[:8]}"


def test_planner_results_match_the_recording():
    """StepPlan, from_totals, the references, aggregate and the verl adapter give the results
    recorded before the modes registry was reshaped (tests/golden_plan.py)."""
    import golden_plan

    _same_as_recorded(golden_plan, golden_plan.corpus(), "the planner")


def _same_as_recorded(recorder, now: dict, where: str) -> None:
    """Every result of ``recorder``'s corpus equals its recording, but those it lists as changed on purpose
    (``CHANGED``), each of which must differ."""
    with open(recorder.GOLDEN_PATH) as f:
        recorded = json.load(f)["cases"]
    assert set(now) == set(recorded)
    changed = [k for k in recorded if now[k] != recorded[k] and k not in recorder.CHANGED]
    assert not changed, f"{len(changed)} results changed ({where}), e.g. {[(k, recorded[k], now[k]) for k in changed[:4]]}"
    stale = [k for k in recorder.CHANGED if now.get(k) == recorded.get(k)]
    assert not stale, f"listed as changed but equal to the recording: {stale}"


@pytest.mark.parametrize("isa,threads", ISA_THREADS)
def test_denominator_program_routes_match_the_recording(isa, threads):
    """The plan, every route of aggregate (the native program, the Python one pass, plan then
    reduce), their gradients, the native op and its composite keep the bits recorded before
    the program got one home per language (tests/golden_program.py)."""
    import golden_program

    _same_as_recorded(golden_program, run_on(isa, threads, golden_program.corpus), f"{isa} with {threads} threads")


@pytest.mark.parametrize("isa,threads", ISA_THREADS)
def test_micro_batch_reductions_match_the_recording(isa, threads):
    """Every micro-batch reduction of both plans (one tensor, terms, parts, weights, several dtypes,
    metrics, a DeferredPlan's close) keeps the bits recorded through the five entrances of before
    they became one call (tests/golden_micro_batch.py), on every instruction set and thread count."""
    import golden_micro_batch

    with open(golden_micro_batch.GOLDEN_PATH) as f:
        recorded = json.load(f)["cases"]
    now = run_on(isa, threads, golden_micro_batch.corpus)
    kept = {k for k in recorded if not golden_micro_batch.changed(k)}
    assert kept == {k for k in now if not golden_micro_batch.changed(k)}
    differ = [k for k in kept if now[k] != recorded[k]]
    assert not differ, f"{len(differ)} results changed, e.g. {[(k, recorded[k], now[k]) for k in differ[:4]]}"
    import fnmatch

    for pattern in golden_micro_batch.SERVED:  # refused then, served now
        assert any(fnmatch.fnmatchcase(k, pattern) and "Error" in v for k, v in recorded.items()), pattern
        served = [v for k, v in now.items() if fnmatch.fnmatchcase(k, pattern)]
        assert served and not any("Error" in v for v in served), pattern
    for pattern in golden_micro_batch.BITS:  # new bits on purpose: not stale (each pattern changes some result)
        assert any(fnmatch.fnmatchcase(k, pattern) and now.get(k) != v for k, v in recorded.items()), f"listed as changed but equal: {pattern}"
