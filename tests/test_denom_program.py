"""The denominator program has one home per language (lossagg/denom_program.py, csrc/denom_program.h),
and the two agree: the same codes for the same factors, the same d[i] to the bit. A DenomProduct
is immutable and names a factor that is not a string."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lossagg
from lossagg import denom_program
from lossagg.totals import EMPTY_SAMPLES, TOTALS, stand_in


def table_differences(python: dict[int, str], native: dict[int, str]) -> list[str]:
    """What differs between two tables of codes -> symbols."""
    out = [
        f"code {c}: Python has {python.get(c)!r}, the library {native.get(c)!r}"
        for c in sorted(set(python) | set(native))
        if python.get(c) != native.get(c)
    ]
    return out


def test_the_python_codes_are_the_native_librarys():
    python = {code: c.symbol for code, c in denom_program.CODES.items()}
    assert table_differences(python, lossagg._native.denom_factor_codes()) == []


def test_the_comparison_fails_when_the_two_tables_disagree():
    native = lossagg._native.denom_factor_codes()
    python = {code: c.symbol for code, c in denom_program.CODES.items()}
    assert table_differences({**python, 3: "c(L_max)"}, native) == ["code 3: Python has 'c(L_max)', the library 'c(T)'"]
    assert table_differences({**python, 7: "P"}, native) == ["code 7: Python has 'P', the library None"]


def test_each_factor_reads_a_declared_total_and_its_code_reads_the_stand_in():
    for f in denom_program.FACTORS.values():
        assert f.reads in TOTALS or f.reads in ("divisor", "token_counts")
        for empty in EMPTY_SAMPLES:
            code = denom_program.code_of(f.symbol, empty)
            reads = f.reads if f.reads in ("divisor", "token_counts") else stand_in(f.reads, empty)
            if code is None:
                assert reads not in {c.reads for c in denom_program.CODES.values()}
            else:
                assert denom_program.CODES[code].reads == reads
    assert denom_program.code_of("N", "count") == 1 and denom_program.code_of("N", "skip") == 2
    assert denom_program.code_of("P", "count") is None  # the groups are planned in Python


@pytest.mark.parametrize("empty", list(EMPTY_SAMPLES))
@pytest.mark.parametrize("factors", [("N", "c(M[i])"), ("c(T)",), ("N", "L"), ("N", "c(L_max)"), ("c(M[i])", "L", "N", "c(T)", "c(M[i])")])
def test_the_three_evaluations_have_the_same_bits(factors, empty):
    """The plan's (DenomProduct from the step totals), the composite's (evaluate from the counts)
    and the native op's d[i] are one fold of the same numbers; a ModeSpec on the product reads
    its formula, totals and divisor from it."""
    rng = np.random.default_rng(7)
    n = 37
    counts = torch.from_numpy(rng.integers(0, 900, size=n))
    counts[::5] = 0
    product = lossagg.DenomProduct(*factors)
    program = product.program(empty)
    assert program is not None
    divisor = 0.37
    spec = lossagg.ModeSpec(name="program_bits", summary="s", formula="f", denoms=product, reference=lambda r: 0.0)
    assert spec.totals == product.totals and spec.needs_divisor == ("L" in factors) and spec.denom_formula == " · ".join(factors)
    plan_d = _plan_d(product, counts, divisor, empty)  # what StepPlan runs: the totals, read, then the product
    composite_d = denom_program.evaluate(program, divisor, counts)
    lengths = counts + 2
    cu = lossagg.cu_seqlens_from_lengths(lengths)
    mask = torch.zeros(int(lengths.sum()), dtype=torch.bool)
    for i in range(n):
        mask[int(cu[i]) : int(cu[i]) + int(counts[i])] = True
    _, native_d = torch.ops.lossagg.aggregate(torch.ones(mask.shape[0]), mask, cu, list(program), divisor)
    bits = lambda t: t.view(torch.int64)  # noqa: E731
    assert torch.equal(bits(plan_d), bits(composite_d))
    assert torch.equal(bits(plan_d), bits(native_d))


def _plan_d(product, counts, divisor, empty):
    from lossagg.samples import RankSamples
    from lossagg.totals import plan_totals, read_totals

    m = counts.to(torch.float64)
    totals = plan_totals(product.totals, RankSamples(m.shape[0], m), mode="program_bits", empty_samples=empty)
    return product(denom_program.DenomInputs(m, read_totals(product.totals, totals, empty, "program_bits"), divisor))


def test_the_op_takes_the_program_as_a_list_and_names_a_bad_one():
    values, mask, cu = torch.ones(5), torch.ones(5, dtype=torch.bool), torch.tensor([0, 2, 5])
    j, d = torch.ops.lossagg.aggregate(values, mask, cu, [1, 6], 0.0)
    assert d.tolist() == [4.0, 6.0] and abs(j.item() - (2 / 4 + 3 / 6)) < 1e-7
    for program, message in (
        ([], "denom_program must be a list of 1 to 15 factor codes"),
        ([1] * 16, "denom_program must be a list of 1 to 15 factor codes"),
        ([1, 7], "denom_program factor 1 must be a code of 1 to 6, got 7"),
        ([0], "denom_program factor 0 must be a code of 1 to 6, got 0"),
        ([1, 5], "divisor must be finite and > 0"),
    ):
        for run in (torch.ops.lossagg.aggregate, __import__("lossagg.ops", fromlist=["_aggregate_composite"])._aggregate_composite):
            with pytest.raises((ValueError, RuntimeError), match=message.replace("(", r"\(").replace(")", r"\)")):
                run(values, mask, cu, program, 0.0)


def test_a_mode_spec_reads_its_product_and_refuses_one_that_disagrees():
    product = lossagg.DenomProduct("N", "c(T)")
    spec = lossagg.ModeSpec(name="reads_product", summary="s", formula="f", denoms=product, reference=lambda r: 0.0)
    assert (spec.denom_formula, spec.totals, spec.needs_divisor) == ("N · c(T)", ("num_samples", "total_tokens"), False)
    wrong = lossagg.ModeSpec(name="wrong_product", summary="s", formula="f", denoms=product, reference=lambda r: 0.0, denom_formula="N")
    with pytest.raises(ValueError, match="denom_formula of mode 'wrong_product' must be the formula of its DenomProduct"):
        lossagg.register_mode(wrong)
    hand = lossagg.ModeSpec(name="hand_written", summary="s", formula="f", denoms=lambda x: x.token_counts, reference=lambda r: 0.0)
    with pytest.raises(ValueError, match="denom_formula of mode 'hand_written' must be a non-empty string, got None"):
        lossagg.register_mode(hand)
    assert "wrong_product" not in lossagg.MODES and "hand_written" not in lossagg.MODES


def test_denom_product_is_immutable_and_names_bad_factors():
    product = lossagg.DenomProduct("N", "c(M[i])")
    for name in ("factors", "formula", "totals", "_programs"):
        with pytest.raises(AttributeError, match="immutable"):
            setattr(product, name, ("L",))
    assert product.factors == ("N", "c(M[i])") and product.program("count") is not None
    with pytest.raises(TypeError, match=r"separate strings.*got list \['N'\].*DenomProduct\(\*\['N'\]\)"):
        lossagg.DenomProduct(["N"])
    with pytest.raises(TypeError, match="got int 3"):
        lossagg.DenomProduct("N", 3)
