"""verl's trainer, whole (verl 0.9.1): every term its actor and critic reduce goes through lossagg, each on
its own mode, installed through verl's own extension point (the workers' ``set_loss_fn``); nothing of
verl is patched.

One call, after ``trainer.init_workers()``::

    from lossagg.integrations.verl import install
    install(trainer, {"mode": "sample_mean", "terms": {"kl": {"mode": "token_mean", "coefficient": 0.001}}})

The actor's loss (:func:`ppo_loss`, or :func:`distillation_ppo_loss` when verl's distillation is on)
and the critic's (:func:`value_loss`) keep verl's signatures, per-token arithmetic, coefficients and
metrics; what changes is each term's reducer:

* **pg** (the config's ``mode``): verl's own policy loss function (``policy_loss.loss_mode``) computes
  the per-token loss; lossagg's ``d[i]`` reach it as its per-token weights (``plan.token_weights`` as
  ``rollout_is_weights``, times verl's own when rollout correction is on) with verl's ``token-sum``
  reducer, so the sum it takes is ``Σ_i S_i / d[i]``. Its metrics are verl's, unweighted.
* **entropy** (coefficient ``-entropy_coeff``), **kl** (``kl_loss_coef``, under ``use_kl_loss``) and
  **distillation** (``distillation_loss_coef``, or 1 without task rewards): the per-token values verl
  computes (the model's entropy, ``kl_penalty``, the distillation loss function), each reduced through
  the micro-batch handle on the term's mode (``plan.loss(values, mb, terms=name, coefficients=False)``).
* **value** (the critic's, coefficient 0.5, verl's factor): verl's ``compute_value_loss`` per token,
  with the term's ``m[t] / d[i]`` (``plan.token_weights``) as its mask weights under ``token-sum``; its clip fraction is taken
  with verl's own 0/1 mask.

A term the config does not name gets the default reducer (docs/terms.md); a term it names must carry
verl's coefficient. Two ways in:

* :func:`install` (after ``init_workers``): the step totals are the ones verl's engine hands every
  micro-batch: ``dp_size``, ``batch_num_tokens`` (``T``) and ``global_batch_size`` (``N``). A mode that
  needs another total (prompt groups, ``L_max``, sessions), ``empty_samples: skip`` with a mode that reads
  ``N``, and weights are refused by name when the loss is built.
* :func:`lossagg_trainer` (``lossagg_trainer(RayPPOTrainer)(..., loss_aggregation=config)``): every mode.
  The step is whole on verl's driver before it is dispatched: for each optimizer step (a PPO mini-batch,
  as verl's dispatch and its workers' mini-batch iterator cut it) a :class:`lossagg.StepPlan` is made
  there from every sample's response mask, its prompt (verl's ``uid``, the id verl's GRPO advantage
  groups by), its session and its weight, and each sample's ``d_k[i]`` travel with the batch
  (``lossagg_denoms``) to the micro-batches, where ``StepPlan.from_denoms`` reduces them through the
  micro-batch handle.

Either way, the policy losses whose per-token loss is not one a reducer can weigh are refused by name.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch

from lossagg.config import LossAggregationConfig
from lossagg.config.model import PG_TERM
from lossagg.step import StepPlan, gradient_scale
from lossagg.totals import mode_totals
from lossagg.validate import as_int, as_number

# verl's registered policy losses whose per-token loss lossagg weighs: each multiplies its per-token loss by
# rollout_is_weights and reduces it with agg_loss under the loss_agg_mode it is given (verl 0.9.1,
# verl/trainer/ppo/core_algos.py)
SERVED_POLICY_LOSSES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "gpg", "dro", "cispo")
REFUSED_POLICY_LOSSES = {
    "sapo": "reduces its loss by seq-mean-token-mean whatever loss_agg_mode says, so no other reducer reaches it",
    "geo_mean": "takes the micro-batch's mean of one loss per sequence (torch.mean), not a per-token loss a reducer weighs, "
    "so its number changes with the micro-batch split",
    "clip_cov": "picks the tokens it clips from the micro-batch's own covariance statistics, so its per-token loss changes with the split",
    "kl_cov": "picks the tokens it penalises from the micro-batch's own covariance statistics, so its per-token loss changes with the split",
    "bypass_mode": "computes its own importance weights and rejection mask inside and ignores rollout_is_weights, "
    "where lossagg's per-sample weights travel",
}
ACTOR_TERMS = ("entropy", "kl", "distillation")
CRITIC_TERMS = ("value",)
VALUE_COEFFICIENT = 0.5  # verl's compute_value_loss: 0.5 * agg_loss(...)
# the step totals verl's engine hands the loss of every micro-batch, and their names there
CARRIED = {"num_samples": "global_batch_size", "total_tokens": "batch_num_tokens"}
# what lossagg_trainer's driver adds to each sample of the batch: d_k[i] of every term (config.loss_terms' order), w_i
DENOMS_KEY, WEIGHTS_KEY = "lossagg_denoms", "lossagg_weights"


class VerlConfigError(ValueError):
    """A lossagg config that verl's trainer cannot serve, or a verl setting that contradicts it: names both."""


