"""The denominator program: ``d[i]`` as a product of factors, the Python twin of csrc/denom_program.h.

One table of factors (:data:`FACTORS`: symbol, the step total it reads, whether it is read as
``c(x) = max(x, 1)``) and one table of the native codes (:data:`CODES`, the enum of
csrc/denom_program.h: what each code reads and how its value comes from the token counts of
the whole step). Everything that evaluates a product reads them:

* :class:`DenomProduct` (a mode's ``denoms``, evaluated by the plan from its step totals),
* :meth:`DenomProduct.program` (the codes the native ``aggregate`` op runs, under each
  ``empty_samples`` convention: the code of the total the factor reads there),
* :func:`evaluate` (the program from the counts in float64 tensor ops: the composite that
  serves devices without the native kernel, :mod:`lossagg.ops`).

Each multiplies the same numbers left to right, so all three give the bits of the native
evaluation. ``tests/test_denom_program.py`` compares :data:`CODES` with the native library's
own table (``lossagg._native.denom_factor_codes()``). Adding a factor: a row here, a row in
csrc/denom_program.h (when it has a native code), a total in :mod:`lossagg.totals` when it
reads a new one, and the docs (docs/modes.md).

Importing this module does not import torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from lossagg.messages import did_you_mean
from lossagg.totals import EMPTY_SAMPLES, TOTALS, RankShare, StepTotals, stand_in

#: At most this many factors in a product (csrc/denom_program.h, kMaxFactors).
MAX_FACTORS = 15


@dataclass(frozen=True)
class DenomInputs:
    """What ``d[i]`` is made of, for this rank's samples (tensors are float64 ``[n_local]``).

    ``totals`` holds exactly the step totals the mode declares (attributes of
    :class:`lossagg.totals.StepTotals`: ``num_samples``, ``total_tokens``, ``max_tokens``,
    ``num_groups``, ``group_token_sums`` (``Sg[g(i)]`` of each local sample)).
    """

    token_counts: Any  # M[i]
    totals: StepTotals
    divisor: float | None = None  # L, for a mode with needs_divisor


#: When a factor's final value is known, for masks that are final only once a micro-batch's
#: forward has run (filters inside the loss, lossagg.DeferredPlan, docs/composition.md):
#: ``setting`` before the step (the divisor); ``sample`` when the sample's own micro-batch has
#: run; ``group`` when its prompt group's has, if each group lies whole in one micro-batch;
#: ``step`` after the step's last micro-batch, on every rank (one all-reduce).
KNOWN = ("setting", "sample", "group", "step")


@dataclass(frozen=True)
class Factor:
    """One factor of a product, as docs/modes.md writes it."""

    symbol: str
    reads: str  # the step total it reads (lossagg.totals.TOTALS), or "divisor" (L) or "token_counts" (M[i])
    clamped: bool  # read as c(x) = max(x, 1)
    per_sample: bool  # one value per sample (M[i], Sg[g(i)]), not one for the step
    known: str  # when its final value is known (KNOWN)
    zero_as_one: bool = False  # 0 read as 1: a weight sum that is 0 only when every numerator is 0 (J = 0)


_FACTOR_ROWS = (
    Factor("N", "num_samples", clamped=False, per_sample=False, known="step"),
    Factor("P", "num_groups", clamped=False, per_sample=False, known="step"),
    Factor("c(T)", "total_tokens", clamped=True, per_sample=False, known="step"),
    Factor("c(L_max)", "max_tokens", clamped=True, per_sample=False, known="step"),
    Factor("L", "divisor", clamped=False, per_sample=False, known="setting"),
    Factor("c(M[i])", "token_counts", clamped=True, per_sample=True, known="sample"),
    Factor("c(Sg[g(i)])", "group_token_sums", clamped=True, per_sample=True, known="group"),
    # sessions (docs/modes.md, "Sessions"): a session's samples and tokens, the step's sessions, a group's sessions
    Factor("S", "num_sessions", clamped=False, per_sample=False, known="step"),
    Factor("K[s(i)]", "session_sizes", clamped=False, per_sample=True, known="session"),
    Factor("c(Ts[s(i)])", "session_token_sums", clamped=True, per_sample=True, known="session"),
    Factor("Sp[g(i)]", "group_sessions", clamped=False, per_sample=True, known="group"),
    Factor("W", "weight_sum", clamped=False, per_sample=False, known="step"),
    Factor("W_abs", "abs_weight_sum", clamped=False, per_sample=False, known="step", zero_as_one=True),
)
#: What a weighted mean puts in place of the sample count N (docs/terms.md, "Per-sample weights").
WEIGHTED_COUNT = MappingProxyType({"mean": "W", "abs_mean": "W_abs"})
#: The factors a :class:`DenomProduct` multiplies, by symbol.
FACTORS: Mapping[str, Factor] = MappingProxyType({f.symbol: f for f in _FACTOR_ROWS})
_NOT_TOTALS = ("divisor", "token_counts")


def _c(x: float) -> float:
    return max(float(x), 1.0)


def step_factor_value(f, totals: Mapping[str, Any]) -> float:
    """The value of a factor read from one step total (``f``: a :data:`FACTORS` entry, not per sample): the total,
    clamped to >= 1 where the factor is, and 0 read as 1 where it is."""
    v = _c(totals[f.reads]) if f.clamped else float(totals[f.reads])
    return 1.0 if f.zero_as_one and v == 0.0 else v


def step_product(symbols: tuple[str, ...], totals: Mapping[str, Any]) -> float:
    """The product of the step-level factors ``symbols`` (none per sample, no divisor) in their order, each read
    from ``totals`` by :func:`step_factor_value`: the float :class:`DenomProduct` makes of them; 1.0 for none."""
    acc = 1.0
    for symbol in symbols:
        f = FACTORS[symbol]
        if f.per_sample or f.reads in ("divisor", "token_counts"):
            raise ValueError(f"step_product reads the factors of step totals; {symbol} is not one")
        acc *= step_factor_value(f, totals)  # 1.0 * v is v: the same rounding as the product from its first factor
    return acc


@dataclass(frozen=True)
class Code:
    """One code of the native program (csrc/denom_program.h): the factor it multiplies and what it
    reads. Its value from the token counts of the whole step is :func:`code_value`'s: a step total
    is its one-rank value from :data:`lossagg.totals.TOTALS` (where counts become totals, once
    in Python), read as ``c(x) = max(x, 1)`` when ``clamped``."""

    code: int
    symbol: str  # as csrc/denom_program.h's table names it
    reads: str  # the step total (stand-in included), "divisor" or "token_counts"
    clamped: bool


_CODE_ROWS = (
    Code(1, "N", "num_samples", clamped=False),
    Code(2, "c(N')", "num_nonempty_samples", clamped=True),
    Code(3, "c(T)", "total_tokens", clamped=True),
    Code(4, "c(L_max)", "max_tokens", clamped=True),
    Code(5, "L", "divisor", clamped=False),
    Code(6, "c(M[i])", "token_counts", clamped=True),
)
#: The native codes, by code (the twin of csrc/denom_program.h's kFactorCodes).
CODES: Mapping[int, Code] = MappingProxyType({c.code: c for c in _CODE_ROWS})
_CODE_OF_READ: Mapping[str, int] = MappingProxyType({c.reads: c.code for c in _CODE_ROWS})


def code_value(code: int, counts, divisor: float) -> Any:
    """The value of ``code`` for the float64 token counts ``counts`` of the whole step: a float, or
    ``[B]`` values for ``c(M[i])``."""
    c = CODES[code]
    if c.reads == "divisor":
        return float(divisor)
    if c.reads == "token_counts":
        return counts.clamp(min=1.0)
    total = TOTALS[c.reads]
    value = float(total.value(total.share(RankShare(counts)), None))  # one rank's share is the whole step's
    return _c(value) if c.clamped else value


def code_of(symbol: str, empty_samples: str) -> int | None:
    """The native code of factor ``symbol`` under the ``empty_samples`` convention: that of the
    total it reads there (``N`` reads ``c(N')`` under skip), or None where there is none."""
    reads = FACTORS[symbol].reads
    return _CODE_OF_READ.get(reads if reads in _NOT_TOTALS else stand_in(reads, empty_samples))


def _fail(message: str):
    raise ValueError(f"lossagg.aggregate: {message}")


def check_program(program: Sequence[int], divisor: float) -> tuple[int, ...]:
    """``program`` as the native op checks it: 1 to 15 known codes; a divisor factor needs a
    finite divisor > 0 (the native op's messages, csrc/denom_program.h)."""
    program = tuple(int(code) for code in program)
    if not 0 < len(program) <= MAX_FACTORS:
        _fail(f"denom_program must be a list of 1 to {MAX_FACTORS} factor codes (csrc/denom_program.h), got {len(program)}")
    for k, code in enumerate(program):
        if code not in CODES:
            _fail(f"denom_program factor {k} must be a code of 1 to {len(CODES)}, got {code} (program {list(program)})")
        if CODES[code].reads == "divisor" and not (math.isfinite(divisor) and divisor > 0):
            _fail(f"divisor must be finite and > 0 (the program divides by L), got {divisor}")
    return program


def evaluate(program: Sequence[int], divisor: float, counts) -> Any:
    """``d[i]`` of a program from the int64 token counts of the whole step, in float64 tensor ops:
    the left fold of csrc/denom_program.h, factor by factor (so the bits of the native evaluation)."""
    program = check_program(program, divisor)
    m = counts.double()
    acc = None
    for code in program:
        v = code_value(code, m, divisor)
        acc = v if acc is None else acc * v
    return m.new_full(m.shape, acc) if isinstance(acc, float) else acc


class DenomProduct:
    """``d[i]`` as a product of factors, e.g. ``DenomProduct("N", "c(M[i])")``: a mode's ``denoms``
    written declaratively (every built-in mode is one).

    The factors are those of :data:`FACTORS` (docs/modes.md): ``N``, ``P``, ``c(T)``,
    ``c(L_max)``, ``L`` (the divisor), ``c(M[i])``, ``c(Sg[g(i)])``, the weight sums, and the
    session factors ``S``, ``K[s(i)]``, ``c(Ts[s(i)])`` and ``Sp[g(i)]``. Called like any ``denoms``
    (on :class:`DenomInputs`) it multiplies them left to right in float64. A product whose
    factors all have a native code (:func:`code_of`) also has a native program
    (:meth:`program`) that multiplies the same numbers in the same order, so
    :func:`lossagg.aggregate` computes ``d[i]`` and ``J`` in the one pass over the tokens, with
    the bits of this evaluation. A :class:`lossagg.ModeSpec` built on one reads its formula, its
    totals and whether it takes the divisor from it.
    """

    __slots__ = ("factors", "formula", "totals", "needs_divisor", "_programs")

    def __init__(self, *factors: str):
        if not factors or len(factors) > MAX_FACTORS:
            raise ValueError(f"DenomProduct takes 1 to {MAX_FACTORS} factors, got {len(factors)}")
        for f in factors:
            if not isinstance(f, str):
                raise TypeError(
                    f"DenomProduct takes its factors as separate strings, e.g. DenomProduct('N', 'c(M[i])'), got {type(f).__name__} {f!r}"
                    + (f": unpack it, DenomProduct(*{f!r})" if isinstance(f, (list, tuple)) else "")
                )
            if f not in FACTORS:
                raise ValueError(f"DenomProduct factor {f!r} is not one of {', '.join(FACTORS)}{did_you_mean(str(f), FACTORS)}")
        # set once: the registry and the native program read the declaration, which must not change under them
        setattr_ = object.__setattr__
        setattr_(self, "factors", tuple(factors))
        setattr_(self, "formula", " · ".join(factors))
        #: the step totals the product reads (its mode's ModeSpec.totals)
        setattr_(self, "totals", tuple(dict.fromkeys(FACTORS[f].reads for f in factors if FACTORS[f].reads not in _NOT_TOTALS)))
        #: whether it divides by the constant divisor L
        setattr_(self, "needs_divisor", "L" in factors)
        programs = {}
        for empty in EMPTY_SAMPLES:
            codes = tuple(code_of(f, empty) for f in factors)
            programs[empty] = None if None in codes else codes
        setattr_(self, "_programs", MappingProxyType(programs))

    def __setattr__(self, name, value):
        raise AttributeError(f"DenomProduct is immutable: {name} cannot be set (make a new DenomProduct and register a new mode)")

    def __delattr__(self, name):
        raise AttributeError(f"DenomProduct is immutable: {name} cannot be deleted")

    def program(self, empty_samples: str = "count") -> tuple[int, ...] | None:
        """The native program of this product under the ``empty_samples`` convention (its factors'
        codes, :data:`CODES`), or None where a factor has none (``P``, ``c(Sg[g(i)])``, the session
        factors: the groups and sessions are read by the plan's own passes, the native
        ``aggregate_planned`` op or a :class:`lossagg.StepPlan`)."""
        return self._programs.get(empty_samples)

    def __call__(self, x: DenomInputs):
        acc = None
        for symbol in self.factors:
            f = FACTORS[symbol]
            if f.reads == "divisor":
                v = float(x.divisor)
            elif f.reads == "token_counts":
                v = x.token_counts.clamp(min=1.0)
            elif f.per_sample:
                v = x.totals[f.reads].clamp(min=1.0) if f.clamped else x.totals[f.reads]
            else:
                v = step_factor_value(f, x.totals)
            acc = v if acc is None else acc * v
        if isinstance(acc, float):
            return x.token_counts.new_full(x.token_counts.shape, acc)
        return acc

    def __repr__(self) -> str:
        return f"DenomProduct({', '.join(map(repr, self.factors))})"

    def weighted(self, weighting: str) -> DenomProduct:
        """This product as a weighted mean (``weighting`` ``"mean"`` or ``"abs_mean"``): its sample
        count ``N`` replaced by the weights' sum ``W`` or ``W_abs``. ValueError for a product
        without ``N``."""
        if "N" not in self.factors:
            raise ValueError(f"a weighted mean replaces the sample count N, and {self.formula} has none")
        return DenomProduct(*(WEIGHTED_COUNT[weighting] if f == "N" else f for f in self.factors))
