"""The aggregation modes: a registry, one entry per mode (docs/modes.md is its table).

Every mode is ``J = sum_i (sum_t m*l) / d[i]``; an entry (:class:`ModeSpec`) says what its
per-sample denominator ``d[i]`` is made of: the step totals it needs (names from the
declared table :data:`lossagg.totals.TOTALS`), whether it takes the constant divisor, its
one-line description and its reference formula for ``J`` written directly from the
definition (float64, a sum over samples, for tests and users' own CI). Everything else
reads the registry at the time of use: the config (validation, JSON Schema, ``lossagg
check``, argparse), :class:`lossagg.StepPlan`, the reference in :mod:`lossagg.testing`,
the invariance harness, the demo and the trainer adapters. A new mode is one
:func:`register_mode` call (built-in ones: one entry in ``_ENTRIES``) plus its docs row.

Other trainers' names for our maths (:data:`ALIASES`) and names whose maths is not ours
(:data:`REFUSED_NAMES`) live here too. A mode name is looked up before the aliases, and a
mode cannot be registered under a name an alias (or a refused name) already uses.

Notation: ``N`` samples in the step, ``P`` prompt groups present, ``T`` rollout tokens,
``L_max`` the longest sample's rollout tokens, ``M[i]`` sample i's rollout token count,
``Sg[g]`` the rollout tokens of group g, ``L`` the constant divisor, ``c(x) = max(x, 1)``.
Importing this module does not import torch.

The registry sits below the configuration, which reads it; registering a mode also runs the
checks the layers above add with :func:`add_registration_check` (the configuration adds
one: a new mode's ``example_settings`` must make a valid config).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from lossagg.denom_program import DenomInputs, DenomProduct  # a mode's d[i], declared (lossagg/denom_program.py)
from lossagg.messages import did_you_mean
from lossagg.totals import TOTALS, needs_groups, needs_sessions


@dataclass(frozen=True)
class ReferenceInputs:
    """One whole step, sample by sample, for a reference formula of ``J``.

    ``numerators[i]`` is ``sum_t m*l`` of sample i (a float64 0-dim tensor, so the
    reference is differentiable), ``token_counts[i]`` its ``M[i]``, ``group_index[i]``
    its prompt group (or None), ``session_index[i]`` its session (or None).
    """

    numerators: Sequence[Any]
    token_counts: Sequence[float]
    group_index: Sequence[int] | None
    divisor: float | None
    session_index: Sequence[int] | None = None


def _c(x: float) -> float:
    return max(float(x), 1.0)


@dataclass(frozen=True)
class ModeSpec:
    """One aggregation mode.

    With ``denoms`` a :class:`DenomProduct`, ``denom_formula``, ``totals`` and ``needs_divisor``
    are the product's own (left out, they are read from it; given, they must agree with it).
    A hand-written ``denoms`` function gives all three.
    """

    name: str  # lower case, [a-z][a-z0-9_]*
    summary: str  # one line: what it is
    formula: str  # J, as docs/modes.md writes it
    denom_formula: str | None = None  # d[i]; a DenomProduct's own formula when left out
    totals: tuple[str, ...] | None = None  # the step totals d[i] is made of (names in lossagg.totals.TOTALS)
    denoms: Callable[[DenomInputs], Any] | None = None  # d[i] for this rank's samples, float64 (required)
    reference: Callable[[ReferenceInputs], Any] | None = None  # J of a whole step, from the definition (required)
    needs_divisor: bool | None = None  # takes the constant divisor L (config.divisor); False when left out without a DenomProduct
    example_settings: Mapping[str, Any] = field(default_factory=dict)  # extra config settings it needs

    def __post_init__(self):
        product = self.denoms if isinstance(self.denoms, DenomProduct) else None
        derived = {
            "denom_formula": product.formula if product else None,
            "totals": product.totals if product else None,
            "needs_divisor": product.needs_divisor if product else False,
        }
        for what, value in derived.items():
            if getattr(self, what) is None:
                object.__setattr__(self, what, value)

    @property
    def needs_groups(self) -> bool:
        """Whether the mode needs each sample's prompt group (``group_index``)."""
        return needs_groups(self.totals)

    @property
    def needs_sessions(self) -> bool:
        """Whether the mode needs each sample's session (``session_index``; docs/modes.md, "Sessions")."""
        return needs_sessions(self.totals)

    def weighted(self, weighting: str) -> ModeSpec:
        """The mode as a term with this ``weighting`` of per-sample weights reduces (docs/terms.md):
        itself for ``none`` and ``multiply`` (the weights scale the numerators), or for ``mean`` and
        ``abs_mean`` the mode with its product's sample count ``N`` replaced by the weights' sum
        ``W`` or ``W_abs`` (ValueError for a mode without one; the config refuses it at launch)."""
        if weighting not in ("mean", "abs_mean"):
            return self
        if not isinstance(self.denoms, DenomProduct):
            raise ValueError(f"weighting={weighting} replaces the sample count N of a DenomProduct, and mode={self.name}'s d[i] is a function")
        product = self.denoms.weighted(weighting)
        return replace(self, denoms=product, denom_formula=product.formula, totals=product.totals)


