"""What each trainer serves, asked of its adapter's own checks: the table at the top of docs/trainers/README.md.

For each trainer (a row) and each column (the plain modes, the modes with prompt groups, the session modes,
``empty_samples: skip``, ``weighting``, entropy and KL on their own modes, a filter inside the loss, CP
layouts) a list of :class:`Case`\\ s, each a config and the trainer's settings, is handed to the function of
the adapter that raises its refusal (``verl_trainer.actor_config_for``, ``trl_checks.refusals``,
``make_loss_func``, ``miles.configure``, ``slime.configure``, ``skyrl.config_for``, ``openrlhf.config_for``,
``areal.config_for``; a ``StepPlan`` or ``DeferredPlan`` and its loss for a loop of one's own). A case is
served when the call returns (a trainer's own setting that makes it so, as AReaL's ``sessions=True``, is named
in the cell), refused when it raises a ``ValueError``: its cell then names the refused cases and the number of
a note under the table, which holds the refusal's first reason as the exception words it, on one line. Nothing
is written here by hand but what each case asks, so the table follows the adapters. The trainers' settings
are stand-ins built as the trainer leaves them (the namespace of a parsed miles or slime launch, SkyRL's and
OpenRLHF's config trees, verl's actor config, AReaL's actor config, TRL's ``GRPOConfig``), with only the
attributes the checks read; no trainer is imported.

``python -m lossagg.integrations.served`` prints the table; ``--write docs/trainers/README.md`` puts it
between the page's markers (tests/test_served_table.py checks that the page holds it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace as NS
from typing import Any

import torch

from lossagg.config import ConfigError, LossAggregationConfig
from lossagg.config.model import WEIGHTINGS
from lossagg.deferred import DeferredPlan
from lossagg.integrations import areal, megatron, miles, openrlhf, skyrl, slime, trl_checks, verl_trainer
from lossagg.modes import MODES
from lossagg.step import StepPlan, gradient_scale
from lossagg.totals import TOTALS

#: The markers around the generated table in docs/trainers/README.md.
BEGIN, END = "<!-- served:begin -->", "<!-- served:end -->"
#: The command that regenerates the page's table.
COMMAND = "python -m lossagg.integrations.served --write docs/trainers/README.md"

# the numbers the cases use: a prompt group's samples, a fixed divisor L, the entropy bonus's and the KL term's coefficients
N_PER_PROMPT, DIVISOR, ENTROPY, KL = 4, 8.0, 0.01, 0.05


class Refused(ValueError):
    """A case the adapter refused: its reasons, in the adapter's words, one per problem."""

    def __init__(self, reasons: list[str]):
        super().__init__("; ".join(reasons))
        self.reasons = reasons


def reasons_of(exc: ValueError) -> list[str]:
    """An adapter's refusal as its list of problems: a :class:`lossagg.ConfigError`'s issues, the ``"\\n- "`` items of
    a ``"lossagg cannot serve ...:"`` error, or the message."""
    if isinstance(exc, ConfigError):
        return [message for _, message in exc.issues]
    text = str(exc)
    return text.split("\n- ")[1:] or [text]


def one_line(reason: str) -> str:
    """A reason as one line of markdown: its whitespace collapsed, its ``|`` escaped (it may stand in a table)."""
    return " ".join(reason.split()).replace("|", "\\|")


def vocabulary_free(reason: str) -> str:
    """``reason`` with the names of modes, step totals and weightings (what differs between the cases of one
    refusal: ``mode=session_mean needs the step total(s) num_sessions, session_sizes``) replaced by ``…``: the
    refusals of a cell that read the same this way are one."""
    names = sorted((*MODES, *TOTALS, *(w for w in WEIGHTINGS if w != "none")), key=len, reverse=True)
    text = re.sub(r"\b(" + "|".join(map(re.escape, names)) + r")\b", "…", reason)
    return re.sub(r"…(, …)+", "…", text)


