"""``LossAggregationConfig``: the pydantic model and its rules (docs/config.md).

* ``mode``: the name of a registered mode (:data:`lossagg.modes.MODES`, default
  :data:`lossagg.modes.DEFAULT_MODE`), read from the registry when validated, so a mode added with
  :func:`lossagg.register_mode` is accepted at once (the JSON Schema lists it too); other
  trainers' names for the same maths are accepted and mapped (:data:`lossagg.modes.ALIASES`),
  names whose maths differ are refused with the reason (:data:`lossagg.modes.REFUSED_NAMES`).
  Mode names are looked up before aliases.
* ``divisor`` (L): required, finite and > 0 with a mode that needs it (``constant``);
  an error with any other mode.
* ``calculate_per_token_loss`` (legacy Megatron flag): with ``mode`` unset, ``true`` means
  the mode of Megatron's per-token loss (the registry's ``per_token`` alias); with that mode
  it is consistent; with another mode set explicitly it is an error. The resolved config has
  it true exactly under that mode.
* ``n_samples_per_prompt >= 1`` or unset (groups of any size); under a mode with prompt
  groups a ``global_batch_size`` must be a multiple of it.
* ``empty_samples``: how samples with no rollout token count, one of
  :data:`lossagg.totals.EMPTY_SAMPLES` (``count``, the default: in ``N`` and ``P`` like any
  other; ``skip``: nowhere, as NeMo-RL and AReaL count them). Valid with every mode.
* ``terms``: the other terms of the step's loss (an entropy bonus, a KL penalty, an NLL term),
  by name: each a :class:`LossTerm` with its own reducer (a registered mode; unset, the
  default reducer :func:`default_term_mode`: the metrics' reducer, or the per-token mode when
  the step itself is token-level) and its coefficient. ``J = Σ_k c_k J_k`` with the PG term (the
  config's own ``mode``, coefficient 1) named ``pg`` (docs/terms.md). A term's ``divisor`` is
  required with a mode that needs one, an error with any other.
* Unknown keys are errors ("did you mean"); every error is reported at once, with its
  field path (and the file's name when loaded from a file); nothing is half-applied.

How the input was resolved is never hidden: ``config.resolution_notes`` lists every
rewrite (a migration name, the legacy flag), and ``lossagg check`` prints it.

Importing this module adds the config's check of new modes to the registry
(:func:`lossagg.modes.add_registration_check`): a mode's ``example_settings`` must make a
valid config.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from lossagg.config.errors import ConfigError, issues_from_validation
from lossagg.config.files import read_file, select_section
from lossagg.denom_program import DenomProduct
from lossagg.messages import short_repr
from lossagg.modes import ALIASES, DEFAULT_MODE, MODES, ModeSpec, add_registration_check, canonical_mode, default_term_mode, mode_spec
from lossagg.totals import DEFAULT_EMPTY_SAMPLES, EMPTY_SAMPLES

# The mode the legacy flag calculate_per_token_loss means: Megatron's per-token loss, as the registry maps it.
_PER_TOKEN_MODE = ALIASES["per_token"].mode
# Sample counts travel in float64 between ranks: exact up to 2**53.
MAX_COUNT = 2**53
#: How a term uses the samples' weights w_i (docs/terms.md, "Per-sample weights"): not at all; as
#: factors of the numerators (J = Σ_i w_i S_i / d[i]); or also in the mean's sample count, N
#: replaced by Σ w_i ("mean") or Σ |w_i| ("abs_mean").
WEIGHTINGS = ("none", "multiply", "mean", "abs_mean")
Weighting = Literal[WEIGHTINGS]  # type: ignore[valid-type]
#: The conventions for empty samples, as the step totals declare them (lossagg/totals.py).
EmptySamples = Literal[tuple(EMPTY_SAMPLES)]  # type: ignore[valid-type]


def _registered_mode(value: Any) -> str:
    if isinstance(value, str) and value in MODES:
        return value
    raise PydanticCustomError("unknown_mode", "unknown mode {mode}", {"mode": short_repr(value)})


class _ModeJsonSchema:
    """The JSON Schema of ``mode``: the modes registered when the schema is generated."""

    def __get_pydantic_json_schema__(self, core_schema, handler) -> dict[str, Any]:
        modes = MODES.snapshot()  # one view of the registry, while other threads may register
        return {
            "type": "string",
            "enum": list(modes),
            "title": "Mode",
            "description": "; ".join(f"{m.name}: {m.summary}" for m in modes.values()),
        }


#: A registered mode's name (validated against the registry at validation time).
ModeName = Annotated[str, PlainValidator(_registered_mode), _ModeJsonSchema()]


#: The name of the PG term (the config's own ``mode``) among a step's terms.
PG_TERM = "pg"
_TERM_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


def _int_as_float(value: Any) -> Any:
    """An integer coefficient (1, -2) as the float it means; anything else as given (a bool or a
    string is refused by the strict float)."""
    return float(value) if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_COUNT else value


class LossTerm(BaseModel):
    """One term of the step's loss besides the PG term: ``coefficient × J_k`` with ``J_k`` this
    term's per-token values reduced by its own ``mode``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: ModeName | None = Field(None, description="The term's reducer, a registered mode; unset: the default reducer (docs/terms.md).")
    coefficient: Annotated[StrictFloat, BeforeValidator(_int_as_float)] = Field(
        1.0, allow_inf_nan=False, description="The term's weight in J (finite; negative for a bonus such as entropy)."
    )
    divisor: StrictFloat | None = Field(None, gt=0, allow_inf_nan=False, description="The term's constant divisor L, with a mode that needs one.")
    weighting: Weighting = Field("none", description="How the term uses the samples' weights (docs/terms.md, 'Per-sample weights').")


