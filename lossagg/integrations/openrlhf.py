"""OpenRLHF's actor trainer with its losses reduced by lossagg (read against and tested with OpenRLHF 0.11.2).

OpenRLHF's ``ActorPPOTrainer.ppo_train`` (``openrlhf/trainer/ray/ppo_actor.py``) hands every micro-batch of one
optimizer step the step's DP totals over its ``accumulated_gradient`` micro-batches (``openrlhf/utils/loss_utils.py``);
``training_step`` reduces the policy loss by ``aggregate_loss`` (``openrlhf/models/loss.py``), KL and entropy by the
token mean. :func:`install` makes the trainer OpenRLHF built an instance of a subclass whose ``training_step`` is
OpenRLHF's own with other reductions: one ``StepPlan`` per optimizer step over the DP group; the policy loss given
``mask · plan.token_weights(...)`` as its mask and unit totals; KL and entropy given their term's step totals. Nothing
of OpenRLHF is patched; the switch is one line where OpenRLHF builds its trainer::

    @ray.remote(num_gpus=1)
    class LossaggPolicyActor(PolicyModelActor.__ray_actor_class__):  # RayActorGroup(..., LossaggPolicyActor, ...)
        def init_model_from_pretrained(self, *args, **kwargs):
            super().init_model_from_pretrained(*args, **kwargs)
            install(self.trainer, {"mode": "prompt_mean"})  # left out: OpenRLHF's own actor.loss_agg_mode

A row's prompt: its rollout index over ``n_samples_per_prompt``, kept in ``info``. Refusals: :func:`config_for`.
"""

from __future__ import annotations

import itertools

import torch

from lossagg.config import LossAggregationConfig
from lossagg.integrations import session_refusal
from lossagg.modes import MODES
from lossagg.step import StepPlan

OPENRLHF_VERSION = "0.11.2"
#: The per-sample ``info`` key under which the replay buffer keeps each row's prompt.
GROUP_KEY = "lossagg_prompt"
#: The step-wide factors of d[i] (docs/modes.md): a mode whose d[i] is their product gives every row the same d.
STEP_WIDE = frozenset({"N", "P", "S", "c(T)", "c(L_max)", "L"})
# OpenRLHF's actor.loss_agg_mode as lossagg settings (its seq-mean-token-mean counts the non-empty rows only)
OWN_MODES = {"token-mean": {"mode": "token-mean"}, "seq-mean-token-mean": {"mode": "seq-mean-token-mean", "empty_samples": "skip"}}


def term_reach(mode: str) -> bool | None:
    """How ``aggregate_loss`` reaches a KL or entropy term on ``mode`` with one total: True for a d[i] the same for every
    row (a product of step-wide factors), False for N · c(M[i]) (a per-row token mean), None when it cannot."""
    factors = set(getattr(MODES[mode].denoms, "factors", ())) if mode in MODES else set()
    return True if factors and factors <= STEP_WIDE else (False if factors == {"N", "c(M[i])"} else None)


class OpenRLHFConfigError(ValueError):
    """A lossagg config that OpenRLHF's actor trainer cannot serve, or an OpenRLHF setting lossagg cannot reach: names both."""


def computed_terms(args) -> dict[str, float]:
    """The terms OpenRLHF's ``training_step`` adds to its policy loss, with their coefficients as lossagg writes them."""
    terms = {}
    if args.algo.kl.use_loss and args.algo.kl.init_coef > 0:
        terms["kl"] = float(args.algo.kl.init_coef)
    if args.actor.entropy_coef is not None and args.actor.entropy_coef != 0:
        terms["entropy"] = -float(args.actor.entropy_coef)  # OpenRLHF subtracts entropy × entropy_coef
    return terms