@dataclass(frozen=True)
class Alias:
    """Another trainer's name for one of our modes."""

    mode: str  # the mode it stands for
    origin: str  # where the name comes from, and what it implies
    implies: Mapping[str, Any] = field(default_factory=dict)  # settings it implies when the user gives none
    with_divisor: str | None = None  # the mode it stands for when a divisor is given

    def resolve(self, settings: Mapping[str, Any]) -> str:
        return self.with_divisor if self.with_divisor is not None and settings.get("divisor") is not None else self.mode


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


def _max_length_reference(r: ReferenceInputs):
    return sum(r.numerators) / (len(r.numerators) * _c(max(r.token_counts)))


def _members(labels: Sequence[int]) -> dict[int, list[int]]:
    """The samples of each label, in order of first appearance."""
    members: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        members.setdefault(int(label), []).append(i)
    return members


def _session_mean_reference(r: ReferenceInputs):
    # each session once, each of its samples equally, a token mean inside each sample
    sessions = _members(r.session_index)
    return sum(sum(r.numerators[i] / _c(r.token_counts[i]) for i in ids) / len(ids) for ids in sessions.values()) / len(sessions)


def _session_token_mean_reference(r: ReferenceInputs):
    # each session once, a token mean over the session's tokens
    sessions = _members(r.session_index)
    return sum(sum(r.numerators[i] for i in ids) / _c(sum(r.token_counts[i] for i in ids)) for ids in sessions.values()) / len(sessions)


def _prompt_session_reference(r: ReferenceInputs, session_value) -> Any:
    # each prompt group once, each of its sessions equally, each session's value as session_value says
    groups: dict[int, dict[int, list[int]]] = {}
    for i, (g, s) in enumerate(zip(r.group_index, r.session_index, strict=True)):
        groups.setdefault(int(g), {}).setdefault(int(s), []).append(i)
    return sum(sum(session_value(ids) for ids in sessions.values()) / len(sessions) for sessions in groups.values()) / len(groups)


def _prompt_session_mean_reference(r: ReferenceInputs):
    return _prompt_session_reference(r, lambda ids: sum(r.numerators[i] / _c(r.token_counts[i]) for i in ids) / len(ids))


def _prompt_session_token_mean_reference(r: ReferenceInputs):
    return _prompt_session_reference(r, lambda ids: sum(r.numerators[i] for i in ids) / _c(sum(r.token_counts[i] for i in ids)))


