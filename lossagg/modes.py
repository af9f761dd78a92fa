"""The aggregation modes, one entry each (SPEC §3).

Every mode is ``J = sum_i (sum_t m*l) / d[i]``; an entry says what its per-sample
denominator ``d[i]`` is made of (from the step totals), which totals it needs, its
one-line description, and its reference formula for ``J`` written directly from the
definition (float64, a sum over samples, for tests and users' own CI). Everything
else iterates :data:`MODES`: the config enum, the denominators, the reference in
:mod:`lossagg.testing`, the demo, the figures and the tests. A new mode is one entry
here plus its docs.

Notation: ``N`` samples in the step, ``P`` prompt groups present, ``T`` rollout tokens,
``M[i]`` sample i's rollout token count, ``Sg[g]`` the rollout tokens of group g,
``L`` the constant divisor, ``c(x) = max(x, 1)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class StepTotals:
    """Step-global numbers: ``N`` samples, ``P`` prompt groups present, ``T`` rollout tokens."""

    num_samples: int
    num_groups: int
    total_tokens: float


@dataclass(frozen=True)
class DenomInputs:
    """What ``d[i]`` is made of, for this rank's samples (tensors are float64 ``[n_local]``)."""

    token_counts: Any  # M[i]
    totals: StepTotals
    group_token_sums: Any = None  # Sg[g(i)], prompt_mean only
    divisor: float | None = None  # L, constant only


@dataclass(frozen=True)
class ReferenceInputs:
    """One whole step, sample by sample, for a reference formula of ``J``.

    ``numerators[i]`` is ``sum_t m*l`` of sample i (a float64 0-dim tensor, so the
    reference is differentiable), ``token_counts[i]`` its ``M[i]``, ``group_index[i]``
    its prompt group (or None).
    """

    numerators: Sequence[Any]
    token_counts: Sequence[float]
    group_index: Sequence[int] | None
    divisor: float | None


def _c(x: float) -> float:
    return max(float(x), 1.0)


@dataclass(frozen=True)
class ModeSpec:
    """One aggregation mode."""

    name: str
    summary: str  # one line: what it is
    formula: str  # J, as SPEC §3 writes it
    denom_formula: str  # d[i]
    needs_groups: bool  # needs group_index and the group totals P, Sg
    needs_divisor: bool  # needs the constant divisor L
    denoms: Callable[[DenomInputs], Any]  # d[i] for this rank's samples, float64
    reference: Callable[[ReferenceInputs], Any]  # J of a whole step, from the definition
    example_settings: Mapping[str, Any] = field(default_factory=dict)  # extra config settings it needs


# ------------------------------------------------------------------- the modes
def _sample_mean_reference(r: ReferenceInputs):
    n = len(r.numerators)
    return sum(r.numerators[i] / _c(r.token_counts[i]) for i in range(n)) / n


def _prompt_mean_reference(r: ReferenceInputs):
    members: dict[int, list[int]] = {}
    for i, g in enumerate(r.group_index):
        members.setdefault(int(g), []).append(i)
    group_means = [sum(r.numerators[i] for i in ids) / _c(sum(r.token_counts[i] for i in ids)) for ids in members.values()]
    return sum(group_means) / len(group_means)


def _token_mean_reference(r: ReferenceInputs):
    return sum(r.numerators) / _c(sum(r.token_counts))


def _constant_reference(r: ReferenceInputs):
    return sum(r.numerators) / (len(r.numerators) * float(r.divisor))


_ENTRIES = (
    ModeSpec(
        name="sample_mean",
        summary="GRPO: every sample weighs the same",
        formula="(1/N) Σ_i Σ_t m·l / c(M[i])",
        denom_formula="N · c(M[i])",
        needs_groups=False,
        needs_divisor=False,
        denoms=lambda x: float(x.totals.num_samples) * x.token_counts.clamp(min=1.0),
        reference=_sample_mean_reference,
    ),
    ModeSpec(
        name="prompt_mean",
        summary="token mean inside each prompt group, then a plain mean over groups (DAPO at group level)",
        formula="(1/P) Σ_g Σ_{i∈g} Σ_t m·l / c(Sg[g])",
        denom_formula="P · c(Sg[g(i)])",
        needs_groups=True,
        needs_divisor=False,
        denoms=lambda x: float(x.totals.num_groups) * x.group_token_sums.clamp(min=1.0),
        reference=_prompt_mean_reference,
    ),
    ModeSpec(
        name="token_mean",
        summary="every token of the step weighs the same (DAPO)",
        formula="Σ_i Σ_t m·l / c(T)",
        denom_formula="c(T)",
        needs_groups=False,
        needs_divisor=False,
        denoms=lambda x: x.token_counts.new_full(x.token_counts.shape, _c(x.totals.total_tokens)),
        reference=_token_mean_reference,
    ),
    ModeSpec(
        name="constant",
        summary="Dr.GRPO: a fixed divisor, no length normalisation",
        formula="Σ_i Σ_t m·l / (N·L)",
        denom_formula="N · L",
        needs_groups=False,
        needs_divisor=True,
        denoms=lambda x: x.token_counts.new_full(x.token_counts.shape, float(x.totals.num_samples) * float(x.divisor)),
        reference=_constant_reference,
        example_settings={"divisor": 64.0},
    ),
)

#: Every mode, in the order the docs list them; the first is the default.
MODES: Mapping[str, ModeSpec] = MappingProxyType({m.name: m for m in _ENTRIES})
MODE_NAMES: tuple[str, ...] = tuple(MODES)
DEFAULT_MODE = MODE_NAMES[0]
#: The reducer of metrics other than the PG loss (SPEC §4).
METRIC_MODE = "sample_mean"


def mode_spec(mode: Any) -> ModeSpec:
    """The entry of ``mode`` (a name or an :class:`~lossagg.AggregationMode`); ValueError if unknown."""
    name = getattr(mode, "value", mode)
    try:
        return MODES[name]
    except (KeyError, TypeError):
        raise ValueError(f"mode must be one of {', '.join(MODE_NAMES)}, got {mode!r}") from None