@dataclass(frozen=True)
class ResolvedTerm:
    """One term of the step's loss as the config resolved it (``config.loss_terms``): its name (``"pg"``
    for the PG term), its reducer's entry as the term's weighting makes it (:meth:`ModeSpec.weighted`),
    its coefficient, its divisor (``L``, for a mode that takes one) and its weighting."""

    name: str
    spec: ModeSpec
    coefficient: float
    divisor: float | None
    weighting: str

    @property
    def mode(self) -> str:
        """The term's reducer, as the config names it (``spec.name``)."""
        return self.spec.name

    @property
    def what(self) -> str:
        """How an error names the term: ``mode=X`` for the PG term, ``term 'kl' (mode=X)`` for another."""
        return f"mode={self.mode}" if self.name == PG_TERM else f"term {self.name!r} (mode={self.mode})"


def _canonical_mode_name(data: Any) -> tuple[Any, str | None]:
    """``data`` with an alias or another spelling of ``mode`` replaced by the mode's name (and
    the alias used, if any), plus the settings the alias implies; refused names raise."""
    if not isinstance(data, Mapping) or not isinstance(data.get("mode"), str):
        return data, None
    try:
        mode, alias = canonical_mode(data["mode"], data)
    except ValueError as exc:
        raise PydanticCustomError("refused_mode", "{message}", {"message": str(exc)}) from None
    if alias is None:
        return (dict(data, mode=mode) if mode != data["mode"] else data), None
    implied = {k: v for k, v in ALIASES[alias].implies.items() if k not in data}
    return dict(data, mode=mode, **implied), alias