_ENTRIES = (
    ModeSpec(
        name="sample_mean",
        summary="GRPO: every sample weighs the same",
        formula="(1/N) Σ_i Σ_t m·l / c(M[i])",
        denoms=DenomProduct("N", "c(M[i])"),
        reference=_sample_mean_reference,
    ),
    ModeSpec(
        name="prompt_mean",
        summary="token mean inside each prompt group, then a plain mean over groups (DAPO at group level)",
        formula="(1/P) Σ_g Σ_{i∈g} Σ_t m·l / c(Sg[g])",
        denoms=DenomProduct("P", "c(Sg[g(i)])"),
        reference=_prompt_mean_reference,
    ),
    ModeSpec(
        name="token_mean",
        summary="every token of the step weighs the same (DAPO)",
        formula="Σ_i Σ_t m·l / c(T)",
        denoms=DenomProduct("c(T)"),
        reference=_token_mean_reference,
    ),
    ModeSpec(
        name="constant",
        summary="Dr.GRPO: a fixed divisor, no length normalisation",
        formula="Σ_i Σ_t m·l / (N·L)",
        denoms=DenomProduct("N", "L"),
        reference=_constant_reference,
        example_settings={"divisor": 64.0},
    ),
    ModeSpec(
        name="max_length",
        summary="Dr.GRPO with L = the step's longest rollout (verl's seq-mean-token-sum-norm, split-invariant)",
        formula="(1/N) Σ_i Σ_t m·l / c(L_max)",
        denoms=DenomProduct("N", "c(L_max)"),
        reference=_max_length_reference,
    ),
    ModeSpec(
        name="session_mean",
        summary="each session (trajectory) once, each of its samples equally, a token mean inside each sample",
        formula="(1/S) Σ_s (1/K_s) Σ_{i∈s} Σ_t m·l / c(M[i])",
        denoms=DenomProduct("S", "K[s(i)]", "c(M[i])"),
        reference=_session_mean_reference,
    ),
    ModeSpec(
        name="session_token_mean",
        summary="each session once, a token mean over the session's tokens (slime's per-rollout divisor)",
        formula="(1/S) Σ_s Σ_{i∈s} Σ_t m·l / c(Ts[s])",
        denoms=DenomProduct("S", "c(Ts[s(i)])"),
        reference=_session_token_mean_reference,
    ),
    ModeSpec(
        name="prompt_session_mean",
        summary="each prompt group once, each of its sessions equally, session_mean inside (GRPO over multi-turn rollouts)",
        formula="(1/P) Σ_g (1/Sp_g) Σ_{s∈g} (1/K_s) Σ_{i∈s} Σ_t m·l / c(M[i])",
        denoms=DenomProduct("P", "Sp[g(i)]", "K[s(i)]", "c(M[i])"),
        reference=_prompt_session_mean_reference,
    ),
    ModeSpec(
        name="prompt_session_token_mean",
        summary="each prompt group once, each of its sessions equally, a token mean over each session's tokens",
        formula="(1/P) Σ_g (1/Sp_g) Σ_{s∈g} Σ_{i∈s} Σ_t m·l / c(Ts[s])",
        denoms=DenomProduct("P", "Sp[g(i)]", "c(Ts[s(i)])"),
        reference=_prompt_session_token_mean_reference,
    ),
)

# Other trainers' names for the same maths.
_ALIASES = {
    "seq-mean-token-mean": Alias("sample_mean", "verl loss_agg_mode"),
    "token-mean": Alias("token_mean", "verl loss_agg_mode"),
    "seq-mean-token-sum-norm": Alias(
        "max_length",
        "verl loss_agg_mode, and SkyRL's loss_reduction seq_mean_token_sum_norm (Dr.GRPO; verl divides by its micro-batch's "
        "padded width: max_length uses the step's longest rollout; with a divisor, verl's loss_scale_factor or SkyRL's "
        "max_seq_len, it is constant)",
        with_divisor="constant",
    ),
    "grpo": Alias("sample_mean", "TRL GRPOConfig.loss_type"),
    "dapo": Alias("token_mean", "TRL GRPOConfig.loss_type (tokens of the whole accumulated batch)"),
    "dr_grpo": Alias("constant", "TRL GRPOConfig.loss_type (divisor = max_completion_length)"),
    "per_token": Alias("token_mean", "Megatron --calculate-per-token-loss"),
    "seq-mean-token-sum": Alias(
        "constant", "verl loss_agg_mode: token sums over the global batch size, i.e. divisor 1", implies=MappingProxyType({"divisor": 1.0})
    ),
    "seq_mean": Alias("sample_mean", "AReaL loss_agg_mode"),
    "sequence_mean": Alias("sample_mean", "SkyRL trainer.algorithm.loss_reduction"),
}

