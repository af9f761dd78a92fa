"""What the seed's two trainers, miles and slime, share in lossagg (docs/trainers/miles.md, docs/trainers/slime.md): the launch
flags, the checks of the config's terms against their policy loss, and the reducer their loss is
handed in place of ``sum_of_sample_mean``.

Both parse their launch with a ``parse_args(add_custom_arguments=...)`` that derives
``global_batch_size`` (from ``--num-steps-per-rollout``) and owns ``--calculate-per-token-loss``,
``--n-samples-per-prompt`` and ``--global-batch-size``; lossagg adds its own flags beside them
and reads the derived settings back. :mod:`lossagg.integrations.miles` and
:mod:`lossagg.integrations.slime` wire the hooks; this module holds what their launches share:
the flags, the config they make and the checks that read only the settings.

Both trainers' ``policy_loss_function`` reduce pg_loss (through ``--custom-pg-loss-reducer-function-path``
when set), then pg_clipfrac, ppo_kl, entropy (``-entropy_coef``) and KL (``+kl_loss_coef`` under
``--use-kl-loss``) and further metrics with the one reducer they are handed, in that order; under TIS or
mismatch metrics they rebuild that reducer inside from the modified masks. :class:`TermReducer` serves
each term on its own mode by that order (:data:`POLICY_LOSS_CALLS`), checked against what the function
reports; :func:`term_issues` refuses at launch what cannot be served.
"""

from __future__ import annotations

import argparse
import contextvars
import sys
from collections.abc import Callable, Sequence
from importlib import import_module

import torch

from lossagg.config import ConfigError, LossAggregationConfig, config_from_args
from lossagg.config.flags import FLAGS
from lossagg.deferred import DeferredPlan
from lossagg.modes import MODES, default_term_mode
from lossagg.step import StepPlan

#: lossagg's own flag beside ``lossagg.config.FLAGS``.
CONFIG_FLAG = "--loss-aggregation-config"
#: Under TIS/RS (miles): whether ``d[i]`` comes from the rollout masks (numerator only) or from the kept tokens.
DENOMS_FLAG = "--loss-aggregation-tis-denominators"
#: Its values: the rollout masks' (the seed's convention, the default) or the kept tokens' (a DeferredPlan).
DENOMS = ("rollout", "kept")
#: The term flag (``NAME:COEFFICIENT[:MODE[:DIVISOR]]``, docs/terms.md).
TERM_FLAG = "--loss-aggregation-term"
#: The flags that switch lossagg on (any one of them given), without the term flag.
SWITCHES = ("--loss-aggregation", "--loss-aggregation-divisor", "--loss-aggregation-empty-samples", CONFIG_FLAG)
#: The terms of the trainers' ``policy_loss_function`` by lossagg term name: the flags of their coefficients.
TERMS = {"entropy": "--entropy-coef", "kl": "--kl-loss-coef"}
#: The order in which the trainers' ``policy_loss_function`` (without TIS) calls the reducer it is handed:
#: the metrics pg_clipfrac and ppo_kl, entropy (slime: always; miles: when its coefficient is not 0), then
#: KL under --use-kl-loss; later calls are metrics.
POLICY_LOSS_CALLS = ("pg_clipfrac", "ppo_kl", "entropy", "kl")
#: What policy_loss_function reports each of those under.
REPORTED = {"pg_clipfrac": "pg_clipfrac", "ppo_kl": "ppo_kl", "entropy": "entropy_loss", "kl": "kl_loss"}
#: The default reducer's name among a :class:`TermReducer`'s tables (metrics, and terms the config does not name).
METRIC = "metric"
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
    if DENOMS_FLAG in flags and DENOMS_FLAG not in existing:
        group.add_argument(
            DENOMS_FLAG,
            dest=dest(DENOMS_FLAG),
            default=None,
            choices=DENOMS,
            help="under --use-tis / --get-mismatch-metrics: d[i] of the rollout masks (numerator only; the default) or of the kept "
            "tokens (numerator and denominators, as the trainer's own rebuilt reducer; the gradient rescaled after the step)",
        )
    return parser