# ----------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One question to a trainer: ``settings`` (a lossagg config's settings) with the trainer's ``knobs``;
    ``label`` names it in its cell; ``kind``, for the cases every trainer is asked, what it asks (the kind of
    its mode, :func:`mode_kinds`, or its column's key)."""

    label: str
    settings: Mapping[str, Any]
    knobs: Mapping[str, Any] = field(default_factory=dict)
    kind: str | None = None


@dataclass(frozen=True)
class Answer:
    """A trainer's answer to a case: served (``variant``: the trainer's setting under which, or None) or
    refused (``reason``: the first reason of the adapter's refusal, one line)."""

    served: bool
    variant: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Trainer:
    """A row: ``check(settings, **knobs)`` calls the adapter's check (raising its refusal); ``variants`` are the
    trainer's settings, ``(label, knobs)``, tried in order when the default refuses a case; ``terms_knobs`` turn
    on the trainer's entropy bonus (coefficient :data:`ENTROPY`) and KL term (:data:`KL`); ``extra`` adds cases
    to a column (by its key, :data:`COLUMNS`); a column with no case is one the adapter has no setting for."""

    name: str
    check: Callable[..., Any]
    variants: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    terms_knobs: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, tuple[Case, ...]] = field(default_factory=dict)


def settings_of(mode: str, **more) -> dict[str, Any]:
    """A config's settings on ``mode`` (with its divisor when it takes one)."""
    return {"mode": mode, **({"divisor": DIVISOR} if MODES[mode].needs_divisor else {}), **more}


def term_of(mode: str, coefficient: float) -> dict[str, Any]:
    return {"coefficient": coefficient, "mode": mode, **({"divisor": DIVISOR} if MODES[mode].needs_divisor else {})}


def with_terms(entropy_mode: str, kl_mode: str) -> dict[str, Any]:
    """``sample_mean`` for pg, the entropy bonus (coefficient ``-ENTROPY``) and the KL term (``KL``) on their own modes."""
    return settings_of("sample_mean", terms={"entropy": term_of(entropy_mode, -ENTROPY), "kl": term_of(kl_mode, KL)})


def ask(trainer: Trainer, case: Case) -> Answer:
    """The case asked of the trainer's check, then, while refused, under each of its ``variants``; refused, the
    default's first reason. Only a ``ValueError`` is a refusal (anything else is a fault of the case)."""
    first = None
    for label, knobs in ((None, {}), *trainer.variants):
        try:
            trainer.check(dict(case.settings), **{**knobs, **case.knobs})
        except ValueError as exc:
            first = first or (exc.reasons if isinstance(exc, Refused) else reasons_of(exc))
            continue
        return Answer(True, variant=label)
    return Answer(False, reason=one_line(first[0]))


# ----------------------------------------------------------------------- the trainers' checks
def _verl(planned: bool) -> Callable[..., Any]:
    def check(settings, *, loss_mode="vanilla", entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.001, critic=False):
        """verl's actor (or critic) config as verl 0.9.1's ``ActorConfig`` / ``CriticConfig`` hold it, checked."""
        if critic:
            return verl_trainer.critic_config_for(NS(loss_scale_factor=None), settings, planned=planned)
        actor = NS(
            policy_loss={"loss_mode": loss_mode},
            loss_scale_factor=None,
            entropy_coeff=entropy_coeff,
            use_kl_loss=use_kl_loss,
            kl_loss_coef=kl_loss_coef,
        )
        return verl_trainer.actor_config_for(actor, settings, planned=planned)

    return check


def _trl(settings, *, beta=0.0, entropy_coef=0.0, top_entropy_quantile=1.0, steps_per_generation=2, gradient_accumulation_steps=2):
    """TRL's ``GRPOTrainer.__init__`` checks (:func:`lossagg.integrations.trl_checks.refusals`) with ``loss_aggregation``."""
    targs = NS(steps_per_generation=steps_per_generation, gradient_accumulation_steps=gradient_accumulation_steps)
    config = LossAggregationConfig.from_dict(settings)
    kwargs = dict(beta=beta, entropy_coef=entropy_coef, top_entropy_quantile=top_entropy_quantile, entropy_enabled=entropy_coef != 0.0)
    _, refused = trl_checks.refusals(config, targs, **kwargs)
    if refused:
        raise Refused(refused)


