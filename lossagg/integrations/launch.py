"""The launch flags of the seed's two trainers, miles and slime (docs/integration.md).

Both parse their launch with a ``parse_args(add_custom_arguments=...)`` that derives
``global_batch_size`` (from ``--num-steps-per-rollout``) and owns ``--calculate-per-token-loss``,
``--n-samples-per-prompt`` and ``--global-batch-size``; lossagg adds its own flags beside them
and reads the derived settings back. :mod:`lossagg.integrations.miles` and
:mod:`lossagg.integrations.slime` wire the hooks; this module holds what their launches share:
the flags, the config they make and the checks that read only the settings.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lossagg.config import ConfigError, LossAggregationConfig, config_from_args
from lossagg.config.flags import FLAGS
from lossagg.modes import MODES

#: lossagg's own flag beside ``lossagg.config.FLAGS``.
CONFIG_FLAG = "--loss-aggregation-config"
#: The term flag (``NAME:COEFFICIENT[:MODE[:DIVISOR]]``, docs/terms.md).
TERM_FLAG = "--loss-aggregation-term"
#: The flags that switch lossagg on (any one of them given), without the term flag.
SWITCHES = ("--loss-aggregation", "--loss-aggregation-divisor", "--loss-aggregation-empty-samples", CONFIG_FLAG)
#: The trainers' own flags that a config setting also has.
TRAINER_FLAGS = {
    "calculate_per_token_loss": "--calculate-per-token-loss",
    "n_samples_per_prompt": "--n-samples-per-prompt",
    "global_batch_size": "--global-batch-size",
}


def dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def flag_given(args, flag: str) -> bool:
    return getattr(args, dest(flag), None) is not None


def add_arguments(parser: argparse.ArgumentParser, trainer: str, flags: Sequence[str]) -> argparse.ArgumentParser:
    """lossagg's ``flags`` (of :data:`SWITCHES` and :data:`TERM_FLAG`) on ``parser``, skipping any it
    already defines. The trainer adds a launcher's flags before its own, so the flags it defines
    (:data:`TRAINER_FLAGS`) are left to it."""
    existing = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public accessor
    group = parser.add_argument_group("loss aggregation (lossagg)")
    for f in FLAGS:
        if f.flag in flags and f.flag not in existing:
            kwargs = dict(f.kwargs)
            if f.setting == "mode":
                kwargs["help"] = f"{', '.join(MODES)} (default: {trainer}'s own reducer; docs/modes.md); or a migration name, docs/config.md"
            group.add_argument(f.flag, dest=f.dest, **kwargs)
    if CONFIG_FLAG in flags and CONFIG_FLAG not in existing:
        group.add_argument(
            CONFIG_FLAG,
            dest=dest(CONFIG_FLAG),
            default=None,
            metavar="FILE",
            help="a lossagg config file (JSON, YAML or TOML; docs/config.md) in place of the --loss-aggregation* flags",
        )
    return parser


def lossagg_given(args, flags: Sequence[str]) -> bool:
    """Whether any of lossagg's ``flags`` was given on the launch."""
    return any(flag_given(args, f) for f in flags)


def check_before_trainer(argv: list[str], flags: Sequence[str]) -> None:
    """What the trainer's own parse_args would trip over before lossagg sees it, on a launch with a
    lossagg flag: ``--n-samples-per-prompt`` < 1 (the trainer derives ``global_batch_size`` from it, and
    Megatron asserts that it is > 0)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--n-samples-per-prompt", type=int, default=None)
    add_arguments(pre, "", flags)
    try:
        known, _ = pre.parse_known_args(argv)
    except SystemExit:  # a malformed value: the trainer's parser reports it
        return
    if not lossagg_given(known, flags):
        return
    n = known.n_samples_per_prompt
    if n is not None and n < 1:
        raise ConfigError([("--n-samples-per-prompt", f"samples per prompt group must be >= 1, got {n}")], "command line")


def derived_note(args, trainer: str) -> str:
    steps = getattr(args, "num_steps_per_rollout", None)
    if steps is None:
        return ""
    return (
        f" ({trainer} derived --global-batch-size {args.global_batch_size} = --rollout-batch-size {args.rollout_batch_size} × "
        f"--n-samples-per-prompt {args.n_samples_per_prompt} // --num-steps-per-rollout {steps})"
    )


def config_of(args, trainer: str, flags: Sequence[str]) -> LossAggregationConfig | None:
    """The lossagg config of a parsed launch, or None when none of lossagg's ``flags`` was given.

    The settings come from the flags, or from the file of :data:`CONFIG_FLAG` with the trainer's
    derived ``n_samples_per_prompt``, ``global_batch_size`` and ``--calculate-per-token-loss``;
    raises :class:`lossagg.ConfigError` naming the flags.
    """
    if not lossagg_given(args, flags):
        return None
    issues: list[tuple[str, str]] = []
    n = getattr(args, "n_samples_per_prompt", None)
    gbs = getattr(args, "global_batch_size", None)
    per_token = getattr(args, "calculate_per_token_loss", False)
    if flag_given(args, CONFIG_FLAG):
        given = [f for f in flags if f != CONFIG_FLAG and flag_given(args, f)]
        if given:
            raise ConfigError(
                [
                    (
                        CONFIG_FLAG,
                        f"{CONFIG_FLAG} {getattr(args, dest(CONFIG_FLAG))} and {', '.join(given)} both given: put every setting in one place",
                    )
                ],
                "command line",
            )
        path = getattr(args, dest(CONFIG_FLAG))
        file_config = LossAggregationConfig.from_file(path)
        data = {k: getattr(file_config, k) for k in file_config.model_fields_set}
        for setting, flag, value in (
            ("n_samples_per_prompt", "--n-samples-per-prompt", n),
            ("global_batch_size", "--global-batch-size", gbs),
        ):
            if setting in data and value is not None and data[setting] != value:
                issues.append((flag, f"{path} sets {setting}: {data[setting]}, the launch has {flag} {value} (after {trainer} derived it)"))
        if issues:
            raise ConfigError(issues, "command line")
        data.update(n_samples_per_prompt=n, global_batch_size=gbs)
        if per_token:
            data["calculate_per_token_loss"] = True
        if "terms" in data:  # as the file spells them (the model's TermConfig back to its settings)
            data["terms"] = {name: term.model_dump(exclude_unset=True) for name, term in file_config.terms.items()}
        try:
            return LossAggregationConfig.from_dict({k: v for k, v in data.items() if v is not None}, source=f"{path} with the launch's flags")
        except ConfigError as exc:
            raise ConfigError([(TRAINER_FLAGS.get(p, p), m) for p, m in exc.issues], exc.source) from None
    try:
        return config_from_args(args)
    except ConfigError as exc:
        raise ConfigError([(p, m + derived_note(args, trainer) if p == "--global-batch-size" else m) for p, m in exc.issues], exc.source) from None


__all__ = [
    "CONFIG_FLAG",
    "SWITCHES",
    "TERM_FLAG",
    "TRAINER_FLAGS",
    "add_arguments",
    "check_before_trainer",
    "config_of",
    "derived_note",
    "dest",
    "flag_given",
    "lossagg_given",
]