def parse_launch(
    trainer_parse_args: Callable, add_custom_arguments: Callable | None, add_arguments: Callable, configure: Callable, flags: Sequence[str]
):
    """The trainer's ``parse_args`` with lossagg's flags (after the user's ``add_custom_arguments``), then
    ``configure``. A refused setting ends the launch as argparse does: ``error: ...`` on stderr, exit status 2."""

    def add(parser):
        if add_custom_arguments is not None:
            parser = add_custom_arguments(parser) or parser
        return add_arguments(parser)

    try:
        check_before_trainer(sys.argv[1:], flags)
        args = trainer_parse_args(add_custom_arguments=add)
        configure(args)
    except ConfigError as exc:
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(2) from None
    return args


#: The flags of a seed trainer's launch that switch lossagg on (any one of them given).
LAUNCH_FLAGS = (*SWITCHES, TERM_FLAG)


class Launch:
    """A seed trainer's launch (its ``parse_args(add_custom_arguments=...)`` in module ``parser_module``):
    lossagg's flags on its parser, its ``parse_args`` with them, and the config of a parsed launch."""

    def __init__(self, trainer: str, parser_module: str, extra: Sequence[str] = ()):
        self.trainer, self.parser_module = trainer, parser_module
        self.extra = tuple(extra)  # the adapter's own flags (:data:`DENOMS_FLAG`), read by its configure, not switches

    def add_arguments(self, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """lossagg's flags, for the trainer's ``parse_args(add_custom_arguments=...)`` (:func:`add_arguments`)."""
        return add_arguments(parser, self.trainer, (*LAUNCH_FLAGS, *self.extra))

    def config_of(self, args) -> LossAggregationConfig | None:
        """The lossagg config of a parsed launch (None without a lossagg flag): the checks that read only the
        settings; :class:`lossagg.ConfigError` naming the flags."""
        return config_of(args, self.trainer, LAUNCH_FLAGS)

    def parse_args(self, add_custom_arguments: Callable | None, configure: Callable):
        """The trainer's ``parse_args`` with lossagg's flags, then ``configure``; a refused setting ends the launch
        as argparse does (``error: ...`` on stderr, exit status 2)."""
        trainer_parse_args = import_module(self.parser_module).parse_args  # the peer, imported only here
        return parse_launch(trainer_parse_args, add_custom_arguments, self.add_arguments, configure, LAUNCH_FLAGS)

    def functions(self, configure: Callable) -> tuple[Callable, Callable, Callable]:
        """The adapter's ``parse_args(add_custom_arguments=None)``, ``add_arguments(parser)`` and ``config_of(args)``
        (``configure(args)`` its check and wiring of a parsed launch)."""

        def parse_args(add_custom_arguments: Callable | None = None):
            """The trainer's ``parse_args`` with lossagg's flags, then the adapter's ``configure``; a refused setting
            ends the launch as argparse does (``error: ...`` on stderr, exit status 2)."""
            return self.parse_args(add_custom_arguments, configure)

        return parse_args, self.add_arguments, self.config_of


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


def term_issues(args, config: LossAggregationConfig, inner: str, trainer: str, rebuilt: str, *, kept: bool | None = None) -> list[tuple[str, str]]:
    """The config's terms against the loss the trainer runs (``inner``: ``"policy_loss"`` or a custom loss's
    path): names of the terms of its policy loss, with its coefficients; under TIS (where the trainer
    rebuilds its reducer inside, ``rebuilt`` saying with which denominators) no term of the config, and
    entropy or KL only where that rebuilt reducer is lossagg's default one. ``kept``: None where the
    trainer's adapter has no :data:`DENOMS_FLAG`; True where the launch asked for the kept tokens'
    denominators (the adapter then checks entropy and KL against its deferred plan itself)."""
    issues: list[tuple[str, str]] = []
    if inner != "policy_loss":
        return issues  # a custom loss reduces its terms through reducer.term(name): they are its own
    flags = (("--use-tis", "use_tis"), ("--get-mismatch-metrics", "get_mismatch_metrics"))
    tis = next((flag for flag, dest in flags if getattr(args, dest, False)), None)
    if tis and config.terms:
        why = f"{tis} makes {trainer} rebuild its reducer inside policy_loss_function (from the modified masks)"
        issues.append((tis, f"{why}, so entropy and KL no longer reach lossagg's: the config's terms ({', '.join(config.terms)}) cannot be served"))
    elif tis and not kept and (getattr(args, "entropy_coef", 0.0) or getattr(args, "use_kl_loss", False)):
        # the rebuilt reducer is lossagg's default one (sample_mean) only on the per-sample path, with every sample counted
        why = f"{tis} with entropy or KL on: {trainer} rebuilds their reducer inside policy_loss_function ({rebuilt})"
        offer = "" if kept is None else f", or {DENOMS_FLAG} kept (every term's d[i] of the kept tokens, as that rebuilt reducer's)"
        if config.calculate_per_token_loss or default_term_mode(config.mode) != "sample_mean":
            issues.append(
                (
                    tis,
                    f"{why}; on the per-token path it divides by Σ max(M[i], 1), not the step's loss tokens token_mean divides by: "
                    f"drop the terms or {tis}{offer}",
                )
            )
        elif config.empty_samples == "skip":
            issues.append(("--loss-aggregation-empty-samples", f"{why}, which counts every sample in N (empty_samples=count), not skip{offer}"))
    where = CONFIG_FLAG if flag_given(args, CONFIG_FLAG) else TERM_FLAG  # where the launch's terms came from
    for name, term in config.terms.items():
        if name not in TERMS:
            issues.append(
                (
                    where,
                    f"term {name!r}: {trainer}'s policy_loss_function reduces the terms {', '.join(TERMS)} besides pg_loss; name one of them, "
                    "or reduce your own term in a custom loss (--custom-loss-function-path) through reducer.term(name)",
                )
            )
            continue
        if name == "kl" and not getattr(args, "use_kl_loss", False):
            issues.append((where, f"term 'kl': {trainer} adds its KL term under --use-kl-loss only, which this launch has not"))
            continue
        own = -float(getattr(args, "entropy_coef", 0.0)) if name == "entropy" else float(getattr(args, "kl_loss_coef", 0.0))
        if float(term.coefficient) != own:
            how = "-entropy_coef" if name == "entropy" else "kl_loss_coef"
            flag = TERMS[name]
            issues.append(
                (
                    where,
                    f"term {name!r} has coefficient {term.coefficient}, {trainer} applies {how} = {own} ({flag} {getattr(args, dest(flag), 0.0)}): "
                    "make them agree",
                )
            )
    return issues


def loss_issues(
    args, config: LossAggregationConfig, hooks: dict[str, str], trainer: str, rebuilt: str, *, kept: bool | None = None
) -> tuple[str | None, list[tuple[str, str]]]:
    """The checks both trainers' ``configure`` make of the loss: the loss lossagg wraps (``"policy_loss"``,
    or a custom loss's path; None on a refused ``--loss-type``), a pg_loss reducer already set, a
    ``weighting``, and the config's terms (:func:`term_issues`). Returns (the wrapped loss, the issues)."""
    issues: list[tuple[str, str]] = []
    if config.weighting != "none":
        issues.append(
            (CONFIG_FLAG, f"weighting={config.weighting} needs per-sample weights, which {trainer} does not hand to its reducer: drop weighting")
        )
    inner = getattr(args, "lossagg_inner_loss", None)
    if inner is None:  # first call
        loss_type = getattr(args, "loss_type", "policy_loss")
        if loss_type == "policy_loss":
            inner = "policy_loss"
        elif loss_type == "custom_loss":
            inner = getattr(args, "custom_loss_function_path", None)
        else:
            issues.append(
                ("--loss-type", f"--loss-aggregation reduces pg_loss, which --loss-type {loss_type} has not: use policy_loss or custom_loss")
            )
        reducer = getattr(args, "custom_pg_loss_reducer_function_path", None)
        if reducer not in (None, hooks["custom_pg_loss_reducer_function_path"]):
            issues.append(
                (
                    "--custom-pg-loss-reducer-function-path",
                    f"--custom-pg-loss-reducer-function-path {reducer} and --loss-aggregation {config.mode} both reduce pg_loss: drop one",
                )
            )
    if inner is not None:
        issues += term_issues(args, config, inner, trainer, rebuilt, kept=kept)
    return inner, issues


def backend_issues(args, why: str) -> list[tuple[str, str]]:
    """``--train-backend`` other than megatron, refused with ``why`` (``{backend}`` in it names the one given)."""
    backend = getattr(args, "train_backend", "megatron")
    if backend == "megatron":
        return []
    return [("--train-backend", f"--train-backend {backend}: {why.format(backend=backend)}: use --train-backend megatron")]


def wire(args, config: LossAggregationConfig, hooks: dict[str, str], inner: str, kept: str, keep_as: str) -> None:
    """Set the hooks on a checked launch (once: the first call) and the settings lossagg's hooks read. The
    user's own hook at ``kept`` (one of ``hooks``) is kept in ``args.<keep_as>`` and called by lossagg's."""
    if getattr(args, "lossagg_inner_loss", None) is None:
        user = getattr(args, kept, None)
        setattr(args, keep_as, user if user != hooks[kept] else None)
        args.lossagg_inner_loss = inner
        for name, path in hooks.items():
            setattr(args, name, path)
        args.loss_type = "custom_loss"
    # the trainers' per-token path is token_mean's (the config resolves the legacy flag both ways)
    args.calculate_per_token_loss = bool(config.calculate_per_token_loss)
    args.lossagg_config = config.summary()


def layout_of(local_masks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """This CP rank's masks of a micro-batch's samples, concatenated, and their cu_seqlens."""
    lengths = torch.tensor([m.numel() for m in local_masks], dtype=torch.int64)
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu_seqlens[1:])
    mask = torch.cat(list(local_masks)) if len(local_masks) else torch.zeros(0, dtype=torch.int32)
    return mask, cu_seqlens


def schedule_of(args, config: LossAggregationConfig, inner: str, *, entropy_always: bool) -> tuple[str, ...]:
    """The order of the reducer's calls in the trainer's ``policy_loss_function`` (:data:`POLICY_LOSS_CALLS`),
    or () where the order does not matter (no term of the config) or the loss is not the policy loss."""
    if inner != "policy_loss" or not config.terms or getattr(args, "use_tis", False) or getattr(args, "get_mismatch_metrics", False):
        return ()
    drop = set()
    if not getattr(args, "use_kl_loss", False):
        drop.add("kl")
    if not entropy_always and not getattr(args, "entropy_coef", 0.0):
        drop.add("entropy")
    return tuple(n for n in POLICY_LOSS_CALLS if n not in drop)


# ---------------------------------------------------------------------------------- the run
def runtime_config(args, trainer: str, module: str) -> LossAggregationConfig:
    """The config a configured launch left in ``args.lossagg_config`` (the step's own sample count is checked
    where it is known: a dynamic global batch size varies by rollout)."""
    summary = getattr(args, "lossagg_config", None)
    if summary is None:
        raise RuntimeError(
            f"lossagg's {trainer} hooks are set but the launch was not configured by lossagg: launch with "
            f"{module}.parse_args (or call {module}.configure(args) after {trainer}'s parse_args)"
        )
    data = {k: v for k, v in summary.items() if k not in ("resolution_notes", "global_batch_size") and v is not None}
    return LossAggregationConfig.from_dict(data, source="args.lossagg_config")


def load(path: str):
    """The function a hook path names (``module.name``, as the trainers' ``load_function`` spells it)."""
    module, _, name = path.rpartition(".")
    return getattr(import_module(module), name)


def prompt_fingerprint(tokens, prompt_length: int) -> int:
    """A sample's prompt, hashed: the samples of one prompt group must share it."""
    return hash(tuple(torch.as_tensor(tokens[:prompt_length]).tolist())) & ((1 << 62) - 1)


def check_rollout_lists(rollout_data, n: int, integers: Sequence[str] = ("sample_indices",)) -> None:
    """The trainers' per-sample lists of a rank's rollout data hold one entry per sample (``n``), and those of
    ``integers`` integers, as the trainers fill them (a malformed one named, not an IndexError later)."""
    for key in ("total_lengths", "response_lengths", "tokens", *integers):
        values = rollout_data.get(key)
        if values is None:
            continue
        if len(values) != n:
            raise ValueError(f"lossagg: rollout_data[{key!r}] holds {len(values)} entries for this rank's {n} samples")
        odd = next((v for v in values if key in integers and (isinstance(v, (str, bytes, float, bool)) or not hasattr(v, "__index__"))), None)
        if odd is not None:
            raise ValueError(f"lossagg: rollout_data[{key!r}] must hold integers (one per sample), got {odd!r}")


def check_zero_one(masks, names: Sequence[int], trainer: str) -> None:
    """Every loss mask 0/1 (one transfer for all of a rank's samples): d[i] counts tokens, the trainer multiplies by the mask."""
    odd = torch.nonzero(torch.stack([((m != 0) & (m != 1)).any() for m in masks]).cpu()).flatten().tolist() if len(masks) else []
    if odd:
        raise ValueError(
            f"lossagg: the loss mask of rollout sample {names[odd[0]]} is not 0/1: d[i] counts tokens, while {trainer}'s reducer multiplies "
            "by the mask (its per-token path divides by the mask's sum)"
        )


def group_index_of(groups: Sequence[int], prints: Sequence[int], trainer: str, what: str = "samples") -> torch.Tensor:
    """Dense prompt-group labels of a plan's samples from their group keys (``sample_index // n_samples_per_prompt``),
    each group checked to hold one prompt (its samples' prompt fingerprints agree)."""
    keys, dense = torch.unique(torch.as_tensor(list(groups), dtype=torch.int64), return_inverse=True)
    prints = torch.as_tensor(list(prints), dtype=torch.int64)
    for k in range(keys.numel()):
        if torch.unique(prints[dense == k]).numel() != 1:
            raise ValueError(
                f"lossagg: the {what} of prompt group {int(keys[k])} (sample_index // n_samples_per_prompt, as {trainer}'s data source numbers "
                "them) have different prompts: this rollout's samples are not numbered by group"
            )
    return dense


class PlannedSamples:
    """A rank's samples of its planned steps, found by their loss-mask tensors (the objects the trainer's data
    iterator hands each micro-batch): each sample's step and its position among the samples of that step's
    plan (several training samples may share one: slime's rollouts), the steps' plans and what each step's
    reductions are multiplied by (the trainer's outer divisor)."""

    def __init__(
        self,
        masks,
        steps: Sequence[int],
        positions: Sequence[int],
        plans: Sequence[StepPlan],
        scales,
        per_token: bool,
        hook: str,
        trainer: str = "",
        deferred: Sequence[DeferredPlan | None] = (),
    ):
        self._by_mask = {id(m): (m, j) for j, m in enumerate(masks)}
        #: each step's :class:`lossagg.DeferredPlan` of pg_loss when its d[i] come from the kept tokens (else None),
        #: whose samples are this rank's, numbered from 0 in each step
        self.deferred = list(deferred) or [None] * len(plans)
        first: dict[int, int] = {}
        for j, t in enumerate(steps):
            first.setdefault(t, j)
        self.local = [j - first[t] for j, t in enumerate(steps)]  # a sample's place among this rank's samples of its step
        self.trainer = trainer  # the package the trainer runs as (its modules are imported from it)
        self.steps, self.positions = list(steps), list(positions)
        self.plans, self.scales = list(plans), list(scales)
        self.per_token = per_token
        self._hook = hook
        # the default reducer of each step, reduced through the same handle (its d[i] the plan's metric_denoms)
        self.metric_plans = [StepPlan.from_denoms(plan.metric_denoms) for plan in self.plans]

    def find(self, loss_masks) -> tuple[int, list[int]]:
        """A micro-batch's step and its samples' rows among the rank's planned samples, from its loss-mask tensors."""
        rows = []
        for k, m in enumerate(loss_masks):
            hit = self._by_mask.get(id(m))
            if hit is None or hit[0] is not m:
                raise RuntimeError(
                    f"lossagg: sample {k} of this micro-batch is not one of the samples planned for this step (its loss mask is not one the "
                    f"rollout data held when {self._hook} ran): was the rollout data replaced after the hook?"
                )
            rows.append(hit[1])
        steps = {self.steps[j] for j in rows}
        if len(steps) > 1:
            raise RuntimeError(f"lossagg: one micro-batch holds samples of steps {sorted(steps)}")
        return (steps.pop() if steps else 0), rows

    def denoms(self, name: str) -> torch.Tensor:
        """``d_k`` of term ``name`` (or :data:`METRIC`) of each planned sample of this rank, float64 (for a tracker or a test)."""
        rows = [self.plans[s].metric_denoms if name == METRIC else self.plans[s].term_denoms[name] for s in self.steps]
        return torch.stack([d[p] for d, p in zip(rows, self.positions, strict=True)]) if rows else torch.zeros(0, dtype=torch.float64)

    def reducer(self, loss_masks, layout: Callable, schedule: Sequence[str], trainer: str) -> TermReducer:
        """The reducer of the micro-batch whose samples hold ``loss_masks``: :class:`TermReducer` over its step's plan."""
        step, rows = self.find(loss_masks)
        positions = torch.tensor([self.positions[j] for j in rows], dtype=torch.int64)
        deferred = self.deferred[step]
        local = None if deferred is None else torch.tensor([self.local[j] for j in rows], dtype=torch.int64)
        return TermReducer(self.plans[step], self.metric_plans[step], positions, self.scales[step], layout, schedule, trainer, deferred, local)


class TermReducer:
    """The reducer of one micro-batch, handed to the trainer's loss in place of ``sum_of_sample_mean``.

    ``reducer(x)`` reduces ``x`` (this CP rank's per-token values of the micro-batch's samples,
    concatenated as the trainer lays them out) by the default reducer; ``reducer.term(name)(x)`` by
    the term's own mode (``"pg"`` or a term of the config). Each is the micro-batch's share of the
    term's ``J_k`` (before its coefficient, which the trainer applies), reduced through the step plan's
    micro-batch handle, times the trainer's outer divisor ``scale``. Under a schedule (the trainer's
    ``policy_loss_function``), the n-th plain call reduces the n-th term of the schedule.

    ``samples`` are the positions of the micro-batch's segments among the plan's samples (a sample may
    be named by several segments: its pieces); ``layout(loss_masks)`` gives this CP rank's mask and
    cu_seqlens of the micro-batch for some masks (the micro-batch's own when None).
    """

    def __init__(
        self,
        plan: StepPlan,
        metric_plan: StepPlan,
        samples: torch.Tensor,
        scale,
        layout: Callable,
        schedule=(),
        trainer: str = "",
        deferred: DeferredPlan | None = None,
        local_samples: torch.Tensor | None = None,
    ):
        self.plan, self.metric_plan = plan, metric_plan
        # pg_loss on the kept tokens' d[i]: its micro-batch recorded in the step's DeferredPlan (this rank's samples from 0)
        self.deferred, self.local_samples = deferred, local_samples
        self.samples = samples
        self.scale = scale
        self._layout = layout
        self._own: dict[int, object] = {}  # each plan's handle of the micro-batch's own masks, made once
        self.schedule = tuple(schedule)
        self.trainer = trainer
        self.names = tuple(t.name for t in plan.config.loss_terms)
        self.calls: list[tuple[str, torch.Tensor]] = []
        self.reduced: set[str] = set()

    def _handle(self, plan: StepPlan, loss_masks):
        if loss_masks is None and id(plan) in self._own:
            return self._own[id(plan)]
        mask, cu_seqlens = self._layout(loss_masks)
        mb = plan.micro_batch(self.samples, mask, cu_seqlens, pieces=True)
        if loss_masks is None:
            self._own[id(plan)] = mb
        return mb

    def _deferred_pg(self, loss_masks) -> Callable[[torch.Tensor], torch.Tensor]:
        """pg_loss over the final (kept) masks on the step's DeferredPlan: this micro-batch's share of J before
        the step's rescale (:meth:`lossagg.DeferredPlan.close`), times the trainer's outer divisor."""
        plan = self.deferred
        mask, cu_seqlens = self._layout(loss_masks)
        mb = plan.micro_batch(self.local_samples, mask, cu_seqlens)
        tokens = int(mb.cu_seqlens[-1])

        def reduce_pg(x: torch.Tensor) -> torch.Tensor:
            if x.dim() != 1 or x.shape[0] != tokens:
                raise ValueError(f"lossagg: pg holds {tuple(x.shape)} values, this CP rank's response tokens of the micro-batch are {tokens}")
            self.reduced.add("pg")
            return plan.loss(x, mb) * self.scale

        return reduce_pg

    def term(self, name: str, loss_masks=None) -> Callable[[torch.Tensor], torch.Tensor]:
        if name not in self.names and name != METRIC:
            raise KeyError(f"lossagg: no term {name!r} in the config; its terms: {', '.join(self.names)}")
        if name == "pg" and self.deferred is not None:
            return self._deferred_pg(loss_masks)
        plan = self.metric_plan if name == METRIC else self.plan
        mb = self._handle(plan, loss_masks)
        tokens = int(mb.cu_seqlens[-1])

        def reduce_term(x: torch.Tensor) -> torch.Tensor:
            if x.dim() != 1 or x.shape[0] != tokens:
                raise ValueError(f"lossagg: {name} holds {tuple(x.shape)} values, this CP rank's response tokens of the micro-batch are {tokens}")
            if name != METRIC:
                self.reduced.add(name)
            return plan.loss(x, mb, terms=None if plan is self.metric_plan else name, coefficients=False) * self.scale

        return reduce_term

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.calls)
        name = self.schedule[n] if n < len(self.schedule) else METRIC
        out = self.term(name if name in self.names else METRIC)(x)
        self.calls.append((name, out))
        return out

    def check_reported(self, reported) -> None:
        """Each scheduled call's result against what the loss reports under its name (the schedule is the loss's
        own order), and every term of the config reduced on its own mode: a term the loss reports must have been
        a call of the reducer (else the config's term was never reduced on its mode)."""
        for name, out in self.calls:
            key = REPORTED.get(name)
            if key is None:
                continue
            got = reported.get(key)
            if got is None or not torch.equal(torch.as_tensor(got).detach().to(out.device, out.dtype), out.detach()):
                raise RuntimeError(
                    f"lossagg: {self.trainer}'s policy_loss_function reported {key}={got!r} where lossagg's reducer returned {float(out)!r} "
                    f"for it: it does not call its reducer in the order lossagg reads ({', '.join(POLICY_LOSS_CALLS)}), so the config's "
                    "terms cannot be told apart"
                )
        called = {name for name, _ in self.calls} | self.reduced
        missing = [n for n in self.schedule if n not in called and REPORTED.get(n, "") in reported]
        if missing:
            raise RuntimeError(
                f"lossagg: {self.trainer}'s policy_loss_function reported {', '.join(REPORTED[n] for n in missing)} without calling its reducer "
                f"for {', '.join(missing)}, so lossagg did not reduce {'them' if len(missing) > 1 else 'it'} on the config's mode: it must call "
                f"its reducer for each, in the order lossagg reads ({', '.join(POLICY_LOSS_CALLS)})"
            )


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("lossagg_seed_micro_batch", default=None)