def config_for(args, loss_aggregation=None) -> LossAggregationConfig:
    """The lossagg config of an OpenRLHF trainer (``args``: its ``strategy.args``); every problem in one :class:`OpenRLHFConfigError`."""
    issues: list[str] = []
    if args.actor.policy_loss_type != "ppo":
        issues.append(
            f"actor.policy_loss_type={args.actor.policy_loss_type!r}: OpenRLHF multiplies GSPO's sequence ratio by the loss mask, where "
            "lossagg's per-token weights travel, and fixes its reduction to seq-mean-token-mean: use ppo"
        )
    for setting, value in (("train.dynamic_batch_enable", args.train.dynamic_batch_enable), ("ds.ring_attn_size", args.ds.ring_attn_size),
                           ("ds.tensor_parallel_size", args.ds.tensor_parallel_size)):  # fmt: skip
        if value if isinstance(value, bool) else value > 1:
            issues.append(f"{setting}={value}: lossagg plans OpenRLHF's fixed-size micro-batches over DP ranks only (not its token-balanced "
                          "micro-batches, ring-attention or tensor-parallel ranks): turn it off")  # fmt: skip
    own, config = args.actor.loss_agg_mode, None
    if loss_aggregation is not None:
        config = LossAggregationConfig.coerce(loss_aggregation, "loss_aggregation")
    elif own in OWN_MODES:
        config = LossAggregationConfig.from_dict(OWN_MODES[own])
    else:
        issues.append(f"actor.loss_agg_mode={own!r} is not one of OpenRLHF {OPENRLHF_VERSION}'s: {', '.join(OWN_MODES)}")
    if config is not None:
        computed = computed_terms(args)
        if config.terms and set(config.terms) != set(computed):
            issues.append(
                f"terms ({', '.join(config.terms)}): OpenRLHF's training_step computes {', '.join(computed) or 'no term'} beside the policy "
                "loss, reduced with one set of totals: name exactly those, or no terms (OpenRLHF's own token mean)"
            )
        for name, term in config.terms.items():
            if name in computed and abs(term.coefficient - computed[name]) > 1e-12 * max(1.0, abs(computed[name])):
                setting = "algo.kl.init_coef" if name == "kl" else "-actor.entropy_coef"
                issues.append(f"terms.{name}.coefficient={term.coefficient}: OpenRLHF applies its own, {setting} = {computed[name]}")
            if term_reach(term.mode) is None:
                issues.append(f"terms.{name}.mode={term.mode}: OpenRLHF reduces its {name} by aggregate_loss over one step total: a mode "
                              f"whose d[i] is a product of {', '.join(sorted(STEP_WIDE))}, or N · c(M[i])")  # fmt: skip
        if len({(t.mode, t.divisor) for t in config.terms.values()}) > 1:
            issues.append("terms: OpenRLHF hands its KL and entropy the same totals: give them one mode (and divisor)")
        if "kl" in config.terms and args.algo.kl.target:
            issues.append(f"terms.kl with algo.kl.target={args.algo.kl.target}: the adaptive controller changes the KL coefficient every step")
        issues.append(f"weighting={config.weighting}: OpenRLHF's experiences carry no per-sample weights" if config.weighting != "none" else "")
        issues.append(session_refusal(config, "OpenRLHF's actor trainer", "each row is one whole response, agent turns included"))
    if any(issues):
        raise OpenRLHFConfigError("lossagg cannot serve this OpenRLHF trainer:\n" + "\n".join(f"- {issue}" for issue in issues if issue))
    return config


def _replay_buffer(base, n_samples_per_prompt: int):
    """OpenRLHF's replay buffer class ``base`` keeping each row's prompt and the micro-batches its ``collate_fn`` makes."""

    class LossaggReplayBuffer(base):
        def append(self, experience):
            if experience.index is not None:  # OpenRLHF drops the rollout index in the split: the prompt is kept in info
                experience.info[GROUP_KEY] = [int(i) // n_samples_per_prompt for i in experience.index]
            super().append(experience)

        def collate_fn(self, batch):
            experience = super().collate_fn(batch)
            self.lossagg_collated.append(experience)
            return experience

    return LossaggReplayBuffer


def _policy_loss(base):
    """OpenRLHF's policy loss ``base`` given ``mask · weights`` as its mask and unit totals: its masked sum is the share of J."""

    class LossaggPolicyLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.weights = base, None  # the weights of the micro-batch, set by training_step

        def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, **_openrlhf_totals):
            token_level, self.inner.token_level_loss = self.inner.token_level_loss, True
            try:
                return self.inner(log_probs, old_log_probs, advantages, self.weights, rollout_log_probs, dp_size=1, batch_num_tokens=1.0)
            finally:
                self.inner.token_level_loss = token_level

    return LossaggPolicyLoss()


