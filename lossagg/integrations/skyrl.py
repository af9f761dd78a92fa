"""SkyRL's trainer with the policy loss reduced by lossagg (read against and tested with SkyRL 0.4.0).

SkyRL folds its ``trainer.algorithm.loss_reduction`` into the advantages on the driver: for each
mini-batch (one optimizer step) ``RayPPOTrainer._normalize_advantages`` scales every token's
advantage by its reduction weight (``apply_loss_reduction_to_advantages_minibatch``), and the policy
workers take a plain masked sum of the per-token loss, times the DP size that their engine's
averaging divides away (``workers/worker.py``): a sum over the mini-batch, ``convention="sum"``.
:func:`lossagg_trainer` subclasses SkyRL's trainer and replaces only that folding: per mini-batch,
``StepPlan.from_mask(config, loss_mask, group_index=<prompt of each row>, session_index=<trajectory
of each row, step-wise>)`` and ``advantages *= plan.token_weights(..., convention="sum")``, after
SkyRL's own optional z-score (``advantage_batch_normalize``), as SkyRL orders them. Nothing of SkyRL
is patched; the switch is SkyRL's own extension point, ``BasePPOExp.get_trainer``::

    from skyrl.train.trainer import RayPPOTrainer
    from lossagg.integrations.skyrl import lossagg_trainer

    class Exp(BasePPOExp):
        def get_trainer(self, cfg, tracker, tokenizer, train_dataset, eval_dataset, inference_engine_client, generator, colocate_pg):
            return lossagg_trainer(RayPPOTrainer)(cfg=cfg, tracker=tracker, tokenizer=tokenizer, train_dataset=train_dataset,
                eval_dataset=eval_dataset, inference_engine_client=inference_engine_client, generator=generator,
                colocate_pg=colocate_pg, loss_aggregation={"mode": "session_mean"})

``loss_aggregation`` is a :class:`lossagg.LossAggregationConfig`, a mapping of its settings or a
config file; left out, SkyRL's own ``loss_reduction`` is mapped through lossagg's aliases (its
``seq_mean_token_sum_norm`` divides by ``max_seq_len``, its ``prompt_mean`` groups
``n_samples_per_prompt`` rows) and gives SkyRL's numbers. What SkyRL's batch does not carry, or
what scaling the advantages cannot reach, is refused by name when the trainer is built
(:func:`config_for`; docs/trainers/skyrl.md).
"""

from __future__ import annotations

import warnings

import torch

from lossagg.config import LossAggregationConfig
from lossagg.integrations import as_config, session_refusal
from lossagg.modes import canonical_mode, mode_spec
from lossagg.step import StepPlan

SKYRL_VERSION = "0.4.0"
# SkyRL's registered policy losses (PolicyLossRegistry, skyrl/backends/skyrl_train/utils/ppo_utils.py) whose per-token
# loss scales with its advantage, l(w·A) = w·l(A) for w > 0, so that scaling the advantages reweighs the loss: each
# multiplies A by factors of the log-probabilities alone (ratios, clipped or detached; GSPO's sequence ratio; DPPO's
# mask, SAPO's temperature and dual clip's branch read only A's sign; the off-policy correction's ratios and masks
# read only log-probabilities) and reduces by the masked sum
SERVED_POLICY_LOSSES = ("regular", "dual_clip", "gspo", "cispo", "sapo", "importance_sampling", "rollout_is", "dppo")
REFUSED_POLICY_LOSSES = {
    "clip_cov": "picks the tokens it clips from the micro-batch's covariance of the advantages with the log-probabilities, "
    "against fixed bounds and a random draw, so scaled advantages change which tokens it clips (and the split changes them too)",
    "kl_cov": "adds a KL penalty, which holds no advantage, to the tokens of the micro-batch's largest covariance of advantages "
    "and log-probabilities: the penalty is not reweighted and scaled advantages change which tokens get it",
    "cross_entropy": "holds no advantage (the negative log-likelihood of SkyRL's SFT path), so scaling the advantages cannot reweigh it",
}
#: The metadata key under which the trainer keeps each row's trajectory (step-wise training): SkyRL pops ``uids``
#: and ``is_last_step`` right after computing the advantages (``RayPPOTrainer.train``), before the mini-batches.
TRAJECTORY_KEY = "lossagg_trajectory_ids"


