"""``LossAggregationConfig``: the pydantic front end (SPEC §6).

Rules:

* ``mode``: ``sample_mean`` (default), ``prompt_mean``, ``token_mean`` or ``constant``;
  other trainers' names for the same maths are accepted and mapped (``MIGRATION_NAMES``),
  names whose maths differ are refused with the reason (``REFUSED_NAMES``).
* ``divisor`` (L): required, finite and > 0 with ``constant``; an error with any other mode.
* ``calculate_per_token_loss`` (legacy Megatron flag): with ``mode`` unset, ``true`` means
  ``token_mean``; with ``token_mean`` it is consistent; with another mode set explicitly it
  is an error. The resolved config has it true exactly under ``token_mean``.
* ``n_samples_per_prompt >= 1``; under ``prompt_mean`` a ``global_batch_size`` must be a
  multiple of it.
* Unknown keys are errors ("did you mean"); every error is reported at once, with its
  field path (and the file's name when loaded from a file); nothing is half-applied.

How the input was resolved is never hidden: ``config.resolution_notes`` lists every
rewrite (a migration name, the legacy flag), and ``lossagg check`` prints it.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
from collections.abc import Mapping
from enum import Enum
from typing import Annotated, Any

import tomllib
import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError


class AggregationMode(str, Enum):
    SAMPLE_MEAN = "sample_mean"
    PROMPT_MEAN = "prompt_mean"
    TOKEN_MEAN = "token_mean"
    CONSTANT = "constant"

    def __str__(self) -> str:
        return self.value


# Other trainers' names for the same maths: name -> (mode, where it comes from).
MIGRATION_NAMES: dict[str, tuple[AggregationMode, str]] = {
    "seq-mean-token-mean": (AggregationMode.SAMPLE_MEAN, "verl loss_agg_mode"),
    "token-mean": (AggregationMode.TOKEN_MEAN, "verl loss_agg_mode"),
    "seq-mean-token-sum-norm": (
        AggregationMode.CONSTANT,
        "verl loss_agg_mode (Dr.GRPO; divisor = its loss_scale_factor)",
    ),
    "grpo": (AggregationMode.SAMPLE_MEAN, "TRL GRPOConfig.loss_type"),
    "dapo": (AggregationMode.TOKEN_MEAN, "TRL GRPOConfig.loss_type (tokens of the whole accumulated batch)"),
    "dr_grpo": (AggregationMode.CONSTANT, "TRL GRPOConfig.loss_type (divisor = max_completion_length)"),
    "per_token": (AggregationMode.TOKEN_MEAN, "Megatron --calculate-per-token-loss"),
}

# Names whose maths is not one of ours: refused with the reason, never mapped.
REFUSED_NAMES: dict[str, str] = {
    "bnpo": (
        "TRL's 'bnpo' divides by the active tokens of each local micro-batch, so the loss changes with the "
        "micro-batch split; use mode=token_mean for the step-global token mean"
    ),
    "seq-mean-token-sum": (
        "verl's 'seq-mean-token-sum' sums tokens per sequence with no divisor; write mode=constant with divisor=1 to get exactly that"
    ),
}


def _normalise_name(name: str) -> str:
    return name.strip().lower()


def _strict_number(value: Any) -> Any:
    """Numbers only: a quoted "1024" or a boolean in a file is an error, not a conversion."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PydanticCustomError("number_type", "expected a number, got {kind} {value}", {"kind": type(value).__name__, "value": repr(value)})
    return float(value)


class ConfigError(ValueError):
    """Every problem of a configuration at once: ``issues`` is a list of (path, message)."""

    def __init__(self, issues: list[tuple[str, str]], source: str | None = None):
        self.issues = issues
        self.source = source
        where = f"{source}: " if source else ""
        lines = [f"{where}{path}: {msg}" if path else f"{where}{msg}" for path, msg in issues]
        header = f"invalid loss aggregation config ({len(issues)} error{'s' if len(issues) != 1 else ''})"
        super().__init__(header + "\n  " + "\n  ".join(lines))