def _labels(config: LossAggregationConfig, n: int) -> dict[str, Any]:
    """Per-sample labels and weights of ``n`` samples for a plan of ``config``: prompt groups of two samples, a session each."""
    kwargs: dict[str, Any] = {}
    if any(t.spec.needs_groups for t in config.loss_terms):
        kwargs["group_index"] = torch.arange(n) // 2
    if any(t.spec.needs_sessions for t in config.loss_terms):
        kwargs["session_index"] = torch.arange(n)
    if any(t.weighting != "none" for t in config.loss_terms):
        kwargs["sample_weights"] = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
    return kwargs


def _own_loop(settings, *, deferred=False, calculate_per_token_loss=False, cp_size=1, megatron_loss=False):
    """One micro-batch of four packed samples (one empty) through a ``StepPlan`` (or a ``DeferredPlan`` whose final
    mask a filter gives), reduced by ``plan.loss`` times ``gradient_scale`` (a loop of one's own), or by
    ``make_loss_func`` (``megatron_loss``)."""
    if MODES[settings["mode"]].needs_groups or any(MODES[t["mode"]].needs_groups for t in settings.get("terms", {}).values()):
        settings = {**settings, "n_samples_per_prompt": 2}  # a DeferredPlan checks that each group lies whole in its micro-batch
    config = LossAggregationConfig.from_dict(settings)
    counts = torch.tensor([2, 0, 3, 1])
    cu, mask = torch.tensor([0, 2, 2, 5, 6]), torch.ones(6)
    plan = DeferredPlan(config, 4, **_labels(config, 4)) if deferred else StepPlan(config, counts, **_labels(config, 4))
    values = {name: torch.zeros(6, dtype=torch.float64) for name in ("pg", *config.terms)}
    output = values if config.terms else values["pg"]
    if megatron_loss:
        keep = (lambda output_tensor, loss_mask: loss_mask) if deferred else None
        loss_func = megatron.make_loss_func(
            plan, slice(0, 4), cu, mask, num_micro_batches=1, cp_size=cp_size, calculate_per_token_loss=calculate_per_token_loss, keep=keep
        )
        loss_func(output)
        return
    plan.loss(output, plan.micro_batch(slice(0, 4), mask, cu)) * gradient_scale("mean", dp_size=1, cp_size=cp_size)


def _megatron(settings, **knobs):
    return _own_loop(settings, megatron_loss=True, **knobs)


#: What miles' and slime's parse_args leave for a launch, of the attributes their adapters read or set.
SEED_LAUNCH = {
    **dict.fromkeys(("loss_aggregation", "loss_aggregation_divisor", "loss_aggregation_empty_samples", "loss_aggregation_term")),
    **dict.fromkeys(("loss_aggregation_config", "num_steps_per_rollout", "custom_loss_function_path", "custom_pg_loss_reducer_function_path")),
    "calculate_per_token_loss": False,
    "loss_type": "policy_loss",
    "n_samples_per_prompt": N_PER_PROMPT,
    "global_batch_size": 4 * N_PER_PROMPT,
    "rollout_batch_size": 4,
    "train_backend": "megatron",
    "entropy_coef": 0.0,
    "use_kl_loss": False,
    "kl_loss_coef": 0.0,
    "use_tis": False,
    "get_mismatch_metrics": False,
}
MILES_LAUNCH = {
    **SEED_LAUNCH,
    "custom_megatron_before_train_step_hook_path": None,
    "loss_aggregation_tis_denominators": None,
    "recompute_loss_function": False,
}
SLIME_LAUNCH = {**SEED_LAUNCH, "rollout_data_postprocess_path": None, "advantage_estimator": "grpo", "allgather_cp": False}


def _term_flag(name: str, term: Mapping[str, Any]) -> str:
    """A term as ``--loss-aggregation-term NAME:COEFFICIENT[:MODE[:DIVISOR]]`` spells it."""
    return ":".join(str(part) for part in (name, term["coefficient"], term.get("mode", ""), term.get("divisor", "")) if part != "")