def _as_config(aggregation) -> LossAggregationConfig:
    if isinstance(aggregation, LossAggregationConfig):
        return aggregation
    if isinstance(aggregation, Mapping):
        return LossAggregationConfig.from_dict(dict(aggregation))
    raise TypeError(f"aggregation must be a lossagg.LossAggregationConfig or a mapping of its settings, got {type(aggregation).__name__}")


def _policy_loss_issue(setting: str, loss_mode: str) -> str | None:
    if loss_mode in SERVED_POLICY_LOSSES:
        return None
    if loss_mode in REFUSED_POLICY_LOSSES:
        return f"{setting}={loss_mode!r} {REFUSED_POLICY_LOSSES[loss_mode]}: use one of {', '.join(SERVED_POLICY_LOSSES)}"
    return (
        f"{setting}={loss_mode!r} is not one of verl's policy losses lossagg weighs ({', '.join(SERVED_POLICY_LOSSES)}): "
        "a loss of your own must multiply its per-token loss by rollout_is_weights and reduce it with agg_loss under loss_agg_mode"
    )


def _term_modes_issues(config: LossAggregationConfig, planned: bool = False) -> list[str]:
    """What verl's engine cannot hand the loss; nothing when the step is planned on the driver (``planned``)."""
    issues = []
    for term in config.loss_terms if not planned else ():
        name, mode, weighting = term.name, term.mode, term.weighting
        where = "mode" if name == PG_TERM else f"terms.{name}.mode"
        if weighting != "none":
            what = "weighting" if name == PG_TERM else f"terms.{name}.weighting"
            issues.append(f"{what}={weighting} needs per-sample weights, which verl's trainer does not hand to its loss: drop it")
        needed = mode_totals(term.spec.totals, config.empty_samples)
        uncarried = [total for total in needed if total not in CARRIED]
        if uncarried:
            skipped = f" with empty_samples={config.empty_samples}" if config.empty_samples != "count" else ""
            issues.append(
                f"{where}={mode}{skipped} needs the step total(s) {', '.join(uncarried)}, which verl's engine does not hand its loss "
                f"(it passes dp_size, batch_num_tokens and global_batch_size, the last counting every sample): choose a mode that reads "
                f"only {' and '.join(CARRIED)}, or plan the step on verl's driver: lossagg_trainer(RayPPOTrainer)"
            )
    return issues


def _coefficient_issue(config: LossAggregationConfig, name: str, own: float, how: str) -> str | None:
    term = config.terms.get(name)
    if term is None or float(term.coefficient) == float(own):
        return None
    return f"terms.{name}.coefficient is {term.coefficient}, verl applies {how} = {own}: make them agree"


def _whole(config: LossAggregationConfig, terms: dict[str, float]) -> LossAggregationConfig:
    """The config with every term the trainer reduces: the named ones as given, the others on the default reducer."""
    settings = config.model_dump(exclude_none=True)
    named = settings.get("terms", {})
    settings["terms"] = {name: named.get(name, {"coefficient": coefficient}) for name, coefficient in terms.items()}
    return LossAggregationConfig.from_dict(settings)


def _check(issues: list[str], what: str) -> None:
    if issues:
        raise VerlConfigError(f"lossagg cannot serve {what}:\n" + "\n".join(f"- {issue}" for issue in issues))


