"""``LossAggregationConfig``: the pydantic model and its rules (SPEC §6).

* ``mode``: one of :data:`lossagg.modes.MODE_NAMES` (default ``sample_mean``); other
  trainers' names for the same maths are accepted and mapped (:data:`MIGRATION_NAMES`),
  names whose maths differ are refused with the reason (:data:`REFUSED_NAMES`).
* ``divisor`` (L): required, finite and > 0 with a mode that needs it (``constant``);
  an error with any other mode.
* ``calculate_per_token_loss`` (legacy Megatron flag): with ``mode`` unset, ``true`` means
  ``token_mean``; with ``token_mean`` it is consistent; with another mode set explicitly it
  is an error. The resolved config has it true exactly under ``token_mean``.
* ``n_samples_per_prompt >= 1`` or unset (groups of any size); under a mode with prompt
  groups a ``global_batch_size`` must be a multiple of it.
* Unknown keys are errors ("did you mean"); every error is reported at once, with its
  field path (and the file's name when loaded from a file); nothing is half-applied.

How the input was resolved is never hidden: ``config.resolution_notes`` lists every
rewrite (a migration name, the legacy flag), and ``lossagg check`` prints it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from lossagg.config.errors import ConfigError, issues_from_validation, short_repr
from lossagg.config.files import read_file, select_section
from lossagg.modes import DEFAULT_MODE, MODE_NAMES, MODES


class _ModeEnum(str, Enum):
    def __str__(self) -> str:
        return self.value


#: The modes as an enum (members SAMPLE_MEAN, PROMPT_MEAN, ...), built from lossagg.modes.MODES.
AggregationMode = _ModeEnum("AggregationMode", {name.upper(): name for name in MODE_NAMES}, module=__name__)

# Other trainers' names for the same maths: name -> (mode, where it comes from).
MIGRATION_NAMES: dict[str, tuple[str, str]] = {
    "seq-mean-token-mean": ("sample_mean", "verl loss_agg_mode"),
    "token-mean": ("token_mean", "verl loss_agg_mode"),
    "seq-mean-token-sum-norm": ("constant", "verl loss_agg_mode (Dr.GRPO; divisor = its loss_scale_factor)"),
    "grpo": ("sample_mean", "TRL GRPOConfig.loss_type"),
    "dapo": ("token_mean", "TRL GRPOConfig.loss_type (tokens of the whole accumulated batch)"),
    "dr_grpo": ("constant", "TRL GRPOConfig.loss_type (divisor = max_completion_length)"),
    "per_token": ("token_mean", "Megatron --calculate-per-token-loss"),
    "seq-mean-token-sum": ("constant", "verl loss_agg_mode: token sums over the global batch size, i.e. divisor 1"),
    "seq_mean": ("sample_mean", "AReaL loss_agg_mode"),
}
# Settings a migration name implies when the user gives none.
MIGRATION_DEFAULTS: dict[str, dict[str, Any]] = {"seq-mean-token-sum": {"divisor": 1.0}}

# Names whose maths is not one of ours: refused with the reason, never mapped.
REFUSED_NAMES: dict[str, str] = {
    "bnpo": (
        "TRL's 'bnpo' divides by the active tokens of each local micro-batch, so the loss changes with the "
        "micro-batch split; use mode=token_mean for the step-global token mean"
    ),
    "token-sum": (
        "verl's 'token-sum' adds every token of the step with no normalisation at all, so the loss scale grows with the batch "
        "and the response lengths; use mode=constant with a divisor for a fixed scale, or token_mean"
    ),
}

_TOKEN_MEAN = "token_mean"


def _canonical_mode_name(data: Any) -> tuple[Any, str | None]:
    """``data`` with a migration name or a hyphenated spelling of ``mode`` replaced by the
    canonical name (and the migration name used, if any); refused names raise."""
    if not isinstance(data, Mapping) or not isinstance(data.get("mode"), str):
        return data, None
    name = data["mode"].strip().lower()
    if name in REFUSED_NAMES:
        raise PydanticCustomError("refused_mode", "mode '{name}' is not supported: {reason}", {"name": data["mode"], "reason": REFUSED_NAMES[name]})
    if name in MIGRATION_NAMES:
        implied = {k: v for k, v in MIGRATION_DEFAULTS.get(name, {}).items() if k not in data}
        return dict(data, mode=MIGRATION_NAMES[name][0], **implied), name
    if name.replace("-", "_") in MODES:
        return dict(data, mode=name.replace("-", "_")), None
    return data, None


class LossAggregationConfig(BaseModel):
    """How per-token policy-gradient losses are reduced to the step scalar J (SPEC §3, §6)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    mode: AggregationMode = Field(
        AggregationMode(DEFAULT_MODE),
        description="; ".join(f"{m.name}: {m.summary}" for m in MODES.values()),
    )
    divisor: StrictFloat | None = Field(
        None, gt=0, allow_inf_nan=False, description="The constant divisor L of mode=constant (finite, > 0); an error with other modes."
    )
    calculate_per_token_loss: StrictBool | None = Field(None, description="Legacy Megatron flag; true means token_mean when mode is unset.")
    n_samples_per_prompt: StrictInt | None = Field(
        None, ge=1, description="Samples per prompt group (n); when given, every group of a step must hold exactly n samples."
    )
    global_batch_size: StrictInt | None = Field(
        None, ge=1, description="Samples per optimizer step; a multiple of n_samples_per_prompt under prompt_mean."
    )

    _notes: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _resolve(cls, data: Any, handler):
        data, migrated = _canonical_mode_name(data)
        model = handler(data)
        notes: list[str] = []
        if migrated:
            notes.append(f"mode {migrated!r} ({MIGRATION_NAMES[migrated][1]}) resolved to {model.mode.value}")
            for key, value in MIGRATION_DEFAULTS.get(migrated, {}).items():
                if getattr(model, key) == value:
                    notes.append(f"{key}={value} implied by mode {migrated!r}")
        mode = model.mode
        if model.calculate_per_token_loss is True and "mode" not in model.model_fields_set:
            mode = AggregationMode(_TOKEN_MEAN)
            notes.append("mode unset and calculate_per_token_loss=true: resolved to token_mean")
        problems = _rule_problems(model, mode)
        if problems:
            raise PydanticCustomError(
                "loss_aggregation_rules", "{summary}", {"summary": "; ".join(f"{p}: {m}" for p, m, _ in problems), "problems": problems}
            )
        # The resolved settings are validated once more (into the same instance): the mode
        # the legacy flag chose, and the flag derived from the mode (true exactly under token_mean).
        resolved = {name: getattr(model, name) for name in model.model_fields_set}
        resolved.update(mode=mode, calculate_per_token_loss=mode.value == _TOKEN_MEAN)
        model = handler(resolved)
        model._notes = tuple(notes)
        return model

    # ----------------------------------------------------------------- accessors
    @property
    def resolution_notes(self) -> tuple[str, ...]:
        """How the user's input was rewritten (migration names, the legacy flag); empty if not at all."""
        return self._notes

    def summary(self) -> dict[str, Any]:
        out = self.model_dump(mode="json")
        out["resolution_notes"] = list(self._notes)
        return out

    # ------------------------------------------------------------------ loaders
    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None) -> LossAggregationConfig:
        """Validate a mapping; raises :class:`ConfigError` listing every problem."""
        if not isinstance(data, Mapping):
            raise ConfigError([("", f"expected a mapping of settings, got {type(data).__name__}")], source)
        odd_keys = [k for k in data if not isinstance(k, str)]
        if odd_keys:
            raise ConfigError([("", f"setting names must be strings, got {short_repr(odd_keys[0])}")], source)
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
    spec = MODES[mode.value]
    flag = model.calculate_per_token_loss
    if flag is True and mode.value != _TOKEN_MEAN:
        problems.append(
            (
                "calculate_per_token_loss",
                f"calculate_per_token_loss=true contradicts mode={mode.value} (it means token_mean); drop the flag or set mode=token_mean",
                ("mode", "calculate_per_token_loss"),
            )
        )
    elif flag is False and "calculate_per_token_loss" in model.model_fields_set and mode.value == _TOKEN_MEAN:
        problems.append(
            (
                "calculate_per_token_loss",
                "calculate_per_token_loss=false contradicts mode=token_mean; drop the flag",
                ("mode", "calculate_per_token_loss"),
            )
        )
    if spec.needs_divisor and model.divisor is None:
        problems.append(("divisor", f"mode={mode.value} needs divisor (L, a finite number > 0)", ("mode", "calculate_per_token_loss", "divisor")))
    elif not spec.needs_divisor and model.divisor is not None:
        problems.append(
            (
                "divisor",
                f"divisor is only used with mode={', '.join(m.name for m in MODES.values() if m.needs_divisor)}, got it with mode={mode.value}",
                ("mode", "calculate_per_token_loss", "divisor"),
            )
        )
    n = model.n_samples_per_prompt
    if spec.needs_groups and model.global_batch_size is not None and n is not None and model.global_batch_size % n != 0:
        problems.append(
            (
                "global_batch_size",
                f"under {mode.value} global_batch_size ({model.global_batch_size}) must be a multiple of "
                f"n_samples_per_prompt ({model.n_samples_per_prompt}) so that prompt groups stay whole",
                ("mode", "calculate_per_token_loss", "global_batch_size", "n_samples_per_prompt"),
            )
        )
    return problems


def _issues(exc: ValidationError, invalid=()) -> list[tuple[str, str]]:
    return issues_from_validation(exc, fields=LossAggregationConfig.model_fields, modes=MODE_NAMES, migration_names=MIGRATION_NAMES, invalid=invalid)