# Names whose maths is not one of ours: refused with the reason, never mapped.
_REFUSED = {
    "bnpo": (
        "TRL's 'bnpo' divides by the active tokens of each local micro-batch, so the loss changes with the "
        "micro-batch split; use mode=token_mean for the step-global token mean"
    ),
    "token-sum": (
        "verl's 'token-sum' adds every token of the step with no normalisation at all, so the loss scale grows with the batch "
        "and the response lengths; use mode=constant with a divisor for a fixed scale, or token_mean"
    ),
    "token_mean_legacy": (
        "SkyRL's 'token_mean_legacy' divides each micro-batch by its own tokens and averages over micro-batches, so the loss "
        "changes with the micro-batch split; use mode=token_mean (SkyRL's 'token_mean') for the step's token mean"
    ),
}


class _RegistryView(Mapping):
    """A read-only live view of the registry that is safe to read while other threads register.

    The registry is copy-on-write: a change publishes a new dict under :data:`_LOCK` and a
    published dict is never changed again. Each read here (a lookup, one iteration, ``keys``,
    ``values``, ``items``) uses the one dict published when it starts, so a reader never meets
    a dict changing size under it, and a mode it lists is one it can look up in that view.
    """

    def __getitem__(self, name: str) -> ModeSpec:
        return _published[name]

    def __iter__(self):
        return iter(_published)

    def __len__(self) -> int:
        return len(_published)

    def __contains__(self, name: object) -> bool:
        try:
            return name in _published
        except TypeError:  # an unhashable key is not a mode name
            return False

    def keys(self):
        return _published.keys()

    def values(self):
        return _published.values()

    def items(self):
        return _published.items()

    def snapshot(self) -> Mapping[str, ModeSpec]:
        """The registry as it is now, frozen: several reads that must agree use one snapshot."""
        return MappingProxyType(_published)

    def __repr__(self) -> str:
        return f"MODES({', '.join(_published)})"


_published: dict[str, ModeSpec] = {}  # replaced, never changed, under _LOCK
_LOCK = threading.RLock()
_BUILT_IN: frozenset[str] = frozenset(m.name for m in _ENTRIES)

#: Every registered mode, in the order the docs list them (built-in ones first); the first
#: is the default. A read-only live view: modes registered later appear in it.
MODES: _RegistryView = _RegistryView()
#: Other trainers' names for our modes: name -> Alias.
ALIASES: Mapping[str, Alias] = MappingProxyType(_ALIASES)
#: Names refused with the reason (their maths is not one of ours).
REFUSED_NAMES: Mapping[str, str] = MappingProxyType(_REFUSED)
DEFAULT_MODE = "sample_mean"
#: The reducer of metrics other than the PG loss (docs/composition.md, "Who divides by what").
METRIC_MODE = "sample_mean"


def default_term_mode(mode: str) -> str:
    """The reducer of a term that names none, and of metrics, under a step of ``mode``: the default
    reducer (:data:`METRIC_MODE`), or the per-token mode when the step itself is token-level (a
    trainer then takes its per-token path for every term; docs/terms.md)."""
    per_token = ALIASES["per_token"].mode
    return per_token if mode == per_token else METRIC_MODE


_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


