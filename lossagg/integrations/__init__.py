"""Drop-in adapters for the trainers people already run. ``verl`` and ``megatron`` import
nothing of their trainer (they reproduce its call signature and compute through lossagg);
``trl`` subclasses TRL's ``GRPOTrainer`` and so imports TRL; ``miles`` and ``slime`` plug into their
trainer's own hooks and import it only inside them (at run time, in its processes); ``skyrl`` subclasses
the SkyRL trainer class it is given; ``openrlhf`` turns the actor trainer OpenRLHF built into a subclass of its class;
``areal`` subclasses the AReaL actor engine class it is given. ``trl_checks`` holds the TRL adapter's refusals
(without TRL); ``served`` asks every adapter's checks what it serves (the table of docs/trainers/README.md)."""

import os
from collections.abc import Mapping

from lossagg.config import LossAggregationConfig


def as_config(loss_aggregation) -> LossAggregationConfig:
    """A trainer adapter's ``loss_aggregation`` argument as a config: a :class:`lossagg.LossAggregationConfig`, a
    mapping of its settings, or the path of a config file."""
    if isinstance(loss_aggregation, (str, os.PathLike)):
        return LossAggregationConfig.from_file(loss_aggregation)
    if isinstance(loss_aggregation, (LossAggregationConfig, Mapping)):
        return LossAggregationConfig.coerce(loss_aggregation, "loss_aggregation")
    raise TypeError(
        f"loss_aggregation must be a lossagg.LossAggregationConfig, a mapping of its settings or a config file, got {type(loss_aggregation).__name__}"
    )


def session_modes(config) -> list[str]:
    """The modes of ``config`` (its PG term's, then each term's) that need each sample's session
    (``session_index``; docs/modes.md, "Sessions"): what an adapter whose trainer hands no session
    refuses, by name."""
    return list(dict.fromkeys(t.mode for t in config.loss_terms if t.spec.needs_sessions))


def session_refusal(config, trainer: str, why: str) -> str | None:
    """The refusal of a config with a session mode by an adapter whose trainer carries no session, or None."""
    found = session_modes(config)
    if not found:
        return None
    return (
        f"mode={', '.join(found)} weighs each session (multi-turn trajectory) once and needs each sample's session, which {trainer} "
        f"does not carry ({why}): choose a mode without sessions, or compute J with a lossagg.StepPlan given session_index"
    )