class LossAggregationConfig(BaseModel):
    """How per-token policy-gradient losses are reduced to the step scalar J (SPEC §3, §6)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    mode: AggregationMode = Field(
        AggregationMode.SAMPLE_MEAN,
        description="sample_mean (GRPO), prompt_mean (group-level DAPO), token_mean (DAPO) or constant (Dr.GRPO).",
    )
    divisor: Annotated[float, BeforeValidator(_strict_number)] | None = Field(
        None, description="The constant divisor L of mode=constant (finite, > 0); an error with other modes."
    )
    calculate_per_token_loss: StrictBool | None = Field(None, description="Legacy Megatron flag; true means token_mean when mode is unset.")
    n_samples_per_prompt: StrictInt = Field(1, ge=1, description="Samples per prompt group (n).")
    global_batch_size: StrictInt | None = Field(
        None, ge=1, description="Samples per optimizer step; a multiple of n_samples_per_prompt under prompt_mean."
    )

    _notes: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _resolve(cls, data: Any, handler):
        data, migrated = cls._map_mode_name(data)
        model = handler(data)
        problems: list[tuple[str, str]] = []
        notes: list[str] = []
        explicit_mode = "mode" in model.model_fields_set
        mode = model.mode
        if migrated:
            notes.append(f"mode {migrated!r} ({MIGRATION_NAMES[migrated][1]}) resolved to {mode.value}")

        flag = model.calculate_per_token_loss
        if flag is True and not explicit_mode:
            mode = AggregationMode.TOKEN_MEAN
            notes.append("mode unset and calculate_per_token_loss=true: resolved to token_mean")
        elif flag is True and mode is not AggregationMode.TOKEN_MEAN:
            problems.append(
                (
                    "calculate_per_token_loss",
                    f"calculate_per_token_loss=true contradicts mode={mode.value} (it means token_mean); drop the flag or set mode=token_mean",
                )
            )
        elif flag is False and "calculate_per_token_loss" in model.model_fields_set and mode is AggregationMode.TOKEN_MEAN:
            problems.append(
                (
                    "calculate_per_token_loss",
                    "calculate_per_token_loss=false contradicts mode=token_mean; drop the flag",
                )
            )

        divisor = model.divisor
        if mode is AggregationMode.CONSTANT:
            if divisor is None:
                problems.append(("divisor", "mode=constant needs divisor (L, a finite number > 0)"))
            elif not math.isfinite(divisor) or divisor <= 0:
                problems.append(("divisor", f"divisor must be finite and > 0, got {divisor!r}"))
        elif divisor is not None:
            problems.append(("divisor", f"divisor is only used with mode=constant, got it with mode={mode.value}"))

        if mode is AggregationMode.PROMPT_MEAN and model.global_batch_size is not None and model.global_batch_size % model.n_samples_per_prompt != 0:
            problems.append(
                (
                    "global_batch_size",
                    f"under prompt_mean global_batch_size ({model.global_batch_size}) must be a multiple of "
                    f"n_samples_per_prompt ({model.n_samples_per_prompt}) so that prompt groups stay whole",
                )
            )
        if problems:
            raise PydanticCustomError(
                "loss_aggregation_rules",
                "{summary}",
                {"summary": "; ".join(f"{p}: {m}" for p, m in problems), "problems": problems},
            )
        resolved_flag = mode is AggregationMode.TOKEN_MEAN
        object.__setattr__(model, "mode", mode)
        object.__setattr__(model, "calculate_per_token_loss", resolved_flag)
        object.__setattr__(model, "divisor", float(divisor) if divisor is not None else None)
        model._notes = tuple(notes)
        return model

    @staticmethod
    def _map_mode_name(data: Any) -> tuple[Any, str | None]:
        """Canonical mode for a migration name (refusing the names whose maths differ)."""
        if not isinstance(data, Mapping) or not isinstance(data.get("mode"), str):
            return data, None
        name = _normalise_name(data["mode"])
        if name in REFUSED_NAMES:
            raise PydanticCustomError(
                "refused_mode",
                "mode '{name}' is not supported: {reason}",
                {"name": data["mode"], "reason": REFUSED_NAMES[name]},
            )
        if name in MIGRATION_NAMES:
            return dict(data, mode=MIGRATION_NAMES[name][0].value), name
        if name.replace("-", "_") in {m.value for m in AggregationMode}:
            return dict(data, mode=name.replace("-", "_")), None
        return data, None

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
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            found = _issues_from(exc, data)
        # Field errors stop pydantic before the cross-field rules; run those rules on the
        # settings that are valid so that every error is reported at once.
        bad = {path.split(".")[0] for path, _ in found}
        valid_part = {k: v for k, v in data.items() if k not in bad}
        if bad and valid_part != dict(data):
            try:
                cls.model_validate(valid_part)
            except ValidationError as exc:
                found += [(p, m) for p, m in _issues_from(exc, valid_part) if p.split(".")[0] not in bad]
        raise ConfigError(found, source)

    @classmethod
    def from_file(cls, path: str | os.PathLike, section: str | None = None) -> LossAggregationConfig:
        """Load from a JSON, YAML or TOML file, optionally one (dotted) section of it.

        Without ``section`` a top-level ``loss_aggregation`` mapping is used when the file
        has one; otherwise the whole file is the config.
        """
        path = os.fspath(path)
        data = _read_file(path)
        where = path
        if section:
            for part in section.split("."):
                if not isinstance(data, Mapping) or part not in data:
                    keys = list(data) if isinstance(data, Mapping) else []
                    hint = _did_you_mean(part, keys)
                    raise ConfigError([(section, f"section not found{hint}")], path)
                data = data[part]
            where = f"{path} [{section}]"
        elif isinstance(data, Mapping) and isinstance(data.get("loss_aggregation"), Mapping):
            data = data["loss_aggregation"]
            where = f"{path} [loss_aggregation]"
        return cls.from_dict(data, source=where)


def _did_you_mean(name: str, candidates) -> str:
    close = difflib.get_close_matches(str(name), [str(c) for c in candidates], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _issues_from(exc: ValidationError, data: Mapping) -> list[tuple[str, str]]:
    fields = list(LossAggregationConfig.model_fields)
    issues: list[tuple[str, str]] = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        ctx = err.get("ctx") or {}
        if err["type"] == "loss_aggregation_rules":
            issues.extend((p, m) for p, m in ctx["problems"])
        elif err["type"] == "refused_mode":
            issues.append(("mode", err["msg"]))
        elif err["type"] == "extra_forbidden":
            issues.append((loc, f"unknown setting{_did_you_mean(err['loc'][-1], fields)}"))
        elif err["type"] == "enum" and err["loc"] == ("mode",):
            choices = [m.value for m in AggregationMode] + sorted(MIGRATION_NAMES)
            issues.append(
                (
                    "mode",
                    f"unknown mode {err['input']!r}{_did_you_mean(err['input'], choices)}; expected one of "
                    f"{', '.join(m.value for m in AggregationMode)} (or a migration name: {', '.join(sorted(MIGRATION_NAMES))})",
                )
            )
        elif err["type"] == "bool_type" and isinstance(err.get("input"), str):
            issues.append((loc, f"expected a boolean (true/false, unquoted), got the string {err['input']!r}"))
        else:
            issues.append((loc, f"{err['msg']}, got {err.get('input')!r}"))
    return issues


def _read_file(path: str) -> Any:
    if not os.path.exists(path):
        raise ConfigError([("", "file not found")], path)
    ext = os.path.splitext(path)[1].lower()
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.strip():
        raise ConfigError([("", "the file is empty; expected a mapping of loss aggregation settings")], path)
    try:
        if ext == ".json":
            data = json.loads(raw)
        elif ext in (".yaml", ".yml"):
            data = yaml.safe_load(raw)
        elif ext == ".toml":
            data = tomllib.loads(raw.decode("utf-8"))
        else:
            raise ConfigError([("", f"unknown file type {ext!r}; expected .json, .yaml, .yml or .toml")], path)
    except (json.JSONDecodeError, yaml.YAMLError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError([("", f"cannot parse the file: {exc}")], path) from None
    if not isinstance(data, Mapping):
        raise ConfigError([("", f"expected a mapping at the top of the file, got {type(data).__name__}")], path)
    return data


# ------------------------------------------------------------------------ argparse
# (flag, dest, argparse kwargs) as Megatron-based trainers spell them.
_FLAGS = [
    (
        "--loss-aggregation",
        "loss_aggregation",
        dict(
            type=str,
            default=None,
            metavar="MODE",
            help="sample_mean (default), prompt_mean, token_mean or constant (or a migration name, see docs/config.md)",
        ),
    ),
    (
        "--loss-aggregation-divisor",
        "loss_aggregation_divisor",
        dict(type=float, default=None, metavar="L", help="constant divisor L for --loss-aggregation constant"),
    ),
    (
        "--calculate-per-token-loss",
        "calculate_per_token_loss",
        dict(action="store_true", help="legacy flag: means --loss-aggregation token_mean when no mode is given"),
    ),
    ("--n-samples-per-prompt", "n_samples_per_prompt", dict(type=int, default=None, help="samples per prompt group")),
    ("--global-batch-size", "global_batch_size", dict(type=int, default=None, help="samples per optimizer step")),
]


def add_loss_aggregation_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the loss aggregation flags to ``parser``, skipping any flag it already defines."""
    existing = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public accessor
    group = parser.add_argument_group("loss aggregation (lossagg)")
    for flag, dest, kwargs in _FLAGS:
        if flag not in existing:
            group.add_argument(flag, dest=dest, **kwargs)
    return parser


def config_from_args(args: argparse.Namespace) -> LossAggregationConfig:
    """Build the config from parsed flags, with the same rules and messages as files.

    A flag left at its default counts as not given (so ``--calculate-per-token-loss``
    alone resolves to token_mean).
    """
    data: dict[str, Any] = {}
    mapping = {
        "loss_aggregation": "mode",
        "loss_aggregation_divisor": "divisor",
        "n_samples_per_prompt": "n_samples_per_prompt",
        "global_batch_size": "global_batch_size",
    }
    for dest, key in mapping.items():
        value = getattr(args, dest, None)
        if value is not None:
            data[key] = value
    if getattr(args, "calculate_per_token_loss", False):
        data["calculate_per_token_loss"] = True
    try:
        return LossAggregationConfig.from_dict(data, source="command line")
    except ConfigError as exc:
        flag_of = {
            "mode": "--loss-aggregation",
            "divisor": "--loss-aggregation-divisor",
            "calculate_per_token_loss": "--calculate-per-token-loss",
            "n_samples_per_prompt": "--n-samples-per-prompt",
            "global_batch_size": "--global-batch-size",
        }
        raise ConfigError([(flag_of.get(p, p), m) for p, m in exc.issues], "command line") from None