def _check_spec(spec: Any) -> None:
    if not isinstance(spec, ModeSpec):
        raise TypeError(f"register_mode takes a lossagg.ModeSpec, got {type(spec).__name__}")
    name = spec.name
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"ModeSpec.name must be lower case letters, digits and '_' (starting with a letter, <= 64 characters), got {name!r}")
    for spelling in {name, name.replace("_", "-")}:
        if spelling in _published:
            raise ValueError(f"mode {name!r} is already registered")
        if spelling in _ALIASES and _ALIASES[spelling].mode != name:
            raise ValueError(f"mode name {name!r} is taken: {spelling!r} is an alias of mode {_ALIASES[spelling].mode} ({_ALIASES[spelling].origin})")
        if spelling in _REFUSED:
            raise ValueError(f"mode name {name!r} is taken: {spelling!r} is a refused name ({_REFUSED[spelling]})")
    for what in ("denoms", "reference"):
        if not callable(getattr(spec, what)):
            raise TypeError(f"ModeSpec.{what} of mode {name!r} must be callable, got {type(getattr(spec, what)).__name__}")
    for what in ("summary", "formula", "denom_formula"):
        if not isinstance(getattr(spec, what), str) or not getattr(spec, what).strip():
            raise ValueError(f"ModeSpec.{what} of mode {name!r} must be a non-empty string, got {getattr(spec, what)!r}")
    if not isinstance(spec.totals, tuple) or not spec.totals:
        raise ValueError(f"ModeSpec.totals of mode {name!r} must be a non-empty tuple of step total names ({', '.join(TOTALS)}), got {spec.totals!r}")
    for total in spec.totals:
        if total not in TOTALS:
            raise ValueError(
                f"ModeSpec.totals of mode {name!r} names an unknown step total {total!r}{did_you_mean(total, TOTALS)}; "
                f"the totals are {', '.join(TOTALS)}"
            )
    if isinstance(spec.denoms, DenomProduct):
        if spec.denoms.formula != spec.denom_formula:
            raise ValueError(
                f"ModeSpec.denom_formula of mode {name!r} must be the formula of its DenomProduct, {spec.denoms.formula!r}, "
                f"got {spec.denom_formula!r}"
            )
        undeclared = [t for t in spec.denoms.totals if t not in spec.totals]
        if undeclared:
            raise ValueError(
                f"ModeSpec.denoms of mode {name!r} reads the step total(s) {', '.join(undeclared)}, which ModeSpec.totals does not declare"
            )
        if spec.denoms.needs_divisor != spec.needs_divisor:
            raise ValueError(
                f"ModeSpec.needs_divisor of mode {name!r} must be {spec.denoms.needs_divisor}: its DenomProduct is {spec.denoms.formula!r} "
                "(leave it out: it is read from the product)"
            )
    if not isinstance(spec.needs_divisor, bool):
        raise TypeError(f"ModeSpec.needs_divisor of mode {name!r} must be a bool, got {spec.needs_divisor!r}")
    if not isinstance(spec.example_settings, Mapping):
        raise TypeError(f"ModeSpec.example_settings of mode {name!r} must be a mapping, got {type(spec.example_settings).__name__}")


def _publish(registry: dict[str, ModeSpec]) -> None:
    global _published
    _published = registry


#: Checks a new mode must pass besides its entry's own shape, added by the layers above that
#: read the registry (:func:`add_registration_check`); each raises on a mode it refuses. The
#: configuration adds one when it is imported, and ``lossagg/__init__.py`` imports it, so it is
#: in place before any mode can be registered.
_REGISTRATION_CHECKS: list[Callable[[ModeSpec], None]] = []


def add_registration_check(check: Callable[[ModeSpec], None]) -> None:
    """Run ``check(spec)`` on every mode registered from now on, with the mode already in the
    registry (so the check can read it there as any user would); an exception it raises
    refuses the mode, which is then removed."""
    with _LOCK:
        if check not in _REGISTRATION_CHECKS:
            _REGISTRATION_CHECKS.append(check)


def register_mode(spec: ModeSpec) -> ModeSpec:
    """Add a mode at run time; the config, planner, references, demo and adapters accept it at once.

    Refused (nothing registered): a name already used by a mode, an alias or a refused name
    (hyphens and underscores count as the same), a malformed entry, or ``example_settings``
    that do not make a valid config. Register in every process (DP ranks, spawned workers):
    the registry is per process. Safe from several threads: of concurrent registrations of
    one name exactly one succeeds, the others are refused.
    """
    with _LOCK:
        _check_spec(spec)
        before = _published
        _publish({**before, spec.name: spec})
        try:
            for check in _REGISTRATION_CHECKS:
                check(spec)
        except BaseException:
            _publish(before)
            raise
    return spec


