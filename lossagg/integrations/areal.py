"""AReaL's PPO actor with the policy loss reduced by lossagg (read against and tested with AReaL 1.0.4).

AReaL has one aggregation, the token mean of the optimizer step. ``PPOActor._ppo_update`` cuts the rank's
batch into ``ppo_n_minibatches`` mini-batches, one optimizer step each, and hands each to
``engine.train_batch(mb, loss_fn=grpo_loss_fn, loss_weight_fn=<the mb's loss-mask count>)``
(``areal/trainer/ppo/actor.py``). The engine cuts it into micro-batches, all-reduces the weights over DP
into ``W`` (``compute_total_loss_weight``, ``areal/engine/core/train_engine.py``) and scales the loss of
a micro-batch, its token mean, by ``weight / W × dp_size``, which FSDP's DP average divides back
(``FSDPEngine._compute_logprobs_and_loss``): the step's token mean, ``Σ_t l_t / W``.
:func:`lossagg_actor` subclasses AReaL's actor engine and installs a ``PPOActor`` subclass as its
``actor``, as AReaL installs its own (``FSDPPPOActor.__init__``); nothing of AReaL is patched. Per
mini-batch the actor's ``train_batch`` makes ``StepPlan.from_mask`` over the DP group and keeps AReaL's
loss function and weight, multiplying each token's advantage by ``W / d[i]``
(``plan.token_weights(..., convention="sum") × W``): AReaL's ``Σ_t l_t / W`` becomes ``Σ_i S_i / d[i]``,
exact for every policy loss of AReaL 1.0.4 (PPO-clip, dual clip, GSPO, SAPO, decoupled PPO, rejection
sampling), each ``l(w·A) = w·l(A)`` for ``w > 0``. The entropy and KL terms reduce through the
micro-batch handle (``plan.loss(..., terms=...)``), times ``W / weight`` against the engine's scale::

    from areal.engine.fsdp_engine import FSDPPPOActor
    from lossagg.integrations.areal import lossagg_actor

    actor = lossagg_actor(FSDPPPOActor)(config=config.actor, loss_aggregation={"mode": "prompt_mean"})

Prompt groups are AReaL's own: each trajectory dict that ``ppo_update`` receives is one dataset item's
rollout (``GroupedRolloutWorkflow`` joins its ``gconfig.n_samples`` episodes; ``redistribute_trajectories``
keeps it whole on one rank). With ``sessions=True`` each dict is one session: the per-turn export
(``export_style="individual"``) with one episode per prompt, a row per turn. What the actor's data cannot
serve is refused by name when the engine is built (:func:`config_for`; docs/trainers/areal.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lossagg.config import LossAggregationConfig
from lossagg.integrations import as_config, session_refusal
from lossagg.step import StepPlan

AREAL_VERSION = "1.0.4"
#: Per-token keys the actor adds to AReaL's batch ([B, S], so AReaL's splits and packing carry them): each
#: row's trajectory dict (prompt group, or session) over the DP group, and its row in the mini-batch.
TRAJECTORY_KEY, ROW_KEY = "lossagg_trajectory", "lossagg_row"
#: The terms whose per-token values AReaL's engine hands the loss function: the entropy of each token
#: (with its gradient, ``_compute_logprobs_entropy``) and the KL to the reference, from ``ref_logp``.
SERVED_TERMS = ("entropy", "kl")


class AReaLConfigError(ValueError):
    """A lossagg config that AReaL's actor cannot serve, or an AReaL setting lossagg cannot reach: names both."""


def _as_config(loss_aggregation) -> LossAggregationConfig:
    return LossAggregationConfig(mode="token_mean") if loss_aggregation is None else as_config(loss_aggregation)  # AReaL's own: token_mean


def config_for(actor_config, loss_aggregation=None, *, sessions: bool = False) -> LossAggregationConfig:
    """The lossagg config of an AReaL actor (``actor_config``: AReaL's ``PPOActorConfig``), checked against
    its settings; every problem named in one :class:`AReaLConfigError`."""
    config, issues = _as_config(loss_aggregation), []
    if getattr(actor_config, "m2_threshold", None) is not None:
        issues.append(
            f"actor.m2_threshold={actor_config.m2_threshold}: M2PO drops tokens inside the loss and AReaL's loss then divides by the "
            "kept tokens of the micro-batch, while the engine weighs it by the rolled-out ones: no d[i] gives that; unset it"
        )
    unknown = [name for name in config.terms if name not in SERVED_TERMS]
    if unknown:
        issues.append(
            f"terms ({', '.join(unknown)}): AReaL's engine hands the loss function the log-probabilities and the entropy of each "
            f"token only; lossagg serves the terms {', '.join(SERVED_TERMS)} (kl: against the batch's ref_logp)"
        )
    if config.weighting != "none":
        issues.append(f"weighting={config.weighting} needs per-sample weights, which AReaL's batch does not carry: drop it")
    if not sessions:
        refusal = session_refusal(
            config, f"AReaL {AREAL_VERSION}'s actor", "each row is a whole trajectory; the per-turn export gives sessions: sessions=True"
        )
        if refusal:
            issues.append(refusal)
    if issues:
        raise AReaLConfigError("lossagg cannot serve this AReaL actor:\n" + "\n".join(f"- {issue}" for issue in issues))
    return config