def planned_for_loss(args, planned: PlannedSamples | None, module: str, hook: str, hook_function: str) -> PlannedSamples:
    """The planned samples a configured launch's loss runs on, checked: the launch configured by ``module``,
    a plan made by its hook, the per-token path the same as when it was planned."""
    if getattr(args, "lossagg_inner_loss", None) is None:
        raise RuntimeError(f"{module}.loss_function: the launch was not configured by lossagg ({module}.configure)")
    if planned is None:
        raise RuntimeError(f"lossagg: no step was planned: {hook} must be {module}.{hook_function}")
    if bool(args.calculate_per_token_loss) != planned.per_token:
        raise RuntimeError(
            f"lossagg: calculate_per_token_loss={args.calculate_per_token_loss} at the loss, {planned.per_token} when the step was planned"
        )
    return planned


def run_loss(func, args, batch, logits, reducer: TermReducer):
    """The trainer's loss ``func`` with ``reducer`` in place of ``sum_of_sample_mean`` (and as the pg_loss
    reducer :func:`pg_reducer` hands it), then the reducer's check of what it reported."""
    token = _CURRENT.set((batch, reducer))
    try:
        loss, log = func(args, batch, logits, reducer)
    finally:
        _CURRENT.reset(token)
    if reducer.schedule:
        reducer.check_reported(log)
    return loss, log