class SkyRLConfigError(ValueError):
    """A lossagg config that SkyRL's trainer cannot serve, or a SkyRL setting that lossagg cannot reach: names both."""


def _from_loss_reduction(cfg, step_wise: bool, issues: list[str]) -> LossAggregationConfig | None:
    """SkyRL's ``loss_reduction`` as the lossagg config that gives its numbers (docs/modes.md, other trainers' names)."""
    algorithm = cfg.trainer.algorithm
    reduction = algorithm.loss_reduction
    try:  # a name with a divisor resolves to the mode of its divisor: SkyRL's seq_mean_token_sum_norm divides by max_seq_len
        spec = mode_spec(canonical_mode(reduction, {"divisor": 1.0})[0])
    except ValueError as exc:
        issues.append(f"trainer.algorithm.loss_reduction={reduction!r}: {exc}")
        return None
    settings = {"mode": reduction}
    if spec.needs_divisor:
        if algorithm.max_seq_len is None:
            issues.append(f"trainer.algorithm.loss_reduction={reduction!r} divides by trainer.algorithm.max_seq_len, which is not set")
            return None
        settings["divisor"] = float(algorithm.max_seq_len)
    if spec.needs_groups and not step_wise:  # step-wise, a prompt holds a row per turn: any number of rows
        settings["n_samples_per_prompt"] = int(cfg.generator.n_samples_per_prompt)
    return LossAggregationConfig.from_dict(settings)


def config_for(cfg, loss_aggregation=None, *, extra_policy_losses=()) -> LossAggregationConfig:
    """The lossagg config of a SkyRL trainer (``cfg``: SkyRL's ``SkyRLTrainConfig``), checked against its settings;
    every problem named in one :class:`SkyRLConfigError`. ``extra_policy_losses``: names of policy losses of your
    own (``register_policy_loss``) whose per-token loss scales with the advantage."""
    algorithm, step_wise = cfg.trainer.algorithm, bool(cfg.generator.step_wise_trajectories)
    issues: list[str] = []
    loss = algorithm.policy_loss_type
    if loss not in SERVED_POLICY_LOSSES and loss not in tuple(extra_policy_losses):
        why = REFUSED_POLICY_LOSSES.get(loss, f"is not one of SkyRL {SKYRL_VERSION}'s policy losses whose per-token loss scales with the advantage")
        issues.append(
            f"trainer.algorithm.policy_loss_type={loss!r} {why}: lossagg reweighs the loss by scaling the advantages, exact only when "
            f"l(w·A) = w·l(A) for w > 0; use one of {', '.join(SERVED_POLICY_LOSSES)} (a loss of your own that scales so: extra_policy_losses)"
        )
    config = _from_loss_reduction(cfg, step_wise, issues) if loss_aggregation is None else as_config(loss_aggregation)
    if config is not None:
        if config.terms:
            issues.append(
                f"terms ({', '.join(config.terms)}): SkyRL computes its KL and entropy terms inside its policy worker with its own "
                "reductions (use_kl_loss: each sample's token mean, averaged over micro-batches and DP ranks; use_entropy_loss: each "
                "micro-batch's token mean, which changes with the micro-batch split), where the driver's advantages do not reach: "
                "drop terms (lossagg reduces the policy loss)"
            )
        if config.weighting != "none":
            issues.append(f"weighting={config.weighting} needs per-sample weights, which SkyRL's batch does not carry: drop it")
        without_sessions = "without generator.step_wise_trajectories each row is one whole trajectory"
        refusal = None if step_wise else session_refusal(config, "SkyRL's trainer", without_sessions)
        if refusal:
            issues.append(refusal)
    if issues:
        raise SkyRLConfigError("lossagg cannot serve this SkyRL trainer:\n" + "\n".join(f"- {issue}" for issue in issues))
    if algorithm.use_entropy_loss:
        warnings.warn(
            "trainer.algorithm.use_entropy_loss: SkyRL's entropy term stays its own, each micro-batch's token mean, which changes with "
            "the micro-batch split; lossagg reduces the policy loss",
            stacklevel=3,
        )
    return config