def tag_trajectories(data: list, group) -> int:
    """Adds ``TRAJECTORY_KEY`` to each trajectory dict of this rank (its label over the DP ``group``, in rank
    order); returns the number of labels (every rank's dicts)."""
    counts = torch.zeros(dist.get_world_size(group), dtype=torch.long)
    counts[dist.get_rank(group)] = len(data)
    dist.all_reduce(counts, group=group)
    offset = int(counts[: dist.get_rank(group)].sum())
    for k, traj in enumerate(data):
        traj[TRAJECTORY_KEY] = torch.full_like(traj["attention_mask"], offset + k, dtype=torch.long)
    return int(counts.sum())


class PlannedEngine:
    """AReaL's engine as the lossagg actor sees it: ``train_batch`` plans each mini-batch (one optimizer step)
    and reduces it through AReaL's own ``train_batch``; everything else is the engine's."""

    def __init__(self, engine, config: LossAggregationConfig, kl_estimator):
        self.engine, self.lossagg_config, self.kl_estimator = engine, config, kl_estimator
        self.num_labels = None  # set per ppo_update by the actor (tag_trajectories)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def train_batch(self, input_, loss_fn, loss_weight_fn):
        if not isinstance(input_, dict):
            raise TypeError(f"the lossagg actor's train_batch takes one padded mini-batch (a dict), got {type(input_).__name__}")
        group = self.engine.data_parallel_group
        mask = input_["loss_mask"]
        labels, kwargs = input_.get(TRAJECTORY_KEY), {}
        for name in self.lossagg_config.sample_indices():  # group_index, session_index: each row's trajectory dict
            if labels is None:
                raise ValueError(f"mode={self.lossagg_config.mode} needs each row's {name}: the batch holds no {TRAJECTORY_KEY} (ppo_update sets it)")
            kwargs[name] = labels[:, 0]
            kwargs["num_group_labels" if name == "group_index" else "num_session_labels"] = self.num_labels
        plan = StepPlan.from_mask(self.lossagg_config, mask, process_group=group, **kwargs)
        total = mask.count_nonzero().to(torch.float64)  # W: AReaL's all-reduced weight, the step's loss tokens
        dist.all_reduce(total, group=group)
        rows, width = mask.shape
        batch = dict(input_, **{ROW_KEY: torch.arange(rows, device=mask.device)[:, None].expand(rows, width).contiguous()})
        weight = float(total)

        def lossagg_loss_fn(logprobs, entropy, mb_input, **kw):
            cu = mb_input["cu_seqlens"]
            samples, mb_mask = mb_input[ROW_KEY][cu[:-1].long()], mb_input["loss_mask"]
            advantages = mb_input["advantages"]
            scale = plan.token_weights(mb_mask, samples, cu, convention="sum", dtype=torch.float64) * weight
            loss = loss_fn(logprobs, entropy, dict(mb_input, advantages=(advantages * scale).to(advantages.dtype)), **kw)
            if not self.lossagg_config.terms:
                return loss
            values = {"entropy": entropy}
            if "kl" in self.lossagg_config.terms:
                if mb_input.get("ref_logp") is None:
                    raise ValueError("terms.kl needs each token's reference log-probability: the batch holds no ref_logp (configure AReaL's ref)")
                values["kl"] = self.kl_estimator(logprobs, mb_input["ref_logp"])
            mb = plan.micro_batch(samples, mb_mask, cu)
            share = plan.loss({k: v for k, v in values.items() if k in self.lossagg_config.terms}, mb, terms=list(self.lossagg_config.terms))
            return loss + share * (weight / float(loss_weight_fn(mb_input)))  # the engine scales by weight / W (the DP factor cancels)

        return self.engine.train_batch(batch, loss_fn=lossagg_loss_fn, loss_weight_fn=loss_weight_fn)


def lossagg_actor(base=None, *, sessions: bool = False):
    """A subclass of AReaL's actor engine ``base`` (``FSDPPPOActor`` when None; ``MegatronPPOActor``,
    ``ArchonPPOActor``) whose ``actor`` reduces by lossagg; it takes ``loss_aggregation=`` beside ``config``,
    checked before AReaL builds anything. ``sessions=True``: each trajectory dict is one session."""
    if base is None:
        from areal.engine.fsdp_engine import FSDPPPOActor as base  # defers the optional peer AReaL
    from areal.trainer.ppo.actor import PPOActor  # defers the optional peer AReaL
    from areal.utils.data import KLEstimator  # defers the optional peer AReaL

    class LossaggPPOActor(PPOActor):
        def __init__(self, config, engine, lossagg_config):
            super().__init__(config, PlannedEngine(engine, lossagg_config, KLEstimator(config.kl_estimator)))

        def ppo_update(self, data):
            if self.engine.lossagg_config.sample_indices():
                self.engine.num_labels = tag_trajectories(data, self.engine.data_parallel_group)
            return super().ppo_update(data)

    class LossaggActorEngine(base):
        def __init__(self, config, *args, loss_aggregation=None, **kwargs):
            lossagg_config = config_for(config, loss_aggregation, sessions=sessions)
            super().__init__(config, *args, **kwargs)
            self.actor = LossaggPPOActor(config, self, lossagg_config)  # as AReaL's own __init__ installs PPOActor

    LossaggActorEngine.__name__ = LossaggActorEngine.__qualname__ = f"Lossagg{base.__name__}"
    return LossaggActorEngine
