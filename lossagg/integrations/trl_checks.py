"""What :class:`lossagg.integrations.trl.GRPOTrainer` refuses, without TRL: the checks its ``__init__`` runs on
the config and TRL's settings, here so that they import without TRL (``lossagg.integrations.trl`` subclasses
TRL's trainer, so it imports TRL) and the table of what each trainer serves (:mod:`lossagg.integrations.served`)
asks them as the trainer does."""

from __future__ import annotations

from lossagg.config import LossAggregationConfig
from lossagg.integrations import session_refusal
from lossagg.modes import MODES

#: The entropy bonus's reducer when the config names none: TRL's documented objective subtracts the mean
#: per-token entropy, which over the optimizer step (not each micro-batch, as TRL divides) is token_mean.
ENTROPY_MODE = "token_mean"
#: How the trainer's refusal begins; the refusals follow, joined by "; ".
REFUSAL = "lossagg.integrations.trl.GRPOTrainer does not support: "


def refusals(
    config: LossAggregationConfig, targs, *, beta: float, entropy_coef: float, top_entropy_quantile: float, entropy_enabled: bool
) -> tuple[LossAggregationConfig, list[str]]:
    """The settings of a TRL ``GRPOTrainer`` that the lossagg trainer cannot serve with ``config`` (``targs``:
    TRL's ``GRPOConfig``, read for ``steps_per_generation`` and ``gradient_accumulation_steps``; ``beta``,
    ``entropy_coef``, ``top_entropy_quantile`` and ``entropy_enabled``, whether TRL adds its entropy bonus,
    as the trainer holds them), each with why, in one list (empty: served); and the config with the entropy
    bonus as the term ``entropy`` when TRL adds one and the config names none."""
    refused = []
    entropy_term, kl_term = config.terms.get("entropy"), config.terms.get("kl")
    other_terms = [name for name in config.terms if name not in ("entropy", "kl")]
    if other_terms or config.weighting != "none":
        what = [f"terms ({', '.join(other_terms)})"] if other_terms else []
        what += [f"weighting={config.weighting}"] if config.weighting != "none" else []
        refused.append(
            f"loss_aggregation with {' and '.join(what)} (this trainer reduces TRL's per-token loss as one unweighted term, its "
            "entropy bonus as the term 'entropy' and its KL penalty as the term 'kl')"
        )
    if kl_term is not None:
        if beta == 0.0:
            refused.append("loss_aggregation term 'kl' with GRPOConfig.beta=0 (TRL adds no KL term)")
        elif float(kl_term.coefficient) != float(beta):
            refused.append(
                f"loss_aggregation term 'kl' with coefficient {kl_term.coefficient}, where GRPOConfig.beta={beta} applies beta: make them agree"
            )
    if entropy_enabled:
        # the entropy bonus is the term 'entropy', -entropy_coef times its J on its own mode (TRL's: each micro-batch's token mean)
        if top_entropy_quantile < 1.0:
            refused.append(
                f"entropy_coef with top_entropy_quantile={top_entropy_quantile} (the bonus's tokens are chosen inside the loss, so its "
                "step totals are known only after the forward; not served yet)"
            )
        if entropy_term is not None and float(entropy_term.coefficient) != -float(entropy_coef):
            refused.append(
                f"loss_aggregation term 'entropy' with coefficient {entropy_term.coefficient}, where GRPOConfig.entropy_coef={entropy_coef} "
                "applies -entropy_coef: make them agree"
            )
        if entropy_term is None and not refused:
            term = {"mode": ENTROPY_MODE, "coefficient": -float(entropy_coef)}
            settings = config.model_dump(exclude_unset=True, mode="json")
            config = LossAggregationConfig.from_dict(
                {**settings, "terms": {**settings.get("terms", {}), "entropy": term}}, source="GRPOConfig.entropy_coef"
            )
    elif entropy_term is not None:
        refused.append("loss_aggregation term 'entropy' without GRPOConfig.entropy_coef (TRL adds no entropy bonus)")
    spg, accumulation = targs.steps_per_generation, targs.gradient_accumulation_steps
    if spg % accumulation != 0:
        refused.append(
            f"steps_per_generation={spg} with gradient_accumulation_steps={accumulation} (an optimizer step would span two generation "
            "batches; a multiple of the accumulation steps is served, one plan per optimizer step)"
        )
    elif spg != accumulation and any(MODES[mode].needs_groups for mode in (config.mode, *(t.mode for t in config.terms.values() if t.mode))):
        refused.append(
            f"a mode with prompt groups with steps_per_generation={spg} > gradient_accumulation_steps={accumulation} (TRL shuffles the "
            "generation batch before cutting it into optimizer steps, so a prompt's completions straddle steps)"
        )
    sessions = session_refusal(config, "TRL's GRPOTrainer", "each completion is a sample of its own, with no trajectory id in its batch")
    if sessions:
        refused.append(sessions)
    return config, refused