def unregister_mode(name: str) -> None:
    """Remove a mode added by :func:`register_mode` (built-in modes stay)."""
    if not isinstance(name, str):
        raise TypeError(f"unregister_mode takes a mode name (str), got {type(name).__name__}: {name!r}")
    with _LOCK:
        if name in _BUILT_IN:
            raise ValueError(f"mode {name!r} is built in and cannot be unregistered")
        if name not in _published:
            raise ValueError(f"mode {name!r} is not registered; registered modes: {', '.join(_published)}")
        _publish({k: v for k, v in _published.items() if k != name})


def mode_registry() -> Mapping[str, ModeSpec]:
    """The registry as it stands (a new object after every registration or removal: what caches compare)."""
    return _published


def mode_spec(mode: Any) -> ModeSpec:
    """The entry of the mode named ``mode``; ValueError naming the registered modes if unknown."""
    registry = _published
    try:
        return registry[mode]
    except (KeyError, TypeError):
        raise ValueError(f"mode must be one of {', '.join(registry)}, got {mode!r}") from None


def mode_spellings(name: str) -> tuple[str, ...]:
    """The spellings ``name`` stands for, in the order they are looked up: as given (case and
    surrounding spaces ignored), then with ``-`` for ``_``, then with ``_`` for ``-`` (no repeats)."""
    key = name.strip().lower()
    return tuple(dict.fromkeys((key, key.replace("_", "-"), key.replace("-", "_"))))


def canonical_mode(name: Any, settings: Mapping[str, Any] = MappingProxyType({})) -> tuple[Any, str | None]:
    """(the mode ``name`` stands for, the alias used or None).

    Case and surrounding spaces are ignored and ``-`` equals ``_`` for mode names, aliases
    and refused names alike; a mode name wins over an alias (an alias that differs from a
    mode's name only by ``-`` stands for that mode: it is kept for its resolution note); a
    refused name raises ValueError with the reason. A name that is neither is returned
    unchanged (the config reports it, with "did you mean").
    """
    if not isinstance(name, str):
        return name, None
    spellings = mode_spellings(name)
    key = spellings[0]
    registry = _published
    if key in registry:
        return key, None
    # other trainers' names: '-' and '_' count as the same here too (SkyRL's seq_mean_token_sum_norm is verl's
    # seq-mean-token-sum-norm); the spelling as given is looked up first
    for spelling in spellings:
        if spelling in _REFUSED:
            raise ValueError(f"mode {name!r} is not supported: {_REFUSED[spelling]}")
    for spelling in spellings:
        if spelling in _ALIASES:  # an alias spelled like a mode stands for that very mode (registration makes sure)
            return _ALIASES[spelling].resolve(settings), spelling
    if key.replace("-", "_") in registry:
        return key.replace("-", "_"), None
    return name, None


def divisor_for(
    spec: ModeSpec, given: float | None = None, default: float | None = None, *, alias: str | None = None, default_name: str = "a default"
) -> float | None:
    """The constant divisor ``L`` an adapter puts in its config for mode ``spec``: the one place
    that decides where a divisor comes from, for every adapter (verl, TRL, the demo, the figures).

    None when the mode takes no divisor. Otherwise the user's ``given`` divisor when there is
    one (verl's ``loss_scale_factor``), else None when the ``alias`` the user named implies one
    (the config applies the alias's own and notes it), else the adapter's ``default`` (verl:
    the padded width; TRL: ``max_completion_length``; the demo: its longest response; the
    figures: the step's longest). A mode that takes a divisor with none of them is a
    ValueError naming ``default_name``. The number itself is checked where it is used (the
    config: finite and > 0).
    """
    if not spec.needs_divisor:
        return None
    if given is not None:
        return float(given)
    if alias is not None and "divisor" in _ALIASES[alias].implies:
        return None
    if default is None:
        raise ValueError(f"mode={spec.name} divides by {default_name}, which is not set")
    return float(default)


for _spec in _ENTRIES:
    _check_spec(_spec)
    _publish({**_published, _spec.name: _spec})
del _spec