class LossAggregationConfig(BaseModel):
    """How per-token policy-gradient losses are reduced to the step scalar J (docs/modes.md; its rules: docs/config.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    mode: ModeName = DEFAULT_MODE
    divisor: StrictFloat | None = Field(
        None, gt=0, allow_inf_nan=False, description="The constant divisor L of mode=constant (finite, > 0); an error with other modes."
    )
    calculate_per_token_loss: StrictBool | None = Field(None, description=f"Legacy Megatron flag; true means {_PER_TOKEN_MODE} when mode is unset.")
    n_samples_per_prompt: StrictInt | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description=(
            "Samples per prompt group (n); when given, every group of a step must hold exactly n samples "
            "(under a mode with sessions in prompt groups: n sessions)."
        ),
    )
    global_batch_size: StrictInt | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description=(
            "Samples per optimizer step; a multiple of n_samples_per_prompt under prompt_mean; with a process group, the default "
            "number of session labels under a mode with sessions."
        ),
    )
    empty_samples: EmptySamples = Field(
        DEFAULT_EMPTY_SAMPLES,
        description="How samples with no rollout token count: 'count' (in N and P like any other sample) or 'skip' (N and P count "
        "only samples, and groups, with at least one rollout token; NeMo-RL's and AReaL's convention). See docs/modes.md, 'Empty samples'.",
    )

    weighting: Weighting = Field(
        "none",
        description="How the PG term uses the samples' weights w_i (StepPlan's sample_weights): 'none', 'multiply' (J = Σ w_i S_i / d[i]), "
        "'mean' or 'abs_mean' (also N replaced by Σ w_i or Σ |w_i|). See docs/terms.md, 'Per-sample weights'.",
    )
    terms: dict[str, LossTerm] = Field(
        default_factory=dict,
        description="The loss's other terms by name (lower case, [a-z][a-z0-9_]*, not 'pg'), each with its reducer and coefficient (docs/terms.md).",
    )

    _notes: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _resolve(cls, data: Any, handler):
        data_keys = set(data) if isinstance(data, Mapping) else set()
        data, migrated = _canonical_mode_name(data)
        model = handler(data)
        notes: list[str] = []
        if migrated:
            notes.append(f"mode {migrated!r} ({ALIASES[migrated].origin}) resolved to {model.mode}")
            for key, value in ALIASES[migrated].implies.items():
                if getattr(model, key) == value and key not in data_keys:
                    notes.append(f"{key}={value} implied by mode {migrated!r}")
        mode = model.mode
        if model.calculate_per_token_loss is True and "mode" not in model.model_fields_set:
            mode = _PER_TOKEN_MODE
            notes.append(f"mode unset and calculate_per_token_loss=true: resolved to {_PER_TOKEN_MODE}")
        problems = _rule_problems(model, mode)
        if problems:
            raise PydanticCustomError(
                "loss_aggregation_rules", "{summary}", {"summary": "; ".join(f"{p}: {m}" for p, m, _ in problems), "problems": problems}
            )
        # The resolved settings are validated once more (into the same instance): the mode
        # the legacy flag chose, and the flag derived from the mode (true exactly under _PER_TOKEN_MODE).
        resolved = {name: getattr(model, name) for name in model.model_fields_set}
        resolved.update(mode=mode, calculate_per_token_loss=mode == _PER_TOKEN_MODE)
        if model.terms:  # every term's reducer named: a term that names none gets the default reducer, noted
            terms = {}
            for name, term in model.terms.items():
                if term.mode is None:
                    term = term.model_copy(update={"mode": default_term_mode(mode)})
                    notes.append(f"terms.{name}.mode unset: the default reducer under mode={mode}, {term.mode}")
                terms[name] = term
            resolved["terms"] = terms
        model = handler(resolved)
        model._notes = tuple(notes)
        return model

    # ----------------------------------------------------------------- accessors
    @property
    def resolution_notes(self) -> tuple[str, ...]:
        """How the user's input was rewritten (migration names, the legacy flag); empty if not at all."""
        return self._notes

    @property
    def loss_terms(self) -> tuple[ResolvedTerm, ...]:
        """Every term of the loss, resolved once (docs/terms.md): the PG term (``"pg"``: the config's
        own mode, weighting and divisor, coefficient 1) first, then each of ``terms`` in order, each
        with its reducer, coefficient, divisor and weighting. What the plans, the adapters and the
        reference iterate (made anew on each read: a plan reads it once)."""
        pg = ResolvedTerm(PG_TERM, mode_spec(self.mode).weighted(self.weighting), 1.0, self.divisor, self.weighting)
        return (
            pg,
            *(
                ResolvedTerm(name, mode_spec(t.mode).weighted(t.weighting), float(t.coefficient), t.divisor, t.weighting)
                for name, t in self.terms.items()
            ),
        )

    @property
    def metric_spec(self) -> ModeSpec:
        """The default reducer's entry (metrics, and a term that names no reducer): :func:`lossagg.modes.default_term_mode`."""
        return mode_spec(default_term_mode(self.mode))

    def check_single_term(self, where: str) -> None:
        """ValueError, naming ``where``, for a config with ``terms`` or a ``weighting`` in a route
        that reduces the PG term alone and unweighted: the config is never half-applied."""
        asks = []
        if self.terms:
            asks.append(f"the terms {', '.join(self.terms)} (StepPlan.loss reduces them, given a mapping of every term)")
        if self.weighting != "none":
            asks.append(f"weighting={self.weighting} (StepPlan's sample_weights)")
        if asks:
            raise ValueError(f"{where} reduces the PG term alone, unweighted, and the config asks for {' and '.join(asks)}; see docs/terms.md")

    def sample_indices(self) -> tuple[str, ...]:
        """The per-sample indices a plan of this config needs besides the masks: ``group_index``
        when a term's mode has prompt groups, ``session_index`` when one has sessions (docs/modes.md)."""
        specs = [t.spec for t in self.loss_terms]
        return tuple(
            name
            for name, needed in (("group_index", any(s.needs_groups for s in specs)), ("session_index", any(s.needs_sessions for s in specs)))
            if needed
        )

    def summary(self) -> dict[str, Any]:
        out = self.model_dump(mode="json")
        out["resolution_notes"] = list(self._notes)
        return out

    # ------------------------------------------------------------------ loaders
    @classmethod
    def coerce(cls, config: Any, what: str = "config") -> LossAggregationConfig:
        """``config`` as a config: itself, or validated from a mapping of its settings (what every
        plan takes); a mode name alone is refused with the two ways to say it."""
        if isinstance(config, str):
            raise TypeError(
                f"{what} must be a LossAggregationConfig (or a mapping of its settings), got the string {config!r}: "
                f"pass LossAggregationConfig(mode={config!r}) or {{'mode': {config!r}}}"
            )
        if isinstance(config, Mapping):
            return cls.from_dict(config)
        if not isinstance(config, cls):
            raise TypeError(f"{what} must be a LossAggregationConfig (or a mapping of its settings), got {type(config).__name__}")
        return config

    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None) -> LossAggregationConfig:
        """Validate a mapping; raises :class:`ConfigError` listing every problem."""
        if not isinstance(data, Mapping):
            raise ConfigError([("", f"expected a mapping of settings, got {type(data).__name__}")], source)
        odd_keys = [k for k in data if not isinstance(k, str)]
        if odd_keys:
            raise ConfigError([(short_repr(k), f"setting names must be strings, got {short_repr(k)} ({type(k).__name__})") for k in odd_keys], source)
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            found = _issues(exc)
        # Field errors stop pydantic before the cross-field rules; run those rules on the
        # settings that are valid so that every error is reported at once.
        bad = {path.split(".")[0] for path, _ in found}
        valid_part = {k: v for k, v in data.items() if k not in bad}
        if bad and valid_part != dict(data):
            try:
                cls.model_validate(valid_part)
            except ValidationError as exc:
                found += [(p, m) for p, m in _issues(exc, invalid=bad) if p.split(".")[0] not in bad]
        raise ConfigError(found, source)

    @classmethod
    def from_file(cls, path: str | os.PathLike, section: str | None = None) -> LossAggregationConfig:
        """Load from a JSON, YAML or TOML file, optionally one (dotted) section of it.

        Without ``section`` a top-level ``loss_aggregation`` mapping is used when the file
        has one; otherwise the whole file is the config.
        """
        path = os.fspath(path)
        data, where = select_section(read_file(path), path, section)
        return cls.from_dict(data, source=where)