def _seed(adapter, launch: Mapping[str, Any]) -> Callable[..., Any]:
    def check(settings, **flags):
        """A parsed launch with lossagg's flags for ``settings`` (a config file for what no flag spells), checked by
        the adapter's ``configure``."""
        args = argparse.Namespace(**{**launch, **flags})
        with contextlib.ExitStack() as stack:
            if set(settings) - {"mode", "divisor", "empty_samples", "terms"}:  # a weighting: only a config file holds it
                folder = stack.enter_context(tempfile.TemporaryDirectory())
                path = os.path.join(folder, "loss_aggregation.json")
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(settings, f)
                args.loss_aggregation_config = path
            else:
                args.loss_aggregation = settings["mode"]
                args.loss_aggregation_divisor = settings.get("divisor")
                args.loss_aggregation_empty_samples = settings.get("empty_samples")
                terms = settings.get("terms", {})
                args.loss_aggregation_term = [_term_flag(name, term) for name, term in terms.items()] or None
            return adapter.configure(args)

    return check


def _skyrl(settings, *, step_wise=False, policy_loss_type="regular"):
    """SkyRL's ``SkyRLTrainConfig``, as far as :func:`lossagg.integrations.skyrl.config_for` reads it."""
    algorithm = NS(loss_reduction="token_mean", max_seq_len=None, policy_loss_type=policy_loss_type, use_entropy_loss=False)
    cfg = NS(trainer=NS(algorithm=algorithm), generator=NS(step_wise_trajectories=step_wise, n_samples_per_prompt=N_PER_PROMPT))
    return skyrl.config_for(cfg, settings)


def _openrlhf(settings, *, entropy_coef=None, use_kl_loss=False, kl_coef=0.0, ring_attn_size=1):
    """OpenRLHF's ``strategy.args``, as far as :func:`lossagg.integrations.openrlhf.config_for` reads them."""
    args = NS(
        actor=NS(policy_loss_type="ppo", loss_agg_mode="token-mean", entropy_coef=entropy_coef),
        algo=NS(kl=NS(use_loss=use_kl_loss, init_coef=kl_coef, target=None)),
        train=NS(dynamic_batch_enable=False),
        ds=NS(ring_attn_size=ring_attn_size, tensor_parallel_size=1),
    )
    return openrlhf.config_for(args, settings)


def _areal(settings, *, sessions=False, m2_threshold=None):
    """AReaL's ``PPOActorConfig``, as far as :func:`lossagg.integrations.areal.config_for` reads it."""
    return areal.config_for(NS(m2_threshold=m2_threshold), settings, sessions=sessions)


def _deferred_cases() -> tuple[Case, ...]:
    """Every mode through a ``DeferredPlan`` (its final masks given by a filter inside the loss)."""
    return tuple(Case(f"`{mode}`", settings_of(mode), {"deferred": True}, kind="filter") for mode in MODES)


def _tis_cases() -> tuple[Case, ...]:
    terms = {"entropy_coef": ENTROPY, "use_kl_loss": True, "kl_loss_coef": KL}
    return (
        Case("`--use-tis`", settings_of("sample_mean"), {"use_tis": True}),
        Case("`--use-tis` with entropy/KL terms", with_terms("token_mean", "sample_mean"), {"use_tis": True, **terms}),
        Case("`--use-tis` with entropy/KL on `token_mean`", settings_of("token_mean"), {"use_tis": True, **terms}),
        Case("`--use-tis` with entropy/KL under `skip`", settings_of("sample_mean", empty_samples="skip"), {"use_tis": True, **terms}),
    )


def _miles_tis_cases() -> tuple[Case, ...]:
    """:func:`_tis_cases`, and with ``--loss-aggregation-tis-denominators kept`` (every term's d[i] of the kept tokens)."""
    terms = {"entropy_coef": ENTROPY, "use_kl_loss": True, "kl_loss_coef": KL}
    kept = {"use_tis": True, "loss_aggregation_tis_denominators": "kept"}
    return (
        *_tis_cases(),
        Case("`--use-tis` with entropy/KL on `token_mean`, kept tokens' `d[i]`", settings_of("token_mean"), {**kept, **terms}),
        Case("`--use-tis` with entropy/KL under `skip`, kept tokens' `d[i]`", settings_of("sample_mean", empty_samples="skip"), {**kept, **terms}),
        Case("`--use-tis` with entropy/KL on `max_length`, kept tokens' `d[i]`", settings_of("max_length"), {**kept, **terms}),
        Case("`--use-tis` on `prompt_mean`, kept tokens' `d[i]`", settings_of("prompt_mean"), kept),
    )


