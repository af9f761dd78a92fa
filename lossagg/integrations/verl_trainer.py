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
verl's coefficient. The step totals are the ones verl's engine hands every micro-batch: ``dp_size``,
``batch_num_tokens`` (``T``) and ``global_batch_size`` (``N``). A mode that needs another total (prompt
groups, ``L_max``), ``empty_samples: skip`` with a mode that reads ``N``, weights, and the policy losses
whose per-token loss is not one a reducer can weigh are refused by name when the loss is built.
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


def _term_modes_issues(config: LossAggregationConfig) -> list[str]:
    issues = []
    for term in config.loss_terms:
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
                f"only {' and '.join(CARRIED)}, or call lossagg.integrations.verl.agg_loss with a lossagg.StepPlan in a loss of your own"
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


def actor_config_for(config, aggregation, distillation_config=None) -> LossAggregationConfig:
    """The lossagg config of verl's actor (``config``: verl's ``ActorConfig``): ``aggregation`` with every term
    the actor reduces, checked against verl's settings; every problem named in one error."""
    aggregation = _as_config(aggregation)
    issues = _term_modes_issues(aggregation)
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


def critic_config_for(config, aggregation) -> LossAggregationConfig:
    """The lossagg config of verl's critic (``config``: verl's ``CriticConfig``): its one term, ``value``."""
    aggregation = _as_config(aggregation)
    issues = _term_modes_issues(aggregation)
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
    """The plan of this micro-batch's samples from the step totals verl's engine hands it, ``dp_size`` and the
    micro-batch's handle (all its samples)."""
    dp_size = int(data["dp_size"])
    n, t = data["global_batch_size"], data["batch_num_tokens"]
    if dp_size > 1 and (n is None or t is None):
        missing = " and ".join(name for name, value in (("global_batch_size", n), ("batch_num_tokens", t)) if value is None)
        raise ValueError(f"verl's data carries no {missing} with dp_size={dp_size}: lossagg needs the step's totals")
    counts = response_mask.sum(-1).to(torch.float64)
    plan = plan_of_batch(aggregation, counts, dp_size=dp_size, global_batch_size=n, batch_num_tokens=t)
    return plan, dp_size, plan.micro_batch(slice(None), response_mask)


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
    step = {key: data[key] for key in ("dp_size", "batch_num_tokens", "global_batch_size")}
    padded = data.select(*fields).to_padded_tensor()
    response_mask = padded["response_mask"].to(bool)
    plan, dp_size, mb = _step_plan(aggregation, response_mask, step)
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
    step = {key: data[key] for key in ("dp_size", "batch_num_tokens", "global_batch_size")}
    plan, dp_size, mb = _step_plan(aggregation, response_mask, step)
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
    step = {key: data[key] for key in ("dp_size", "batch_num_tokens", "global_batch_size")}
    padded = data.select("values", "returns", "response_mask").to_padded_tensor()
    response_mask = padded["response_mask"].to(bool)
    plan, dp_size, _ = _step_plan(aggregation, response_mask, step)
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


def actor_loss(config, aggregation, distillation_config=None):
    """The actor's loss function as verl's engine calls it (``loss_fn(model_output=, data=, dp_group=)``),
    checked when built: :func:`ppo_loss`, or :func:`distillation_ppo_loss` when ``distillation_config`` is on."""
    whole = actor_config_for(config, aggregation, distillation_config)
    if distillation_config is not None and getattr(distillation_config, "enabled", False):
        return functools.partial(distillation_ppo_loss, config=config, distillation_config=distillation_config, aggregation=whole)
    return functools.partial(ppo_loss, config=config, aggregation=whole)


def critic_loss(config, aggregation):
    """The critic's loss function as verl's engine calls it, checked when built (:func:`value_loss`)."""
    return functools.partial(value_loss, config=config, aggregation=critic_config_for(config, aggregation))


def install(trainer, aggregation) -> dict[str, Any]:
    """Hand verl's actor (and critic, when the trainer has one) lossagg's losses through the workers'
    ``set_loss_fn``. ``trainer`` is verl's ``RayPPOTrainer`` after ``init_workers()``; ``aggregation`` a
    :class:`lossagg.LossAggregationConfig` or its settings. Every check runs before anything is handed
    over (no half-installed trainer). Returns the loss functions handed over, by role."""
    from verl.utils.config import omega_conf_to_dataclass  # deferred: verl is optional

    workers = getattr(trainer, "actor_rollout_wg", None)
    if workers is None:
        raise ValueError("install(trainer, ...) needs trainer.actor_rollout_wg: call it after trainer.init_workers()")
    root = trainer.config
    actor_config = omega_conf_to_dataclass(root.actor_rollout_ref.actor)
    distillation = getattr(root, "distillation", None)
    distillation_config = omega_conf_to_dataclass(distillation) if distillation is not None and distillation.get("enabled", False) else None
    losses = {"actor": actor_loss(actor_config, aggregation, distillation_config)}
    if getattr(trainer, "use_critic", False):
        losses["critic"] = critic_loss(omega_conf_to_dataclass(root.critic), aggregation)
    workers.set_loss_fn(losses["actor"])
    if "critic" in losses:
        trainer.critic_wg.set_loss_fn(losses["critic"])
    return losses