def _rule_problems(model: LossAggregationConfig, mode) -> list[tuple[str, str, tuple[str, ...]]]:
    """The cross-field rules, on validated fields and the resolved mode: (path, message, the settings it depends on)."""
    problems: list[tuple[str, str, tuple[str, ...]]] = []
    spec = mode_spec(mode)  # ValueError (a validation error) if another thread unregistered it meanwhile
    flag = model.calculate_per_token_loss
    # what the resolved mode depends on: the flag too only when no mode was given
    by = ("mode",) if "mode" in model.model_fields_set else ("mode", "calculate_per_token_loss")
    if flag is True and mode != _PER_TOKEN_MODE:
        problems.append(
            (
                "calculate_per_token_loss",
                f"calculate_per_token_loss=true contradicts mode={mode} (it means {_PER_TOKEN_MODE}); drop the flag or set mode={_PER_TOKEN_MODE}",
                ("mode", "calculate_per_token_loss"),
            )
        )
    elif flag is False and "calculate_per_token_loss" in model.model_fields_set and mode == _PER_TOKEN_MODE:
        problems.append(
            (
                "calculate_per_token_loss",
                f"calculate_per_token_loss=false contradicts mode={_PER_TOKEN_MODE}; drop the flag",
                ("mode", "calculate_per_token_loss"),
            )
        )
    if spec.needs_divisor and model.divisor is None:
        problems.append(("divisor", f"mode={mode} needs divisor (L, a finite number > 0)", (*by, "divisor")))
    elif not spec.needs_divisor and model.divisor is not None:
        problems.append(
            (
                "divisor",
                f"divisor is only used with mode={', '.join(m.name for m in MODES.values() if m.needs_divisor)}, got it with mode={mode}",
                (*by, "divisor"),
            )
        )
    problems += _weighting_problems("weighting", model.weighting, spec, (*by, "weighting"))
    n = model.n_samples_per_prompt
    for name, term in model.terms.items():
        problems += _term_problems(name, term, mode, model)
    problems += _group_size_problems(model)
    if _whole_groups_of_samples(spec) and model.global_batch_size is not None and n is not None and model.global_batch_size % n != 0:
        problems.append(
            (
                "global_batch_size",
                f"under {mode} global_batch_size ({model.global_batch_size}) must be a multiple of "
                f"n_samples_per_prompt ({model.n_samples_per_prompt}) so that prompt groups stay whole",
                (*by, "global_batch_size", "n_samples_per_prompt"),
            )
        )
    return problems