def trainers() -> tuple[Trainer, ...]:
    """The rows, in the order of the page."""
    verl_terms = {"entropy_coeff": ENTROPY, "use_kl_loss": True, "kl_loss_coef": KL}
    verl_extra = {
        "terms": (Case("the critic's `value`", settings_of("sample_mean", terms={"value": term_of("token_mean", 0.5)}), {"critic": True}),),
        "filter": (Case("`policy_loss.loss_mode=bypass_mode`", settings_of("sample_mean"), {"loss_mode": "bypass_mode"}),),
    }
    seed_terms = {"entropy_coef": ENTROPY, "use_kl_loss": True, "kl_loss_coef": KL}
    return (
        Trainer("verl `lossagg_trainer`", _verl(planned=True), terms_knobs=verl_terms, extra=verl_extra),
        Trainer("verl `install`", _verl(planned=False), terms_knobs=verl_terms, extra=verl_extra),
        Trainer(
            "TRL `GRPOTrainer`",
            _trl,
            terms_knobs={"beta": KL, "entropy_coef": ENTROPY},
            extra={
                "groups": (Case("`steps_per_generation > gradient_accumulation_steps`", settings_of("prompt_mean"), {"steps_per_generation": 4}),),
                "filter": (
                    Case("`top_entropy_quantile < 1`", settings_of("sample_mean"), {"top_entropy_quantile": 0.2}),
                    Case(
                        "`top_entropy_quantile < 1` with `entropy_coef`",
                        settings_of("sample_mean"),
                        {"top_entropy_quantile": 0.2, "entropy_coef": ENTROPY},
                    ),
                ),
            },
        ),
        Trainer(
            "Megatron `make_loss_func`",
            _megatron,
            extra={
                "filter": (
                    *_deferred_cases(),
                    Case("`calculate_per_token_loss`", settings_of("token_mean"), {"deferred": True, "calculate_per_token_loss": True}),
                ),
                "cp": (Case("CP 2", settings_of("sample_mean"), {"cp_size": 2}),),
            },
        ),
        Trainer(
            f"miles-rl {miles.MILES_VERSION}",
            _seed(miles, MILES_LAUNCH),
            terms_knobs=seed_terms,
            extra={"filter": _miles_tis_cases(), "cp": (Case("zigzag", settings_of("sample_mean")),)},
        ),
        Trainer(
            f"slime {slime.SLIME_COMMIT}",
            _seed(slime, SLIME_LAUNCH),
            terms_knobs=seed_terms,
            extra={
                "terms": (Case("a critic (`--advantage-estimator ppo`)", settings_of("sample_mean"), {"advantage_estimator": "ppo"}),),
                "filter": _tis_cases(),
                "cp": (Case("zigzag", settings_of("sample_mean")), Case("`--allgather-cp`", settings_of("sample_mean"), {"allgather_cp": True})),
            },
        ),
        Trainer(
            f"SkyRL {skyrl.SKYRL_VERSION}",
            _skyrl,
            variants=(("`generator.step_wise_trajectories`", {"step_wise": True}),),
            extra={
                "filter": tuple(
                    Case(f"`policy_loss_type={loss}`", settings_of("sample_mean"), {"policy_loss_type": loss}) for loss in ("clip_cov", "kl_cov")
                )
            },
        ),
        Trainer(
            f"OpenRLHF {openrlhf.OPENRLHF_VERSION}",
            _openrlhf,
            terms_knobs={"entropy_coef": ENTROPY, "use_kl_loss": True, "kl_coef": KL},
            extra={"cp": (Case("`ds.ring_attn_size=2`", settings_of("sample_mean"), {"ring_attn_size": 2}),)},
        ),
        Trainer(
            f"AReaL {areal.AREAL_VERSION} `lossagg_actor`",
            _areal,
            variants=(("`sessions=True`", {"sessions": True}),),
            extra={"filter": (Case("`actor.m2_threshold`", settings_of("sample_mean"), {"m2_threshold": 0.04}),)},
        ),
        Trainer(
            "torch DDP / FSDP2",
            _own_loop,
            extra={"filter": _deferred_cases(), "cp": (Case("CP 2", settings_of("sample_mean"), {"cp_size": 2}),)},
        ),
    )


