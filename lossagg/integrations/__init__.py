"""Drop-in adapters for the trainers people already run. ``verl`` and ``megatron`` import
nothing of their trainer (they reproduce its call signature and compute through lossagg);
``trl`` subclasses TRL's ``GRPOTrainer`` and so imports TRL; ``miles`` and ``slime`` plug into their
trainer's own hooks and import it only inside them (at run time, in its processes); ``skyrl`` subclasses
the SkyRL trainer class it is given; ``openrlhf`` turns the actor trainer OpenRLHF built into a subclass of its class."""


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