def trajectory_ids(is_last_step) -> list[int]:
    """Each row's trajectory as SkyRL numbers them in step-wise training (``compute_advantages_and_returns``:
    the cumulative sum of ``is_last_step`` shifted by one row)."""
    ids, current = [], 0
    for last in is_last_step:
        ids.append(current)
        current += bool(last)
    return ids


def normalize_advantages(config: LossAggregationConfig, cfg, data, mini_batch_boundaries, prompt_boundaries=None):
    """SkyRL's ``_normalize_advantages`` with lossagg's reduction: SkyRL's z-score when asked, then each mini-batch's
    advantages times ``plan.token_weights`` (``convention="sum"``); rows outside every mini-batch (SkyRL's DP padding) get 0,
    as in SkyRL."""
    advantages, response_mask, loss_mask = data["advantages"], data["response_mask"], data["loss_mask"]
    if cfg.trainer.algorithm.advantage_batch_normalize:  # SkyRL's own z-score, over the whole batch (trainer.py, _normalize_advantages)
        num_actions = response_mask.sum()
        mean = advantages.mean()
        std = ((advantages - mean).pow(2) * response_mask).sum()
        rstd = (std / num_actions).clamp(min=1e-8).rsqrt()
        advantages = (advantages - mean) * rstd
    needed = config.sample_indices()
    groups = sessions = None
    if "group_index" in needed:
        if prompt_boundaries is None:
            raise ValueError(f"mode={config.mode} needs each row's prompt: the batch's metadata holds no policy_prompt_boundaries")
        groups = torch.full((advantages.shape[0],), -1, dtype=torch.long)
        for prompt, (start, end) in enumerate(prompt_boundaries):
            groups[start:end] = prompt
    if "session_index" in needed:
        if data.metadata.get(TRAJECTORY_KEY) is None:
            raise ValueError(
                f"mode={config.mode} needs each row's trajectory: the batch's metadata holds no {TRAJECTORY_KEY} "
                "(the trainer's compute_advantages_and_returns sets it)"
            )
        sessions = torch.tensor(data.metadata[TRAJECTORY_KEY], dtype=torch.long)
    scaled = torch.zeros_like(advantages)
    for start, end in mini_batch_boundaries:
        rows = slice(start, end)
        if groups is not None and bool((groups[rows] < 0).any()):
            raise ValueError(f"policy_prompt_boundaries leave rows of the mini-batch [{start}, {end}) without a prompt")
        kwargs = {"group_index": None if groups is None else groups[rows], "session_index": None if sessions is None else sessions[rows]}
        plan = StepPlan.from_mask(config, loss_mask[rows], **kwargs)
        scaled[rows] = advantages[rows] * plan.token_weights(loss_mask[rows], slice(None), convention="sum", dtype=advantages.dtype)
    data["advantages"] = scaled
    return data


def lossagg_trainer(base=None, *, extra_policy_losses=()):
    """A subclass of SkyRL's trainer ``base`` (``RayPPOTrainer`` when None, or a subclass of it) whose policy mini-batches
    are reduced by lossagg; it takes ``loss_aggregation=`` beside the trainer's own arguments, checked before SkyRL builds anything."""
    if base is None:
        from skyrl.train.trainer import RayPPOTrainer as base  # defers the optional peer SkyRL: imported only when no base is given

    class LossaggTrainer(base):
        def __init__(self, cfg, *args, loss_aggregation=None, **kwargs):
            self.lossagg_config = config_for(cfg, loss_aggregation, extra_policy_losses=extra_policy_losses)
            super().__init__(cfg, *args, **kwargs)

        def compute_advantages_and_returns(self, data):
            data = super().compute_advantages_and_returns(data)
            if data.metadata.get("is_last_step") is not None:  # step-wise: kept, as SkyRL pops it next
                data.metadata[TRAJECTORY_KEY] = trajectory_ids(data.metadata["is_last_step"])
            return data

        @torch.no_grad()
        def _normalize_advantages(self, data, mini_batch_boundaries, prompt_boundaries=None):
            return normalize_advantages(self.lossagg_config, self.cfg, data, mini_batch_boundaries, prompt_boundaries)

    LossaggTrainer.__name__ = LossaggTrainer.__qualname__ = f"Lossagg{base.__name__}"
    return LossaggTrainer