def install(trainer, loss_aggregation=None):
    """OpenRLHF's built ``ActorPPOTrainer`` (replay buffer still empty) made to reduce by lossagg, checked first; returns it."""
    config = config_for(trainer.args, loss_aggregation)
    trainer.lossagg_config, trainer.lossagg_plan = config, None
    old = trainer.replay_buffer
    buffer = object.__new__(_replay_buffer(type(old), int(trainer.args.rollout.n_samples_per_prompt)))
    buffer.__dict__.update(old.__dict__, lossagg_collated=[])  # the same buffer (still empty), of the subclass
    trainer.replay_buffer, trainer.actor_loss_fn = buffer, _policy_loss(trainer.actor_loss_fn)
    trainer.__class__ = lossagg_trainer(type(trainer))
    return trainer


def lossagg_trainer(base):
    """The subclass of OpenRLHF's actor trainer class ``base`` that :func:`install` makes of a built trainer."""

    class LossaggActorPPOTrainer(base):
        def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
            from openrlhf.utils.loss_utils import _get_dp_group  # defers the optional peer OpenRLHF: the DP group of its totals

            gas = max(int(self.strategy.accumulated_gradient), 1)
            group = (_get_dp_group(self.strategy) or torch.distributed.group.WORLD) if torch.distributed.is_initialized() else None
            dp = 1 if group is None else torch.distributed.get_world_size(group)  # no DP mesh: OpenRLHF's totals take the default group
            if step % gas == 0:  # the step's first micro-batch: every one of its micro-batches is collated by now
                window, self.replay_buffer.lossagg_collated = self.replay_buffer.lossagg_collated, []
                self.lossagg_plan = _plan(self.lossagg_config, window, group)
            plan, window, offsets = self.lossagg_plan
            k = next((i for i, e in enumerate(window) if e is experience), None)
            if k is None:
                raise RuntimeError(
                    f"training_step: micro-batch {step} is not one of the {len(window)} the replay buffer collated for its "
                    f"optimizer step (accumulated_gradient={gas}): lossagg needs ppo_train's order (a DataLoader without workers)"
                )
            mask, samples = experience.action_mask, slice(offsets[k], offsets[k + 1])
            weights = plan.token_weights(mask, samples, convention="megatron", dp_size=dp, num_micro_batches=gas)
            self.actor_loss_fn.weights = weights * mask
            experience.info.pop(GROUP_KEY, None)
            totals = loss_batch_info  # no terms named: OpenRLHF's own token mean for its KL and entropy
            for name, term in self.lossagg_config.terms.items():  # one mode for all of them (config_for)
                d = float(plan.term_denoms[name][offsets[k]])  # aggregate_loss: Σ m·x / d, or Σ_i (Σ m·x / M[i]) / (d / M[i])
                per_row = {"token_level_loss": False, "global_batch_size": d / max(float(plan.token_counts[offsets[k]]), 1.0)}
                per_sample = {} if term_reach(term.mode) else per_row
                totals = {"dp_size": dp * gas, "batch_num_tokens": d, **per_sample}
            return super().training_step(experience, kl_ctl, step, totals)

    LossaggActorPPOTrainer.__name__ = LossaggActorPPOTrainer.__qualname__ = f"Lossagg{base.__name__}"
    return LossaggActorPPOTrainer


def _plan(config, window, group):
    """The plan of one optimizer step from its micro-batches on this rank (collective over the DP group)."""
    counts = torch.cat([e.action_mask.sum(dim=-1) for e in window]).to(torch.float64)
    offsets, groups, bound = [0, *itertools.accumulate(e.action_mask.shape[0] for e in window)], None, None
    if any(t.spec.needs_groups for t in config.loss_terms):
        if any(not isinstance(e.info.get(GROUP_KEY), torch.Tensor) for e in window):
            raise ValueError(f"mode={config.mode} needs each row's prompt: an experience reached the replay buffer without its rollout index")
        groups = torch.cat([e.info[GROUP_KEY].reshape(-1) for e in window]).long()
        bound = torch.tensor(int(groups.max()) + 1, dtype=torch.long)  # one bound on the prompt labels for every DP rank
        if group is not None:
            torch.distributed.all_reduce(bound, op=torch.distributed.ReduceOp.MAX, group=group)
    return StepPlan(config, counts, group_index=groups, num_group_labels=bound and int(bound), process_group=group), window, offsets