def _sessions_in_groups(spec: ModeSpec) -> bool:
    """Whether the mode holds sessions inside prompt groups: its ``n_samples_per_prompt`` counts a group's
    sessions (docs/modes.md, "Sessions"), and a group holds any number of samples."""
    return "group_sessions" in spec.totals


def _whole_groups_of_samples(spec: ModeSpec) -> bool:
    return spec.needs_groups and not _sessions_in_groups(spec)


def _group_size_problems(model: LossAggregationConfig) -> list[tuple[str, str, tuple[str, ...]]]:
    """``n_samples_per_prompt`` means one thing for the whole config: samples per group, or sessions per group."""
    if model.n_samples_per_prompt is None:
        return []
    modes = [model.mode, *(t.mode or default_term_mode(model.mode) for t in model.terms.values())]  # (rules run before terms are resolved)
    samples = next((m for m in modes if _whole_groups_of_samples(mode_spec(m))), None)
    sessions = next((m for m in modes if _sessions_in_groups(mode_spec(m))), None)
    if samples is None or sessions is None:
        return []
    return [
        (
            "n_samples_per_prompt",
            f"n_samples_per_prompt counts the samples of a prompt group under mode={samples} and its sessions under mode={sessions}: "
            "give the terms modes that agree on what a group holds, or leave n_samples_per_prompt unset",
            ("mode", "terms", "n_samples_per_prompt"),
        )
    ]


def _weighting_problems(at: str, weighting: str, spec: ModeSpec, depends: tuple[str, ...]) -> list[tuple[str, str, tuple[str, ...]]]:
    """A weighted mean replaces the mode's sample count N: the mode's d[i] must be a DenomProduct with N."""
    if weighting not in ("mean", "abs_mean"):
        return []
    if isinstance(spec.denoms, DenomProduct) and "N" in spec.denoms.factors:
        return []
    made_of = f"d[i] = {spec.denom_formula} has no sample count N" if isinstance(spec.denoms, DenomProduct) else "its d[i] is a function"
    return [(at, f"weighting={weighting} replaces the sample count N of the mode's d[i], and mode={spec.name}'s {made_of}; use multiply", depends)]


def _term_problems(name: str, term: LossTerm, mode: str, model: LossAggregationConfig) -> list[tuple[str, str, tuple[str, ...]]]:
    """The rules of one term, on its validated fields: its name, its divisor, its groups."""
    at = f"terms.{name}"
    if not _TERM_NAME.fullmatch(name):
        why = "a term's name must be lower case letters, digits and '_' (starting with a letter, <= 64 characters)"
        return [(at, f"{why}, got {name!r}", ("terms",))]
    if name == PG_TERM:
        return [(at, f"the term name {PG_TERM!r} is the PG term (the config's own mode); give this term another name", ("terms",))]
    term_mode = term.mode if term.mode is not None else default_term_mode(mode)
    spec = mode_spec(term_mode)
    problems = _weighting_problems(f"{at}.weighting", term.weighting, spec, ("terms",))
    if spec.needs_divisor and term.divisor is None:
        problems.append((f"{at}.divisor", f"the term's mode={term_mode} needs divisor (L, a finite number > 0)", ("terms",)))
    elif not spec.needs_divisor and term.divisor is not None:
        problems.append((f"{at}.divisor", f"divisor is only used with a mode that divides by L, got it with the term's mode={term_mode}", ("terms",)))
    n = model.n_samples_per_prompt
    if _whole_groups_of_samples(spec) and model.global_batch_size is not None and n is not None and model.global_batch_size % n != 0:
        problems.append(
            (
                f"{at}.mode",
                f"under the term's mode={term_mode} global_batch_size ({model.global_batch_size}) must be a multiple of "
                f"n_samples_per_prompt ({n}) so that prompt groups stay whole",
                ("terms", "global_batch_size", "n_samples_per_prompt"),
            )
        )
    return problems


def _issues(exc: ValidationError, invalid=()) -> list[tuple[str, str]]:
    return issues_from_validation(
        exc,
        fields=LossAggregationConfig.model_fields,
        modes=tuple(MODES),
        migration_names=tuple(ALIASES),
        invalid=invalid,
        term_fields=LossTerm.model_fields,
    )


def _check_example_settings(spec: ModeSpec) -> None:
    """A new mode's ``example_settings`` make a valid config (run by :func:`lossagg.modes.register_mode`)."""
    try:
        LossAggregationConfig.from_dict({"mode": spec.name, **spec.example_settings})
    except Exception as exc:
        raise ValueError(f"ModeSpec.example_settings of mode {spec.name!r} do not make a valid config: {exc}") from None


add_registration_check(_check_example_settings)