def actor_config_for(config, aggregation, distillation_config=None, *, planned: bool = False) -> LossAggregationConfig:
    """The lossagg config of verl's actor (``config``: verl's ``ActorConfig``): ``aggregation`` with every term
    the actor reduces, checked against verl's settings (``planned``: the step is planned on the driver,
    :func:`lossagg_trainer`); every problem named in one error."""
    aggregation = _as_config(aggregation)
    issues = _term_modes_issues(aggregation, planned)
    policy = config.policy_loss.get("loss_mode", "vanilla") if config.policy_loss is not None else "vanilla"
    found = _policy_loss_issue("actor.policy_loss.loss_mode", policy)
    issues += [found] if found else []
    if getattr(config, "loss_scale_factor", None) is not None:
        issues.append(
            f"actor.loss_scale_factor={config.loss_scale_factor} is the divisor of verl's seq-mean-token-sum-norm, which lossagg's config replaces "
            "(its divisor setting): unset it"
        )
    for setting, value in (("actor.entropy_coeff", config.entropy_coeff), ("actor.kl_loss_coef", config.kl_loss_coef)):
        if not math.isfinite(float(value)):  # named as the actor's setting, before it becomes a term's coefficient
            _check([f"{setting}={value!r} must be a finite number (it is the coefficient of a term of the loss)"], "verl's actor")
    terms = {"entropy": -float(config.entropy_coeff)}
    if config.use_kl_loss:
        terms["kl"] = float(config.kl_loss_coef)
    distilling = distillation_config is not None and getattr(distillation_config, "enabled", False)
    if distilling:
        loss_config = distillation_config.distillation_loss
        if not math.isfinite(float(loss_config.distillation_loss_coef)):
            coef = loss_config.distillation_loss_coef
            _check([f"distillation.distillation_loss.distillation_loss_coef={coef!r} must be a finite number"], "verl's actor")
        terms["distillation"] = float(loss_config.distillation_loss_coef) if loss_config.use_task_rewards else 1.0
        if loss_config.use_policy_gradient:
            found = _policy_loss_issue("distillation.distillation_loss.policy_loss_mode", loss_config.policy_loss_mode)
            issues += [found] if found else []
    for name in aggregation.terms:
        if name in CRITIC_TERMS:
            continue  # the critic's, for a config handed to both
        if name not in ACTOR_TERMS:
            issues.append(f"terms.{name}: verl's actor reduces the terms {', '.join(ACTOR_TERMS)} besides pg; name one of them")
        elif name not in terms:
            why = {"kl": "use_kl_loss is off", "distillation": "distillation is off"}.get(name, "")
            issues.append(f"terms.{name}: verl's actor does not add this term here ({why})")
    hows = {"entropy": "-entropy_coeff", "kl": "kl_loss_coef", "distillation": "distillation_loss_coef (1 without task rewards)"}
    for name, own in terms.items():
        found = _coefficient_issue(aggregation, name, own, hows[name])
        issues += [found] if found else []
    _check(issues, "verl's actor")
    return _whole(aggregation, terms)


def critic_config_for(config, aggregation, *, planned: bool = False) -> LossAggregationConfig:
    """The lossagg config of verl's critic (``config``: verl's ``CriticConfig``): its one term, ``value``."""
    aggregation = _as_config(aggregation)
    issues = _term_modes_issues(aggregation, planned)
    for name in aggregation.terms:
        if name not in CRITIC_TERMS + ACTOR_TERMS:
            issues.append(f"terms.{name}: verl's critic reduces the term value only; name it")
    if getattr(config, "loss_scale_factor", None) is not None:
        issues.append(f"critic.loss_scale_factor={config.loss_scale_factor} is verl's divisor of seq-mean-token-sum-norm: unset it")
    found = _coefficient_issue(aggregation, "value", VALUE_COEFFICIENT, "0.5 (compute_value_loss's factor)")
    issues += [found] if found else []
    _check(issues, "verl's critic")
    return _whole(aggregation, {"value": VALUE_COEFFICIENT})


# ------------------------------------------------------------------ the micro-batch


def plan_of_batch(
    config: LossAggregationConfig,
    counts: torch.Tensor,
    *,
    dp_size: int,
    global_batch_size=None,
    batch_num_tokens=None,
    group_index: torch.Tensor | None = None,
    session_index: torch.Tensor | None = None,
) -> StepPlan:
    """The step's plan from what verl's engine hands a micro-batch's loss (the one place verl's global-batch
    information becomes a plan, for ``agg_loss`` and the trainer's losses): with ``dp_size`` 1 and no
    global-batch argument the micro-batch is the whole step (a :class:`lossagg.StepPlan` of its own
    samples, as verl computes it then); otherwise ``global_batch_size`` is the step's ``N`` and
    ``batch_num_tokens`` its ``T`` (``StepPlan.from_totals``, each checked against the micro-batch's own
    ``counts``). A mode that needs a total verl does not carry is refused, naming it."""
    if dp_size == 1 and batch_num_tokens is None and global_batch_size is None:
        return StepPlan(config, counts, group_index=group_index, session_index=session_index)
    check_carried(config, dp_size, global_batch_size, batch_num_tokens)
    totals = {}
    if global_batch_size is not None:
        n = as_int("global_batch_size", global_batch_size, minimum=0)
        if n < counts.shape[0]:
            raise ValueError(f"global_batch_size (the step's samples) must be >= this micro-batch's {counts.shape[0]}, got {global_batch_size!r}")
        totals["num_samples"] = n
    if batch_num_tokens is not None:
        t = as_number("batch_num_tokens", batch_num_tokens, positive=False)
        if t < float(counts.sum()):
            raise ValueError(
                f"batch_num_tokens (the step's valid tokens) must be >= this micro-batch's {float(counts.sum()):g}, got {batch_num_tokens!r}"
            )
        totals["total_tokens"] = t
    return StepPlan.from_totals(config, counts, **totals)