def pg_reducer(total_lengths, response_lengths, pg_loss_masks, calculate_per_token_loss, planned_per_token: bool, module: str):
    """The trainers' ``--custom-pg-loss-reducer-function-path``: pg_loss of the running micro-batch on the mode.
    ``pg_loss_masks`` give the numerator (the rollout masks, or TIS/RS's modified ones); ``d[i]`` is the plan's."""
    current = _CURRENT.get()
    if current is None:
        raise RuntimeError(
            f"{module}.pg_loss_reducer runs inside {module}.loss_function "
            f"(--loss-type custom_loss --custom-loss-function-path {module}.loss_function)"
        )
    batch, reducer = current
    if bool(calculate_per_token_loss) != planned_per_token:
        raise RuntimeError(f"lossagg: calculate_per_token_loss={calculate_per_token_loss} at the loss, {planned_per_token} when the step was planned")
    if list(total_lengths) != list(batch["total_lengths"]) or list(response_lengths) != list(batch["response_lengths"]):
        raise RuntimeError("lossagg: the pg_loss reducer was asked for samples other than the micro-batch's")
    return reducer.term("pg", pg_loss_masks)


__all__ = [
    "METRIC",
    "PlannedSamples",
    "LAUNCH_FLAGS",
    "Launch",
    "backend_issues",
    "group_index_of",
    "check_rollout_lists",
    "check_zero_one",
    "load",
    "pg_reducer",
    "planned_for_loss",
    "prompt_fingerprint",
    "run_loss",
    "runtime_config",
    "POLICY_LOSS_CALLS",
    "REPORTED",
    "TERMS",
    "TermReducer",
    "layout_of",
    "loss_issues",
    "parse_launch",
    "schedule_of",
    "term_issues",
    "wire",
    "CONFIG_FLAG",
    "DENOMS",
    "DENOMS_FLAG",
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
