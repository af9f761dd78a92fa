"""argparse flags spelled as Megatron-based trainers spell them. :data:`FLAGS` is the one
table: the flags added to a parser, the flag-to-field mapping of :func:`config_from_args`
and the field-to-flag mapping of its error messages all come from it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from lossagg.config.errors import ConfigError
from lossagg.config.model import LossAggregationConfig
from lossagg.modes import MODES


@dataclass(frozen=True)
class Flag:
    flag: str  # as typed on the command line
    setting: str  # the LossAggregationConfig field it sets
    kwargs: dict[str, Any] = field(default_factory=dict)  # for argparse.add_argument
    to_setting: Any = None  # the parsed value to the setting's (a ValueError names what is wrong); None: as parsed

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def terms_from_flags(values: list[str]) -> dict[str, dict[str, Any]]:
    """``--loss-aggregation-term NAME:COEFFICIENT[:MODE[:DIVISOR]]``, given once per term, as the
    ``terms`` setting; the config then checks each term as it checks a file's."""
    terms: dict[str, dict[str, Any]] = {}
    for value in values:
        parts = value.split(":")
        if not 2 <= len(parts) <= 4 or not parts[0]:
            raise ValueError(f"expected NAME:COEFFICIENT[:MODE[:DIVISOR]], e.g. entropy:-0.01 or kl:0.05:token_mean, got {value!r}")
        name, number = parts[0], parts[1]
        if name in terms:
            raise ValueError(f"term {name!r} is given twice")
        try:
            term: dict[str, Any] = {"coefficient": float(number)}
        except ValueError:
            raise ValueError(f"the coefficient of term {name!r} must be a number, got {number!r}") from None
        if len(parts) >= 3 and parts[2]:
            term["mode"] = parts[2]
        if len(parts) == 4:
            try:
                term["divisor"] = float(parts[3])
            except ValueError:
                raise ValueError(f"the divisor of term {name!r} must be a number, got {parts[3]!r}") from None
        terms[name] = term
    return terms


FLAGS: tuple[Flag, ...] = (
    Flag(
        "--loss-aggregation",
        "mode",
        dict(
            type=str,
            default=None,
            metavar="MODE",
            help="a registered mode (see docs/modes.md) or a migration name (docs/config.md)",
        ),
    ),
    Flag(
        "--loss-aggregation-divisor",
        "divisor",
        dict(type=float, default=None, metavar="L", help="constant divisor L for --loss-aggregation constant"),
    ),
    Flag(
        "--calculate-per-token-loss",
        "calculate_per_token_loss",
        dict(action="store_true", default=None, help="legacy flag: means --loss-aggregation token_mean when no mode is given"),
    ),
    Flag(
        "--n-samples-per-prompt",
        "n_samples_per_prompt",
        dict(type=int, default=None, help="samples per prompt group (its sessions under a prompt_session_ mode)"),
    ),
    Flag("--global-batch-size", "global_batch_size", dict(type=int, default=None, help="samples per optimizer step")),
    Flag(
        "--loss-aggregation-empty-samples",
        "empty_samples",
        dict(
            type=str,
            default=None,
            metavar="{count,skip}",
            help="how samples with no loss token count in N and P: count (default) or skip (docs/modes.md, 'Empty samples')",
        ),
    ),
    Flag(
        "--loss-aggregation-term",
        "terms",
        dict(
            action="append",
            default=None,
            metavar="NAME:COEF[:MODE[:L]]",
            help="another term of the loss with its coefficient and reducer (default: the default reducer), once per term (docs/terms.md)",
        ),
        to_setting=terms_from_flags,
    ),
)


def add_loss_aggregation_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the loss aggregation flags to ``parser``, skipping any flag it already defines."""
    existing = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public accessor
    group = parser.add_argument_group("loss aggregation (lossagg)")
    for f in FLAGS:
        if f.flag not in existing:
            kwargs = dict(f.kwargs)
            if f.setting == "mode":  # the modes registered now
                kwargs["help"] = f"{', '.join(MODES)} (default {next(iter(MODES))}); or a migration name, see docs/config.md"
            group.add_argument(f.flag, dest=f.dest, **kwargs)
    return parser


def config_from_args(args: argparse.Namespace) -> LossAggregationConfig:
    """Build the config from parsed flags, with the same rules and messages as files.

    A flag left at its default counts as not given (so ``--calculate-per-token-loss``
    alone resolves to token_mean); errors name the flag.
    """
    # a flag not given is None (or False for a switch); 0 is a value (0 == False, so `is`)
    data = {f.setting: v for f in FLAGS if (v := getattr(args, f.dest, None)) is not None and v is not False}
    for f in FLAGS:
        if f.to_setting is not None and f.setting in data:
            try:
                data[f.setting] = f.to_setting(data[f.setting])
            except ValueError as exc:
                raise ConfigError([(f.flag, str(exc))], "command line") from None
    try:
        return LossAggregationConfig.from_dict(data, source="command line")
    except ConfigError as exc:
        flag_of = {f.setting: f.flag for f in FLAGS}
        # a term's setting keeps its path after the flag: "--loss-aggregation-term kl.divisor"
        named = [
            (flag_of[p.split(".")[0]] + p[len(p.split(".")[0]) :].replace(".", " ", 1) if p.split(".")[0] in flag_of else p, m) for p, m in exc.issues
        ]
        raise ConfigError(named, "command line") from None