def check_carried(config: LossAggregationConfig, dp_size: int, global_batch_size, batch_num_tokens) -> None:
    """With verl's global-batch arguments, every step total the config's terms read is one verl carries and was given."""
    needed = mode_totals(tuple(t for term in config.loss_terms for t in term.spec.totals), config.empty_samples)
    uncarried = [total for total in needed if total not in CARRIED]
    if uncarried:
        skipped = f" (with empty_samples={config.empty_samples})" if config.empty_samples != "count" else ""
        raise ValueError(
            f"loss_agg_mode={config.mode}{skipped} needs the step total(s) {', '.join(uncarried)}, which verl's agg_loss arguments do not carry: "
            "use it where the micro-batch is its rank's whole step (dp_size=1, no global-batch arguments), or build a lossagg.StepPlan over the step"
        )
    given = {"num_samples": global_batch_size, "total_tokens": batch_num_tokens}
    missing = [f"{CARRIED[total]} (the step's {total})" for total in needed if given[total] is None]
    if missing:
        raise ValueError(f"loss_agg_mode={config.mode} with dp_size={dp_size} or other global-batch arguments needs {' and '.join(missing)}")


def _step_plan(aggregation: LossAggregationConfig, response_mask: torch.Tensor, data) -> tuple[StepPlan, int, object]:
    """The plan of this micro-batch's samples: the ``d_k[i]`` the driver planned (:func:`lossagg_trainer`), else
    from the step totals verl's engine hands it; ``dp_size`` and the micro-batch's handle (all its samples)."""
    dp_size = int(data["dp_size"])
    if DENOMS_KEY in data.keys():
        plan, mb = _carried_plan(aggregation, response_mask, data)
        return plan, dp_size, mb
    if _term_modes_issues(aggregation):
        raise ValueError(
            f"verl's data carries no {DENOMS_KEY!r}: this loss's config needs the step planned on verl's driver, "
            "by lossagg_trainer(RayPPOTrainer) (lossagg.integrations.verl_trainer)"
        )
    n, t = data["global_batch_size"], data["batch_num_tokens"]
    if dp_size > 1 and (n is None or t is None):
        missing = " and ".join(name for name, value in (("global_batch_size", n), ("batch_num_tokens", t)) if value is None)
        raise ValueError(f"verl's data carries no {missing} with dp_size={dp_size}: lossagg needs the step's totals")
    counts = response_mask.sum(-1).to(torch.float64)
    plan = plan_of_batch(aggregation, counts, dp_size=dp_size, global_batch_size=n, batch_num_tokens=t)
    return plan, dp_size, plan.micro_batch(slice(None), response_mask)


def _carried_plan(aggregation: LossAggregationConfig, response_mask: torch.Tensor, data):
    """The micro-batch's plan and handle from the ``d_k[i]`` (and ``w_i``) the driver's plan gave its samples."""
    denoms, names = data[DENOMS_KEY], [t.name for t in aggregation.loss_terms]
    if denoms.dim() != 2 or denoms.shape != (response_mask.shape[0], len(names)):
        raise ValueError(
            f"verl's data[{DENOMS_KEY!r}] must hold d_k[i] of this loss's terms ({', '.join(names)}) for each of its "
            f"{response_mask.shape[0]} samples, got shape {tuple(denoms.shape)}: the driver planned another config"
        )
    weights = data[WEIGHTS_KEY] if WEIGHTS_KEY in data.keys() else None
    plan = StepPlan.from_denoms({name: denoms[:, k] for k, name in enumerate(names)}, config=aggregation, sample_weights=weights)
    return plan, plan.micro_batch(slice(None), response_mask)


def _term(plan: StepPlan, mb, name: str, values: torch.Tensor, dp_size: int) -> torch.Tensor:
    """Term ``name``'s share of its ``J_k`` (before its coefficient, which verl applies), times ``dp_size`` as
    verl's losses are (DDP and FSDP average the gradients over DP)."""
    return plan.loss(values, mb, terms=name, coefficients=False) * gradient_scale("mean", dp_size=dp_size)