# ----------------------------------------------------------------------- the columns
def mode_kinds() -> dict[str, list[str]]:
    """The registered modes by kind (docs/modes.md): plain (neither prompt groups nor sessions), with prompt groups, with sessions."""
    kinds: dict[str, list[str]] = {"plain": [], "groups": [], "sessions": []}
    for name, spec in MODES.items():
        kinds["sessions" if spec.needs_sessions else "groups" if spec.needs_groups else "plain"].append(name)
    return kinds


def _mode_cases(kinds: dict[str, list[str]], key: str, **more) -> list[Case]:
    return [Case(f"`{mode}`", settings_of(mode, **more), kind=key) for mode in kinds[key]]


def columns() -> dict[str, str]:
    """Each column's key and header."""
    groups = ", ".join(f"`{m}`" for m in mode_kinds()["groups"])
    return {
        "plain": "plain modes",
        "groups": groups,
        "sessions": "session modes",
        "skip": "`empty_samples: skip`",
        "weighting": "`weighting`",
        "terms": "entropy / KL on their own modes",
        "filter": "a filter inside the loss",
        "cp": "CP layouts",
    }


COLUMNS = ("plain", "groups", "sessions", "skip", "weighting", "terms", "filter", "cp")


def outcomes(trainer: Trainer) -> dict[str, list[tuple[Case, Answer]]]:
    """Every case of every column of ``trainer`` and its answer (:func:`ask`): each mode in its kind's column; under
    ``skip`` and as the terms' mode, each mode the trainer serves (under a setting of its own or not); each weighting
    on ``sample_mean``; the terms on two modes at once; the trainer's own cases (``extra``)."""
    kinds = mode_kinds()
    out: dict[str, list[tuple[Case, Answer]]] = {}
    served: dict[str, list[str]] = {}
    for key in ("plain", "groups", "sessions"):
        answers = [(case, ask(trainer, case)) for case in _mode_cases(kinds, key)]
        served[key] = [case.settings["mode"] for case, answer in answers if answer.served]
        out[key] = answers + [(case, ask(trainer, case)) for case in trainer.extra.get(key, ())]
    skip = [case for key in served for case in _mode_cases(served, key, empty_samples="skip")]
    weighting = [Case(f"`{w}`", settings_of("sample_mean", weighting=w), kind="weighting") for w in WEIGHTINGS if w != "none"]
    terms = [Case(f"`{m}`", with_terms(m, m), trainer.terms_knobs, kind=key) for key in served for m in served[key]]
    terms.append(Case("two modes", with_terms("token_mean", "sample_mean"), trainer.terms_knobs, kind="terms"))
    for key, cases in (("skip", skip), ("weighting", weighting), ("terms", terms), ("filter", []), ("cp", [])):
        out[key] = [(case, ask(trainer, case)) for case in (*cases, *trainer.extra.get(key, ()))]
    return out


class Notes:
    """The refusals' reasons under the table, numbered as they first appear (one number for one text)."""

    def __init__(self):
        self.numbers: dict[str, int] = {}

    def number(self, reason: str) -> int:
        return self.numbers.setdefault(reason, len(self.numbers) + 1)

    def markdown(self) -> str:
        return "\n".join(f"{n}. {text}" for text, n in self.numbers.items())


#: What every trainer is asked in a column, named as one (when more than one case), and the modes of a kind.
GENERIC = {"skip": "every mode served", "weighting": "every weighting", "terms": "entropy and KL", "filter": "every mode"}
KINDS = {"plain": "plain modes", "sessions": "session modes"}


