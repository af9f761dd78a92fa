"""A rank's samples of one step, checked once: the one record both plans, the one-pass route and the
reference read (docs/modes.md names what each field is for).

:class:`RankSamples` holds, for the ``n`` samples a rank holds in one optimizer step, their rollout
token counts ``M[i]``, their prompt groups and sessions (when a term's mode reads them), their
weights (when a term weighs its samples) and the label bounds a process group needs. It is made
once, by :meth:`RankSamples.of`, which checks every field against the config it serves; the plans
and the totals then read its fields and never check them again. A new per-sample field is one
field here, not a keyword threaded through every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lossagg.validate import as_int, check_group_index, check_sample_weights, check_session_index, check_token_counts

__all__ = ["RankSamples"]

#: The most samples one rank holds in a step whose counts are learned as it runs (a DeferredPlan keeps a record per sample).
MAX_LOCAL_SAMPLES = 2**31


@dataclass(frozen=True, eq=False)
class RankSamples:
    """This rank's samples of one step (see the module docstring).

    * ``token_counts``: float64 ``[n]`` rollout token counts ``M[i]``, or None while they are not
      known (a :class:`lossagg.DeferredPlan` learns them as its micro-batches run);
    * ``group_index``, ``session_index``: int64 ``[n]`` prompt-group and session labels, or None;
    * ``sample_weights``: float64 ``[n]`` weights ``w_i``, or None;
    * ``num_group_labels``, ``num_session_labels``: how many labels the step's indices can take
      (with a process group: labels in ``[0, num_*_labels)``), or None.
    """

    num_samples: int
    token_counts: torch.Tensor | None = None
    group_index: torch.Tensor | None = None
    session_index: torch.Tensor | None = None
    sample_weights: torch.Tensor | None = None
    num_group_labels: int | None = None
    num_session_labels: int | None = None

    @classmethod
    def of(
        cls,
        config,
        token_counts=None,
        group_index: torch.Tensor | None = None,
        session_index: torch.Tensor | None = None,
        sample_weights: torch.Tensor | None = None,
        num_group_labels: int | None = None,
        num_session_labels: int | None = None,
        *,
        num_samples: int | None = None,
        owner: str = "StepPlan",
        indices_required: bool = True,
    ) -> RankSamples:
        """The record of ``config``'s step on this rank, every field checked once: the token counts
        (real, finite, >= 0), ``num_samples`` when the counts are not known yet, each index the
        config's terms need (required then, unless ``indices_required`` is False: a trainer's step
        totals stand in for them; checked whenever given), the weights (given exactly
        when a term weighs its samples) and the label bounds (integers >= 1). Indices and weights
        go to the counts' device (the CPU when there are no counts)."""
        counts, device = None, torch.device("cpu")
        if token_counts is not None:
            counts = check_token_counts(token_counts)
            device = counts.device
            n = counts.shape[0]
        else:
            name = "num_local_samples" if owner == "DeferredPlan" else "num_samples"
            n = as_int(name, num_samples, minimum=0)
            if n > MAX_LOCAL_SAMPLES:  # the ledger keeps a flag per sample: refused before it is allocated
                raise ValueError(f"{name} (this rank's samples in the step) must be <= 2**31, got {num_samples!r}")
        bounds = {}
        for name, value in (("num_group_labels", num_group_labels), ("num_session_labels", num_session_labels)):
            bounds[name] = None if value is None else as_int(name, value, minimum=1)
        terms = config.loss_terms
        grouped = next((t for t in terms if t.spec.needs_groups), None)
        sessioned = next((t for t in terms if t.spec.needs_sessions), None)
        groups = sessions = None
        if not indices_required:
            grouped = sessioned = None
        if group_index is not None or grouped is not None:
            groups = check_group_index(group_index, n, device, _named(grouped, config)).long()
        if session_index is not None or sessioned is not None:
            sessions = check_session_index(session_index, n, device, _named(sessioned, config)).long()
        weights = check_sample_weights(sample_weights, {t.name: t.weighting for t in terms}, n, device, owner)
        return cls(n, counts, groups, sessions, weights, bounds["num_group_labels"], bounds["num_session_labels"])

    def with_counts(self, token_counts: torch.Tensor) -> RankSamples:
        """The same samples with their token counts (float64 ``[n]``, already checked), the indices and
        weights on the counts' device."""
        device = token_counts.device

        def moved(t):
            return None if t is None else t.to(device)

        return replace(
            self,
            token_counts=token_counts,
            group_index=moved(self.group_index),
            session_index=moved(self.session_index),
            sample_weights=moved(self.sample_weights),
        )

    def take(self, positions: torch.Tensor, token_counts: torch.Tensor) -> RankSamples:
        """The samples at ``positions`` (int64) with their token counts ``token_counts``: a micro-batch's
        own samples, whose per-sample totals it computes itself (no label bounds: its labels are its own)."""

        def rows(t):
            return None if t is None else t[positions.to(t.device)].to(token_counts.device)

        return RankSamples(int(positions.shape[0]), token_counts, rows(self.group_index), rows(self.session_index), rows(self.sample_weights))


def _named(term, config) -> str:
    """The mode an error names: the term's (``prompt_mean (the reducer of term 'nll')``), or the config's."""
    if term is None or term.name == "pg":
        return config.mode if term is None else term.mode
    return f"{term.mode} (the reducer of term {term.name!r})"