def _sample_weights(plan: StepPlan, name: str, dp_size: int, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``dp_size / d_k[i]`` of term ``name`` as per-token weights of the micro-batch (``plan.token_weights``)."""
    return plan.token_weights(mask, slice(None), convention="mean", dp_size=dp_size, dtype=like.dtype, term=name)


class _GlobalInfo:
    """verl's policy losses read ``config.global_batch_info`` as agg_loss's keywords: for lossagg's weighted
    token sum it says one process, no step totals, for the call; verl's own values come back after."""

    def __init__(self, config):
        self.config = config

    def __enter__(self):
        self.saved = dict(self.config.global_batch_info)
        self.config.global_batch_info.clear()
        self.config.global_batch_info["dp_size"] = 1
        return self

    def __exit__(self, *exc):
        self.config.global_batch_info.clear()
        self.config.global_batch_info.update(self.saved)
        return False


def _weighted_policy_loss(loss_mode, weights, *, config, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights):
    """verl's policy loss ``loss_mode`` with lossagg's per-sample weights: its per-token loss times
    ``weights`` (and verl's rollout weights), summed over the 0/1 mask by verl's token-sum."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn  # deferred: verl is optional

    if rollout_is_weights is not None:
        weights = weights * rollout_is_weights
    with _GlobalInfo(config):
        return get_policy_loss_fn(loss_mode)(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=advantages,
            response_mask=response_mask,
            loss_agg_mode="token-sum",
            config=config,
            rollout_is_weights=weights,
        )


def _metric_aggregation():
    """Each micro-batch's loss is its share of the step's: the shares add up (verl's own rule with step totals)."""
    from verl.utils.metric import AggregationType  # deferred: verl is optional

    return AggregationType.SUM


def ppo_loss(config, model_output, data, dp_group=None, *, aggregation: LossAggregationConfig):
    """verl's ``ppo_loss`` (``verl/workers/utils/losses.py``) with every term on its lossagg mode.
    ``aggregation`` is :func:`actor_config_for`'s config (every term the actor reduces)."""
    from verl.trainer.ppo.core_algos import kl_penalty  # deferred: verl is optional
    from verl.utils.metric import AggregationType, Metric  # deferred: verl is optional
    from verl.workers.utils.padding import no_padding_2_padding  # deferred: verl is optional

    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    entropy = model_output.get("entropy", None)
    if entropy is not None:
        entropy = no_padding_2_padding(entropy, data)
    aggregate = _metric_aggregation()
    fields = ["response_mask", "old_log_probs", "advantages"] + [f for f in ("rollout_is_weights", "ref_log_prob") if f in data]
    padded = data.select(*fields).to_padded_tensor()
    response_mask = padded["response_mask"].to(bool)
    plan, dp_size, mb = _step_plan(aggregation, response_mask, data)
    policy = config.policy_loss.get("loss_mode", "vanilla")
    pg_loss, pg_metrics = _weighted_policy_loss(
        policy,
        _sample_weights(plan, PG_TERM, dp_size, response_mask, log_prob),
        config=config,
        old_log_prob=padded["old_log_probs"],
        log_prob=log_prob,
        advantages=padded["advantages"],
        response_mask=response_mask,
        rollout_is_weights=padded.get("rollout_is_weights", None),
    )
    metrics = dict(Metric.from_dict(pg_metrics, aggregation=AggregationType.MEAN))
    metrics["actor/pg_loss"] = Metric(value=pg_loss, aggregation=aggregate)
    policy_loss = pg_loss
    if entropy is not None:
        entropy_loss = _term(plan, mb, "entropy", entropy, dp_size)
        policy_loss = policy_loss - config.entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = Metric(value=entropy_loss, aggregation=aggregate)
    if config.use_kl_loss:
        kld = kl_penalty(logprob=log_prob, ref_logprob=padded["ref_log_prob"], kl_penalty=config.kl_loss_type)
        kl_loss = _term(plan, mb, "kl", kld, dp_size)
        policy_loss = policy_loss + kl_loss * config.kl_loss_coef
        metrics["kl_loss"] = Metric(value=kl_loss, aggregation=aggregate)
        metrics["kl_coef"] = config.kl_loss_coef
    return policy_loss, metrics


def _distillation_loss(config, distillation_config, model_output, data, *, aggregation):
    """verl's ``distillation_loss`` (``verl/trainer/distillation/losses.py``) on the term ``distillation``'s mode."""
    from verl.trainer.distillation.losses import compute_distillation_loss_range, get_distillation_loss_fn  # deferred: verl is optional

    loss_config = distillation_config.distillation_loss
    losses, metrics = get_distillation_loss_fn(loss_config.loss_mode)(
        config=config, distillation_config=distillation_config, model_output=model_output, data=data
    )
    response_mask = data["response_mask"]
    metrics.update(compute_distillation_loss_range(distillation_losses=losses, response_mask=response_mask))
    if loss_config.loss_max_clamp is not None:
        losses = losses.clamp(min=-loss_config.loss_max_clamp, max=loss_config.loss_max_clamp)
    if response_mask.is_nested:
        response_mask = response_mask.to_padded_tensor(False)
    response_mask = response_mask.to(bool)
    plan, dp_size, mb = _step_plan(aggregation, response_mask, data)
    if not loss_config.use_policy_gradient:
        return _term(plan, mb, "distillation", losses, dp_size), metrics
    from verl.workers.utils.padding import no_padding_2_padding  # deferred: verl is optional

    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    old_log_prob = data["old_log_probs"]
    if old_log_prob.is_nested:
        old_log_prob = old_log_prob.to_padded_tensor(0.0)
    loss, pg_metrics = _weighted_policy_loss(
        loss_config.policy_loss_mode,
        _sample_weights(plan, "distillation", dp_size, response_mask, log_prob),
        config=loss_config,
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=-losses.detach(),
        response_mask=response_mask,
        rollout_is_weights=data.get("rollout_is_weights", None),
    )
    metrics.update({f"distillation/{k[len('actor/') :]}": v for k, v in pg_metrics.items()})
    return loss, metrics


def distillation_ppo_loss(
    config, distillation_config, model_output=None, data=None, dp_group=None, student_logits=None, data_format: str = "thd", *, aggregation
):
    """verl's ``distillation_ppo_loss`` with the distillation term and the policy loss on their lossagg modes.
    Called as verl's logits processor (``student_logits`` given), it is verl's own: per-token, no reducer."""
    from verl.trainer.distillation.losses import distillation_ppo_loss as verls  # deferred: verl is optional
    from verl.utils.metric import AggregationType, Metric  # deferred: verl is optional

    if student_logits is not None:
        return verls(config, distillation_config, model_output, data, dp_group, student_logits, data_format)
    loss_config = distillation_config.distillation_loss
    distill_loss, distill_metrics = _distillation_loss(config, distillation_config, model_output, data, aggregation=aggregation)
    if not loss_config.use_task_rewards and not loss_config.use_policy_gradient:
        policy_loss, policy_metrics = 0.0, {}
    else:
        policy_loss, policy_metrics = ppo_loss(config, model_output, data, dp_group, aggregation=aggregation)
        if not loss_config.use_task_rewards:
            policy_loss = 0.0
    policy_metrics.update(distill_metrics)
    coefficient = loss_config.distillation_loss_coef if loss_config.use_task_rewards else 1.0
    policy_loss = policy_loss + distill_loss * coefficient
    policy_metrics["distillation/loss"] = Metric(value=distill_loss, aggregation=AggregationType.SUM)
    return policy_loss, policy_metrics


def value_loss(config, model_output, data, dp_group=None, *, aggregation: LossAggregationConfig):
    """verl's ``value_loss`` (``verl/workers/utils/losses.py``) on the term ``value``'s mode."""
    from verl.trainer.ppo.core_algos import compute_value_loss  # deferred: verl is optional
    from verl.utils.metric import Metric  # deferred: verl is optional
    from verl.utils.torch_functional import masked_mean  # deferred: verl is optional
    from verl.workers.utils.padding import no_padding_2_padding  # deferred: verl is optional

    vpreds = no_padding_2_padding(model_output["values"], data)
    padded = data.select("values", "returns", "response_mask").to_padded_tensor()
    response_mask = padded["response_mask"].to(bool)
    plan, dp_size, _ = _step_plan(aggregation, response_mask, data)
    weights = _sample_weights(plan, "value", dp_size, response_mask, vpreds) * response_mask
    common = {"vpreds": vpreds, "values": padded["values"], "returns": padded["returns"], "cliprange_value": config.cliprange_value}
    # compute_value_loss returns 0.5 * Σ m·w·l under token-sum: the term with its coefficient, as verl's
    vf_loss, _ = compute_value_loss(response_mask=weights, loss_agg_mode="token-sum", **common)
    with torch.no_grad():
        _, vf_clipfrac = compute_value_loss(response_mask=response_mask, loss_agg_mode="token-sum", **common)
    metrics = {
        "critic/vf_loss": Metric(value=vf_loss, aggregation=_metric_aggregation()),
        "critic/vf_clipfrac": vf_clipfrac.detach().item(),
        "critic/vpred_mean": masked_mean(vpreds, response_mask).detach().item(),
    }
    return vf_loss, metrics


# ------------------------------------------------------------------ installing


def actor_loss(config, aggregation, distillation_config=None, *, planned: bool = False):
    """The actor's loss function as verl's engine calls it (``loss_fn(model_output=, data=, dp_group=)``),
    checked when built: :func:`ppo_loss`, or :func:`distillation_ppo_loss` when ``distillation_config`` is on."""
    whole = actor_config_for(config, aggregation, distillation_config, planned=planned)
    if distillation_config is not None and getattr(distillation_config, "enabled", False):
        return functools.partial(distillation_ppo_loss, config=config, distillation_config=distillation_config, aggregation=whole)
    return functools.partial(ppo_loss, config=config, aggregation=whole)


def critic_loss(config, aggregation, *, planned: bool = False):
    """The critic's loss function as verl's engine calls it, checked when built (:func:`value_loss`)."""
    return functools.partial(value_loss, config=config, aggregation=critic_config_for(config, aggregation, planned=planned))


def _losses(trainer, aggregation, planned: bool) -> dict[str, Any]:
    """The actor's (and the critic's, when the trainer has one) loss functions for verl's trainer ``trainer``."""
    from verl.utils.config import omega_conf_to_dataclass  # deferred: verl is optional

    root = trainer.config
    distillation = getattr(root, "distillation", None)
    distillation_config = omega_conf_to_dataclass(distillation) if distillation is not None and distillation.get("enabled", False) else None
    losses = {"actor": actor_loss(omega_conf_to_dataclass(root.actor_rollout_ref.actor), aggregation, distillation_config, planned=planned)}
    if getattr(trainer, "use_critic", False):
        losses["critic"] = critic_loss(omega_conf_to_dataclass(root.critic), aggregation, planned=planned)
    return losses


def _hand_over(trainer, losses: dict[str, Any]) -> None:
    trainer.actor_rollout_wg.set_loss_fn(losses["actor"])
    if "critic" in losses:
        trainer.critic_wg.set_loss_fn(losses["critic"])


def install(trainer, aggregation) -> dict[str, Any]:
    """Hand verl's actor (and critic, when the trainer has one) lossagg's losses through the workers'
    ``set_loss_fn``, with the step totals verl's engine carries. ``trainer`` is verl's ``RayPPOTrainer``
    after ``init_workers()``; ``aggregation`` a :class:`lossagg.LossAggregationConfig` or its settings.
    Every check runs before anything is handed over (no half-installed trainer). Returns the loss
    functions handed over, by role. Every mode: :func:`lossagg_trainer`."""
    if getattr(trainer, "actor_rollout_wg", None) is None:
        raise ValueError("install(trainer, ...) needs trainer.actor_rollout_wg: call it after trainer.init_workers()")
    losses = _losses(trainer, aggregation, planned=False)
    _hand_over(trainer, losses)
    return losses


# ------------------------------------------------------------------ the step planned on the driver


def step_of_rows(num_rows: int, mini_batch_size: int, dp_size: int) -> torch.Tensor:
    """The optimizer step (PPO mini-batch) of each row of verl's batch: the dispatch hands DP rank ``r`` the
    ``r``-th of ``dp_size`` equal consecutive chunks, and each rank's iterator cuts its chunk, unshuffled,
    into consecutive mini-batches of ``mini_batch_size / dp_size`` rows (``train_mini_batch``); the ``j``-th
    of every rank make step ``j``."""
    n, m, dp = (
        as_int("the batch's rows", num_rows, minimum=1),
        as_int("mini_batch_size", mini_batch_size, minimum=1),
        as_int("dp_size", dp_size, minimum=1),
    )
    if n % dp or m % dp or (n // dp) % (m // dp):
        raise ValueError(
            f"verl's batch of {n} rows must split into {dp} equal DP chunks, each a whole number of mini-batches of "
            f"mini_batch_size / dp_size = {m} / {dp} rows, as verl's dispatch and mini-batch iterator require"
        )
    return (torch.arange(n) % (n // dp)) // (m // dp)


def _labels(values) -> torch.Tensor:
    """Integer labels of a per-row key of verl's batch (strings, as ``uid``, or numbers)."""
    import numpy as np  # deferred: verl's non-tensor batch is numpy

    return torch.from_numpy(np.unique(np.asarray(values), return_inverse=True)[1].reshape(-1).astype(np.int64))


def plan_batch(batch, aggregation: LossAggregationConfig, *, mini_batch_size: int, dp_size: int, weights_key=None, session_key=None) -> None:
    """Plan every optimizer step of verl's ``batch`` (a ``DataProto``, whole on the driver) and add each sample's
    ``d_k[i]`` (``lossagg_denoms``, ``[rows, K]`` float64, ``config.loss_terms``' order) and ``w_i``
    (``lossagg_weights``, when a term weighs its samples) to it. A prompt group is the rows of one ``uid``;
    a session the rows of one ``batch.non_tensor_batch[session_key]`` (with no key, each row: one trajectory
    is one sample in verl's agent loop); weights are ``batch.batch[weights_key]``."""
    td, extra = batch.batch, batch.non_tensor_batch
    terms = aggregation.loss_terms
    wanted = [("uid", extra, any(t.spec.needs_groups for t in terms)), (session_key, extra, session_key is not None)]
    wanted += [("response_mask", td, True), (weights_key, td, weights_key is not None)]
    missing = [f"{key!r}" for key, where, needed in wanted if needed and key not in where.keys()]
    if missing:
        raise ValueError(f"verl's batch has no {' or '.join(missing)}, which the plan of mode={aggregation.mode} with these keys reads")
    counts = td["response_mask"].to(torch.float64).sum(-1)
    steps = step_of_rows(counts.shape[0], mini_batch_size, dp_size)
    groups = _labels(extra["uid"]) if any(t.spec.needs_groups for t in terms) else None
    sessions = None
    if any(t.spec.needs_sessions for t in terms):
        sessions = _labels(extra[session_key]) if session_key is not None else torch.arange(counts.shape[0])
    weights = td[weights_key].to(torch.float64).reshape(-1) if weights_key is not None else None
    denoms = torch.empty(counts.shape[0], len(terms), dtype=torch.float64)
    for step in range(int(steps.max()) + 1):
        rows = (steps == step).nonzero().reshape(-1)
        plan = StepPlan(
            aggregation,
            counts[rows],
            group_index=None if groups is None else groups[rows],
            session_index=None if sessions is None else sessions[rows],
            sample_weights=None if weights is None else weights[rows],
        )
        denoms[rows] = torch.stack([plan.term_denoms[t.name] for t in terms], 1)
    td[DENOMS_KEY] = denoms
    if weights is not None:
        td[WEIGHTS_KEY] = weights


def _dp_size(worker_group) -> int:
    """The DP size verl's dispatch splits a batch for (``dispatch_lazy_compute_data_proto``: the largest DP
    rank of the worker group's ``train`` mesh, plus one)."""
    if "train" not in worker_group._dispatch_info:
        worker_group._dispatch_info["train"] = worker_group._query_dispatch_info("train")
    return max(worker_group._dispatch_info["train"]) + 1


def lossagg_trainer(base: type) -> type:
    """verl's trainer class ``base`` (``RayPPOTrainer`` or a subclass) with every term of the loss on its lossagg
    mode, every mode served: the step planned on the driver (:func:`plan_batch`) before ``_update_actor`` and
    ``_update_critic`` dispatch it, the workers' losses handed over after ``init_workers``. Built as
    ``lossagg_trainer(RayPPOTrainer)(..., loss_aggregation=config, sample_weights_key=None, session_key=None)``;
    every refusal is raised when it is built, before anything starts."""

    class LossaggTrainer(base):
        def __init__(self, *args, loss_aggregation, sample_weights_key: str | None = None, session_key: str | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_aggregation = _as_config(loss_aggregation)
            self._lossagg_keys = {"weights_key": sample_weights_key, "session_key": session_key}
            self._lossagg_losses = _losses(self, self.loss_aggregation, planned=True)
            roles = {"actor": self.config.actor_rollout_ref.actor, "critic": getattr(self.config, "critic", None)}
            issues = [
                f"{role}.shuffle=True: each rank draws its mini-batches after the dispatch, where the driver cannot plan them; "
                "set it false, or install(trainer, config) for a mode that reads only N and T"
                for role in self._lossagg_losses
                if roles[role].get("shuffle", False)
            ]
            weighted = any(t.weighting != "none" for t in self.loss_aggregation.loss_terms)
            if weighted != (sample_weights_key is not None):
                issues.append(
                    "a term's weighting needs sample_weights_key (the batch's per-sample weights)"
                    if weighted
                    else f"sample_weights_key={sample_weights_key!r} is given but no term of the config weighs its samples"
                )
            n = self.loss_aggregation.n_samples_per_prompt
            if n is not None and n != self.config.actor_rollout_ref.rollout.n:
                issues.append(f"n_samples_per_prompt={n} but verl's rollout.n is {self.config.actor_rollout_ref.rollout.n}: make them agree")
            _check(issues, "verl's trainer")

        def init_workers(self):
            super().init_workers()
            _hand_over(self, self._lossagg_losses)

        def _plan(self, batch, role: str, worker_group, mini_batch_size: int) -> None:
            aggregation = self._lossagg_losses[role].keywords["aggregation"]
            size = mini_batch_size * self.config.actor_rollout_ref.rollout.n
            plan_batch(batch, aggregation, mini_batch_size=size, dp_size=_dp_size(worker_group), **self._lossagg_keys)

        def _update_actor(self, batch):
            self._plan(batch, "actor", self.actor_rollout_wg, self.config.actor_rollout_ref.actor.ppo_mini_batch_size)
            return super()._update_actor(batch)

        def _update_critic(self, batch):
            self._plan(batch, "critic", self.critic_wg, self.config.critic.ppo_mini_batch_size)
            return super()._update_critic(batch)

    LossaggTrainer.__name__ = LossaggTrainer.__qualname__ = f"Lossagg{base.__name__}"
    return LossaggTrainer