def _named(cases: list[Case], every: list[Case], column: str) -> str:
    """The labels of ``cases`` (of ``every``, the cell's cases): the column's :data:`GENERIC` name when they are every
    case every trainer is asked there, else the modes of a kind as the kind (:data:`KINDS`) when all are there."""
    generic = [c for c in every if c.kind is not None]
    if column in GENERIC and len(generic) > 1 and cases == generic:
        return GENERIC[column]
    labels = []
    for case in cases:
        kind = case.kind if case.kind in KINDS else None
        of_kind = [c for c in every if c.kind == kind]
        if kind is not None and len(of_kind) > 1 and [c for c in cases if c.kind == kind] == of_kind:
            if KINDS[kind] not in labels:
                labels.append(KINDS[kind])
            continue
        labels.append(case.label)
    return ", ".join(labels)


def cell(answers: list[tuple[Case, Answer]], notes: Notes, column: str = "") -> str:
    """A column's answers as one cell: ``✓`` when every case is served, ``✓ with <setting>`` when every case is served
    under that setting of the trainer's, ``✗ [n]`` when every case every trainer is asked is refused for one reason
    (note ``n``), ``—`` when the column has no case; otherwise each group of cases (one answer) by name. Refusals that
    read the same but for the names of modes, totals and weightings (:func:`vocabulary_free`) are one, with the
    first one's note."""
    if not answers:
        return "—"
    groups: dict[tuple[bool, str | None], list[Case]] = {}
    first: dict[str, int] = {}
    for case, answer in answers:
        if answer.served:
            key = (True, answer.variant)
        else:
            same = vocabulary_free(answer.reason)
            if same not in first:
                first[same] = notes.number(answer.reason)
            key = (False, str(first[same]))
        groups.setdefault(key, []).append(case)
    every = [case for case, _ in answers]
    if len(groups) == 1:
        ((served, what),) = groups
        if served:
            return "✓" + (f" with {what}" if what else "")
        if all(case.kind is not None for case in every):
            return f"✗ [{what}]"
    parts = []
    for (served, what), cases in groups.items():
        named = _named(cases, every, column)
        parts.append((f"✓ {named}" + (f" with {what}" if what else "")) if served else f"✗ {named} [{what}]")
    return "; ".join(parts)


def table() -> str:
    """The markdown table of every trainer by every column, its legend and the refusals' reasons."""
    heads, notes = columns(), Notes()
    lines = [
        "| trainer | " + " | ".join(heads[key] for key in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for trainer in trainers():
        answers = outcomes(trainer)
        lines.append(f"| {trainer.name} | " + " | ".join(cell(answers[key], notes, key) for key in COLUMNS) + " |")
    kinds = mode_kinds()
    legend = (
        f"Plain modes: {', '.join(f'`{m}`' for m in kinds['plain'])}; session modes: {', '.join(f'`{m}`' for m in kinds['sessions'])}. "
        "`skip` is asked of every mode the trainer serves; `weighting` (each of them) on `sample_mean`; entropy and KL, with the "
        "trainer's own coefficients, each on every mode the trainer serves, and on two modes at once (entropy `token_mean`, KL "
        "`sample_mean`). ✓: served; ✓ with a setting: served when the trainer's setting is on; ✗ [n]: refused, for the reason "
        "numbered n below (the adapter's own words, the first of its refusal); —: the adapter takes no such setting."
    )
    return "\n".join(lines) + "\n\n" + legend + "\n\n" + notes.markdown() + "\n"


def block(text: str) -> str:
    """The generated part of a page: what lies between :data:`BEGIN` and :data:`END`."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page holds no {BEGIN} ... {END} block")
    return text[start + len(BEGIN) : end].strip("\n") + "\n"


def write(path: str) -> None:
    """Put :func:`table` between the markers of the page at ``path``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    block(text)  # the markers are there
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[:start] + "\n" + table() + text[end:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lossagg.integrations.served", description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="PAGE", help=f"put the table between the page's {BEGIN} and {END} markers")
    options = parser.parse_args(argv)
    if options.write:
        write(options.write)
    else:
        sys.stdout.write(table())


if __name__ == "__main__":
    main()
