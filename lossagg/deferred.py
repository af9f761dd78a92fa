"""Denominators known only after the forward: a filter inside the loss, still exact under any split
(docs/composition.md, "Filters inside the loss").

When the loss itself decides which tokens count (a sample dropped because its log-prob error passes
a threshold, a token dropped by a per-token rule, overlong masking under packing), the counts a mode
divides by are known only once every micro-batch has run its forward, while gradient accumulation
needs each micro-batch's backward before the next forward. The factors of ``d[i]`` (a
:class:`lossagg.DenomProduct`) each say when their final value is known (``Factor.known``,
lossagg/denom_program.py): the divisor before the step; ``c(M[i])`` of the kept tokens when the
sample's micro-batch runs (summed over the CP group); ``c(Sg[g(i)])`` when its prompt group's
micro-batch runs, if each group lies whole in one micro-batch; the step-level factors (``N``,
``P``, ``c(T)``, ``c(L_max)``, ``W``, ...) after the last micro-batch. With ``s[i]`` the product of
the factors known when sample i's micro-batch runs and ``G`` that of the step-level ones::

    d_used[i] = G_used · s[i]     (each micro-batch's loss: G_used from an estimate every rank agrees on, or 1)
    d[i]      = G · s[i]          (the step's, after the last micro-batch: G from one all-reduce)

so ``J = (G_used / G) · Σ J_used`` and its gradient is the accumulated one times that one scalar,
applied once after the last micro-batch (:meth:`DeferredStep.apply_`). Which modes a plan serves
is read from these declarations, never from a list of names.
"""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lossagg.config import LossAggregationConfig
from lossagg.config.model import PG_TERM
from lossagg.denom_program import FACTORS, DenomInputs, DenomProduct
from lossagg.denominators import check_denoms
from lossagg.layout import token_counts as _token_counts
from lossagg.micro_batch import (
    MicroBatch,
    MicroBatchLog,
    Samples,
    check_layout,
    cut_from_step,
    given_micro_batch,
    reduce_metrics,
    reduce_micro_batch,
    sample_positions,
    term_tables,
)
from lossagg.modes import ModeSpec, default_term_mode, mode_spec
from lossagg.step import StepPlan
from lossagg.totals import TOTALS, mode_totals, rank_share, read_as, read_totals
from lossagg.validate import as_int, check_group_index, check_holds_data, check_process_group, check_sample_weights, check_session_index, plain_number

__all__ = ["DeferredPlan", "DeferredStep", "deferred_factors"]


def deferred_factors(spec: ModeSpec, what: str | None = None) -> tuple[tuple[str, ...], bool]:
    """(the step-level factors of ``spec``'s ``d[i]``, whether it needs whole prompt groups in each
    micro-batch), from its :class:`lossagg.DenomProduct`; ValueError naming the mode (as ``what``)
    and the factor when ``d[i]`` cannot be served by a :class:`DeferredPlan`. Whether it needs
    whole sessions is :func:`whole_sessions`."""
    what = what or f"mode={spec.name}"
    product = spec.denoms
    if not isinstance(product, DenomProduct):
        raise ValueError(
            f"DeferredPlan cannot serve {what}: its d[i] is a function, which does not declare when each of its factors is known "
            "(declare it as a lossagg.DenomProduct of the factors in docs/modes.md)"
        )
    late = [f for f in product.factors if FACTORS[f].known not in ("setting", "sample", "session", "group", "step")]
    if late:
        raise ValueError(f"DeferredPlan cannot serve {what}: its factor {late[0]} is not known by the end of the step")
    step = tuple(f for f in product.factors if FACTORS[f].known == "step")
    return step, any(FACTORS[f].known == "group" for f in product.factors)


def whole_sessions(spec: ModeSpec) -> bool:
    """Whether ``spec``'s ``d[i]`` has a factor known when a sample's session has run (each session
    whole in one micro-batch): ``K[s(i)]``, ``c(Ts[s(i)])``, or a group's sessions ``Sp[g(i)]``."""
    product = spec.denoms
    return isinstance(product, DenomProduct) and any(FACTORS[f].known == "session" for f in product.factors)


#: The per-sample totals a micro-batch computes itself when its sessions (or groups) lie whole in it.
_LOCAL_TOTALS = ("group_token_sums", "session_sizes", "session_token_sums", "group_sessions")


def _value(symbols: tuple[str, ...], read: Mapping[str, Any]) -> float:
    """The product of step-level factors ``symbols`` from the totals a mode reads (``read``), as
    :class:`lossagg.DenomProduct` evaluates it; 1.0 for none."""
    if not symbols:
        return 1.0
    ones = torch.ones(1, dtype=torch.float64)
    return float(DenomProduct(*symbols)(DenomInputs(ones, read, None))[0])


def _ratio(used: float, final: float) -> float:
    """``G_used / G``; 1 for a step without samples (``N = 0``: no numerator, J = 0, nothing to rescale)."""
    return used / final if final != 0.0 else 1.0


@dataclass(frozen=True)
class DeferredStep:
    """What :meth:`DeferredPlan.close` found: the step's final totals, the rescale, the logged values.

    * ``scale``: ``G_used / G``. The accumulated gradients, and the loss contributions the
      micro-batches returned, times ``scale`` are those of the step's J (:meth:`apply_`).
    * ``plan``: the :class:`lossagg.StepPlan` of the step with its final masks (``plan.sample_denoms``
      the final ``d[i]`` of this rank's samples, ``plan.totals`` the final step totals).
    * ``loss``, ``terms``, ``metrics``: the step's J, each term's ``J_k`` before its coefficient, and
      each metric under the default reducer, over every micro-batch and rank (DP and CP), final:
      the same numbers on every rank, for a tracker.
    * ``metric_scale``: the default reducer's own rescale (its contributions from
      :meth:`DeferredPlan.metrics` times ``metric_scale`` are final).
    """

    scale: float
    metric_scale: float
    plan: StepPlan
    loss: float | None = None
    terms: Mapping[str, float] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)

    @property
    def totals(self):
        return self.plan.totals

    @property
    def empty(self) -> bool:
        """Whether the step, with its final masks, holds no loss token on any rank (:attr:`lossagg.StepPlan.empty`)."""
        return self.plan.empty

    def apply_(self, target) -> int:
        """Multiply the accumulated gradients by :attr:`scale`, in place; returns how many tensors
        were scaled. Call it after the last micro-batch's backward (and the engine's gradient
        reduction) and before clipping and ``optimizer.step()``.

        ``target`` is a module (torch DDP and FSDP2 included: an FSDP2 gradient is a sharded
        DTensor, scaled shard by shard), an optimizer (its parameters' gradients), an iterable of
        parameters or gradient tensors, or a Megatron-Core ``DistributedDataParallel`` (its
        ``scale_gradients``, which scales the gradient buffers). A parameter's ``main_grad``
        (Megatron's buffer view) is scaled instead of its ``grad`` when it has one; a tensor shared
        by several parameters is scaled once."""
        if callable(getattr(target, "scale_gradients", None)):  # Megatron-Core's DDP: its gradient buffers
            target.scale_gradients(self.scale)
            return 1
        if isinstance(target, torch.optim.Optimizer):
            params: Iterable = (p for group in target.param_groups for p in group["params"])
        elif isinstance(target, torch.nn.Module):
            params = target.parameters()
        elif isinstance(target, Iterable) and not isinstance(target, (str, bytes, torch.Tensor)):
            params = target
        else:
            raise TypeError(
                "DeferredStep.apply_: target must be a module, an optimizer, an iterable of parameters or gradient tensors, "
                f"or an object with scale_gradients (Megatron-Core's DistributedDataParallel), got {type(target).__name__}"
            )
        seen, grads = set(), []
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"DeferredStep.apply_: target must yield tensors, got {type(p).__name__}")
            if getattr(p, "main_grad", None) is not None:  # Megatron's view into its gradient buffer
                g = p.main_grad
            elif isinstance(p, torch.nn.Parameter) or p.requires_grad:
                g = p.grad
            else:  # a gradient tensor itself
                g = p
            if g is None or id(g) in seen:
                continue
            if not (g.is_floating_point() or g.is_complex()):  # checked for all before any is scaled: never half-applied
                raise TypeError(
                    f"DeferredStep.apply_: a gradient of dtype {g.dtype} cannot be scaled by {self.scale!r} in place (gradients are "
                    "floating): pass the parameters, or floating gradient tensors"
                )
            seen.add(id(g))
            grads.append(g)
        with torch.no_grad():
            for g in grads:
                g.mul_(self.scale)
        scaled = len(grads)
        return scaled


class DeferredPlan:
    """The plan of one optimizer step whose final masks are known only as the loss runs (module docstring).

    Args:
        config: the aggregation config (its mode and its terms' reducers must be servable:
            :func:`deferred_factors`; terms must share their step-level factors, since one
            rescale serves the whole gradient).
        num_local_samples: this rank's samples in the step (``samples`` of the micro-batches
            are positions among them).
        process_group: the DP group: :meth:`close` gathers the step totals over it (one sum
            all-reduce, plus one max all-reduce for a mode with a maximum).
        cp_group: the CP group, when each rank holds a shard of every sample's tokens: each
            micro-batch's kept tokens are summed over it as it runs (one all-reduce of ``B``
            numbers), and the logged values at :meth:`close`.
        group_index, num_group_labels: prompt groups, as for :class:`lossagg.StepPlan`
            (needed by a grouped mode).
        session_index, num_session_labels: sessions, as for :class:`lossagg.StepPlan` (needed by
            a mode with sessions; each session lies whole in one micro-batch of one rank, since
            its samples and tokens are read when its micro-batch runs).
        sample_weights: ``[num_local_samples]`` weights, as for :class:`lossagg.StepPlan`.
        estimate: the step totals to use in the micro-batches' denominators until the final
            ones are known (``G_used``): a :class:`lossagg.StepPlan` of the step (its rollout
            masks, say), or a mapping of totals by name (``StepPlan.from_totals``'s keywords),
            the same on every rank. None: 1 for every step-level factor. With an estimate close
            to the final totals, :attr:`DeferredStep.scale` is close to 1 (docs/composition.md
            on why that matters for bf16 and fp16 gradients).
        metrics: the names of the metrics the step reports through :meth:`metrics`, declared so
            that a rank that holds no sample (or reports a metric on none of its samples) sends
            the same buffer at :meth:`close`; a metric reported but not declared is added as it
            comes. At :meth:`close` the ranks check that they report the same terms and metrics
            (one all-reduce of a few numbers), and every rank raises, naming the difference, if not.

    A plan belongs to one step of one rank: a micro-batch's samples are checked and recorded
    atomically (two threads giving the same samples get one micro-batch and one error), but the
    plan is not meant to be shared between threads otherwise (docs/composition.md).
    """

    def __init__(
        self,
        config,
        num_local_samples: int,
        *,
        process_group=None,
        cp_group=None,
        group_index: torch.Tensor | None = None,
        num_group_labels: int | None = None,
        session_index: torch.Tensor | None = None,
        num_session_labels: int | None = None,
        sample_weights: torch.Tensor | None = None,
        estimate: StepPlan | Mapping[str, Any] | None = None,
        metrics: Sequence[str] = (),
    ):
        if not isinstance(config, LossAggregationConfig):
            config = LossAggregationConfig.coerce(config)
        n = as_int("num_local_samples", num_local_samples, minimum=0)
        self.config = config
        self.num_local_samples = n
        self.process_group = check_process_group(process_group, "process_group", "the DP group of this rank")
        self.cp_group = check_process_group(cp_group, "cp_group", "the CP group of this rank")
        self.num_group_labels = num_group_labels
        self.num_session_labels = num_session_labels
        self._names = (PG_TERM, *config.terms)
        self._coefficients = [1.0, *(t.coefficient for t in config.terms.values())]
        specs = {PG_TERM: mode_spec(config.mode).weighted(config.weighting)}
        specs.update({name: mode_spec(t.mode).weighted(t.weighting) for name, t in config.terms.items()})
        self._specs = specs
        self._metric_spec = mode_spec(default_term_mode(config.mode))
        step_factors, whole_groups = {}, False
        for name, spec in specs.items():
            what = f"mode={spec.name}" if name == PG_TERM else f"term {name!r} (mode={spec.name})"
            step_factors[name], groups = deferred_factors(spec, what)
            whole_groups = whole_groups or groups
        pg_step = step_factors[PG_TERM]
        for name, factors in step_factors.items():
            if sorted(factors) != sorted(pg_step):
                raise ValueError(
                    f"DeferredPlan cannot serve term {name!r} (mode={specs[name].name}) beside the PG term (mode={specs[PG_TERM].name}): "
                    f"one rescale after the last micro-batch serves the whole gradient, so every term must divide by the same step-level "
                    f"factors, and {name!r} has {' · '.join(factors) or 'none'} where the PG term has {' · '.join(pg_step) or 'none'}: "
                    f"give {name!r} the PG term's mode and weighting (mode={config.mode}"
                    + (f", weighting={config.weighting}" if config.weighting != "none" else "")
                    + "), or, "
                    "when the filter does not change the step's counts, use a StepPlan of the rollout masks"
                )
        self._step_factors = pg_step
        self._metric_step_factors, _ = deferred_factors(self._metric_spec)
        self._whole_groups = whole_groups
        sessions = any(spec.needs_sessions for spec in specs.values())
        self._whole_sessions = any(whole_sessions(spec) for spec in specs.values())
        # groups holding sessions: n_samples_per_prompt counts sessions, so a group is whole when all of this rank's samples are
        self._groups_of_samples = whole_groups and not any("group_sessions" in spec.totals for spec in specs.values())
        self.sample_weights = check_sample_weights(
            sample_weights, {PG_TERM: config.weighting, **{k: t.weighting for k, t in config.terms.items()}}, n, torch.device("cpu"), "DeferredPlan"
        )
        self.group_index = None
        if group_index is not None or whole_groups:
            self.group_index = check_group_index(group_index, n, torch.device("cpu"), specs[PG_TERM].name).long().cpu()
        self.session_index = None
        if session_index is not None or sessions:
            self.session_index = check_session_index(session_index, n, torch.device("cpu"), specs[PG_TERM].name).long().cpu()
        if self._groups_of_samples and config.n_samples_per_prompt is None:
            raise ValueError(
                f"DeferredPlan: mode={specs[PG_TERM].name} reads c(Sg[g(i)]), known when a micro-batch runs only if each prompt group lies "
                "whole in it: set n_samples_per_prompt in the config so that the plan can check it"
            )
        self._estimate_read = self._estimate(estimate)
        self._used = _value(self._step_factors, self._estimate_read)
        self._metric_used = _value(self._metric_step_factors, self._estimate_read)
        # what the micro-batches have told: each sample's final kept tokens, on the first mask's device
        self._counts: torch.Tensor | None = None
        self._seen = torch.zeros(n, dtype=torch.bool)
        self._seen_groups: set[int] = set()
        self._seen_sessions: set[int] = set()
        # the logged values, summed over the ranks at close(): every term's from the start, so that a
        # rank with no sample still sends the same buffer (every rank must report the same metrics)
        self._logged: dict[str, torch.Tensor] = {f"term:{n}": torch.zeros((), dtype=torch.float64) for n in self._names}
        if isinstance(metrics, str) or not isinstance(metrics, (list, tuple)) or not all(isinstance(k, str) for k in metrics):
            raise TypeError(f"metrics must be a list of the metric names every rank reports (strings), got {metrics!r}")
        self._logged.update({f"metric:{k}": torch.zeros((), dtype=torch.float64) for k in metrics})
        # each metric's samples counted so far (a metric is given once per sample)
        self._metric_samples: dict[str, torch.Tensor] = {}
        # one micro-batch at a time is recorded (a plan shared by threads checks and records atomically)
        self._lock = threading.Lock()
        # every micro-batch made, with the terms' J_k its loss returned (summed at close())
        self._logs: list[MicroBatchLog] = []
        self._closed: DeferredStep | None = None

    # ---------------------------------------------------------------- set-up
    def _estimate(self, estimate) -> dict[str, Any]:
        """The totals the step-level factors read until the final ones are known (1 without an estimate)."""
        needed = {FACTORS[f].reads for f in (*self._step_factors, *self._metric_step_factors)}
        empty = self.config.empty_samples
        if estimate is None:
            return {name: 1.0 for name in needed}
        totals = estimate.totals if isinstance(estimate, StepPlan) else estimate
        if not isinstance(totals, Mapping):
            raise TypeError(f"estimate must be a StepPlan or a mapping of step totals by name, got {type(estimate).__name__}")
        missing = [name for name in mode_totals(tuple(needed), empty) if name not in totals]
        if missing:
            raise ValueError(
                f"estimate must hold the step total(s) {', '.join(missing)} that mode={self.config.mode} reads until the final ones are "
                f"known, got {', '.join(map(str, totals)) or 'none'}"
            )
        read = read_totals(tuple(needed), totals, empty, self.config.mode)
        out = {}
        for name in needed:
            value = read[name]
            number = plain_number(value)  # a Python or NumPy number, or a 0-dim tensor
            if number is None or not math.isfinite(float(number)) or float(number) < 0:
                raise ValueError(f"estimate: the step total {name} must be a finite number >= 0, got {value!r}")
            out[name] = float(number)
        return out

    # ---------------------------------------------------------- one micro-batch
    def micro_batch(self, samples: Samples, mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *, step_layout: bool = False) -> MicroBatch:
        """One micro-batch of the step with its final (post-filter) ``mask``, checked once: its
        samples' kept tokens are recorded (summed over the CP group: one all-reduce of ``B``
        numbers) and its denominators known so far computed, for :meth:`loss` and :meth:`metrics`
        (arguments as for :meth:`lossagg.StepPlan.micro_batch`). Each sample's final mask is given
        once in a step; every micro-batch made must run its :meth:`loss` before :meth:`close`."""
        mb = self._micro_batch(samples, mask, cu_seqlens, step_layout)
        self._logs.append(mb.log)
        return mb

    def _micro_batch(self, samples, mask, cu_seqlens, step_layout: bool) -> MicroBatch:
        """:meth:`micro_batch`, not yet listed among the step's micro-batches."""
        self._check_open("micro_batch")
        check_holds_data("mask", mask)
        check_holds_data("cu_seqlens", cu_seqlens)
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
        pos = sample_positions(samples, self.num_local_samples, torch.device("cpu"))
        tokens = None
        if step_layout:
            tokens, mask, cu_seqlens = cut_from_step(pos, mask, cu_seqlens)
        check_layout(pos.shape[0], mask, cu_seqlens)
        groups = self._register(pos, mask, cu_seqlens)
        try:
            rows, weights = [], []
            for n in self._names:
                spec = self._specs[n]
                divisor = self.config.divisor if n == PG_TERM else self.config.terms[n].divisor
                rows.append(self._used_denoms(spec, divisor, pos, f"mode={spec.name}"))
                weighting = self.config.weighting if n == PG_TERM else self.config.terms[n].weighting
                weights.append(None if weighting == "none" else self.sample_weights[pos])
            table = None
            if any(w is not None for w in weights):
                table = torch.stack([torch.ones(pos.shape[0], dtype=torch.float64) if w is None else w for w in weights])
            tables = term_tables(torch.stack(rows), table, mask.device)
        except BaseException:
            self._unregister(pos, groups)
            raise
        return MicroBatch(self, self._names, self._coefficients, pos, mask, cu_seqlens, tables, tokens, MicroBatchLog(pos))

    def _check_open(self, what: str) -> None:
        if self._closed is not None:
            raise RuntimeError(f"DeferredPlan.{what}: the step is closed (close() ran); build a new plan for the next step")

    def _register(self, pos: torch.Tensor, mask: torch.Tensor, cu_seqlens) -> list[int]:
        """Record the micro-batch's samples and their final kept tokens (summed over the CP group);
        returns the prompt groups it recorded (for :meth:`_unregister`)."""
        kept = _token_counts(mask, cu_seqlens).to(torch.float64)
        if self.cp_group is not None:  # each CP rank holds a shard of every sample's tokens
            torch.distributed.all_reduce(kept, group=self.cp_group)
        with self._lock:
            return self._record(pos, kept)

    def _record(self, pos: torch.Tensor, kept: torch.Tensor) -> list[int]:
        again = pos[self._seen[pos]]
        if again.numel():
            raise ValueError(
                f"samples: sample {int(again[0])} already ran in an earlier micro-batch of this step (each sample's final mask is "
                "given once, by micro_batch() or loss(); metrics() reads what they recorded)"
            )
        groups = self._check_whole_groups(pos) if self._whole_groups else []
        sessions = self._check_whole(pos, self.session_index, self._seen_sessions, "session") if self._whole_sessions else []
        groups = [("group", g) for g in groups] + [("session", s) for s in sessions]
        if self._counts is None:
            self._counts = torch.full((self.num_local_samples,), -1.0, dtype=torch.float64, device=kept.device)
        self._counts[pos.to(kept.device)] = kept
        self._seen[pos] = True
        self._seen_groups.update(g for kind, g in groups if kind == "group")
        self._seen_sessions.update(g for kind, g in groups if kind == "session")
        return groups

    def _unregister(self, pos: torch.Tensor, groups: list[tuple[str, int]]) -> None:
        """Forget a micro-batch whose loss failed, so that nothing is half-applied."""
        with self._lock:
            self._seen[pos] = False
            self._counts[pos.to(self._counts.device)] = -1.0
            self._seen_groups.difference_update(g for kind, g in groups if kind == "group")
            self._seen_sessions.difference_update(g for kind, g in groups if kind == "session")

    def _check_whole(self, pos: torch.Tensor, index: torch.Tensor, seen: set[int], what: str) -> list[int]:
        """Each ``what`` (session, or prompt group holding sessions) of the micro-batch holds all of
        this rank's samples of it and none ran before; one that straddles ranks is found at :meth:`close`."""
        labels, sizes = torch.unique(index[pos], return_counts=True)
        all_labels, all_sizes = torch.unique(index, return_counts=True)
        local = dict(zip(all_labels.tolist(), all_sizes.tolist(), strict=True))
        for label, size in zip(labels.tolist(), sizes.tolist(), strict=True):
            if size != local[label] or label in seen:
                raise ValueError(
                    f"DeferredPlan: {what} {label} has {size} of this rank's {local[label]} samples of it in this micro-batch"
                    + (" and more in an earlier one" if label in seen else "")
                    + f": mode={self._specs[PG_TERM].name} reads its samples and tokens when its micro-batch runs, which is final only if "
                    f"each {what} lies whole in one micro-batch (put a {what}'s samples in one micro-batch, or use a StepPlan of the "
                    "rollout masks when the filter does not change the counts)"
                )
        return labels.tolist()

    def _check_whole_groups(self, pos: torch.Tensor) -> list[int]:
        if not self._groups_of_samples:
            return self._check_whole(pos, self.group_index, self._seen_groups, "prompt group")
        n = self.config.n_samples_per_prompt
        labels, sizes = torch.unique(self.group_index[pos], return_counts=True)
        for label, size in zip(labels.tolist(), sizes.tolist(), strict=True):
            if size != n or label in self._seen_groups:
                raise ValueError(
                    f"DeferredPlan: prompt group {label} has {size} of its {n} samples in this micro-batch"
                    + (" and more in an earlier one" if label in self._seen_groups else "")
                    + f": mode={self._specs[PG_TERM].name}'s c(Sg[g(i)]) is known when a micro-batch runs only if each group lies whole "
                    "in one micro-batch (put a group's samples in one micro-batch, or use a mode without Sg)"
                )
        return labels.tolist()

    def _used_denoms(self, spec: ModeSpec, divisor, pos: torch.Tensor, what: str) -> torch.Tensor:
        """``d_used[i]`` of the micro-batch's samples under ``spec`` (float64 ``[B]``): the step-level
        factors from the estimate, the others final."""
        kept = self._counts[pos.to(self._counts.device)]
        read = dict(self._estimate_read)
        read.update(self._local_totals(spec, pos, kept))
        d = spec.denoms(DenomInputs(kept, read, None if divisor is None else float(divisor)))
        return check_denoms(d, what, tuple(kept.shape), {k: v for k, v in read.items() if isinstance(v, float)}, kept.device)

    def _local_totals(self, spec: ModeSpec, pos: torch.Tensor, kept: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-sample totals ``spec`` reads, from the micro-batch's own samples (its groups and
        sessions lie whole in it), as the mode reads them under ``empty_samples``."""
        out: dict[str, torch.Tensor] = {}
        wanted = [name for name in _LOCAL_TOTALS if name in spec.totals]
        if not wanted:
            return out
        share = rank_share(
            tuple(wanted),
            kept,
            None if self.group_index is None else self.group_index[pos].to(kept.device),
            mode=spec.name,
            session_index=None if self.session_index is None else self.session_index[pos].to(kept.device),
        )
        empty = self.config.empty_samples
        gathered = {}
        for name in mode_totals(tuple(wanted), empty):
            total = TOTALS[name]
            gathered[name] = total.value(total.share(share), share)
        return {name: read_as(name, gathered, empty) for name in wanted}

    def loss(
        self,
        values: torch.Tensor | Mapping[str, torch.Tensor],
        micro_batch: MicroBatch | torch.Tensor,
        samples: Samples | None = None,
        cu_seqlens: torch.Tensor | None = None,
        *,
        parts: bool = False,
    ):
        """This micro-batch's contribution to the whole loss ``J = Σ_k c_k J_k`` (docs/terms.md) with
        its final mask and the denominators known so far: times :attr:`DeferredStep.scale` it is the
        step's. Arguments and result as for :meth:`lossagg.StepPlan.loss` (the same reduction,
        lossagg/micro_batch.py); given (mask, samples, cu_seqlens) instead of a
        :class:`lossagg.MicroBatch`, the micro-batch is made here, and forgotten if the loss fails."""
        self._check_open("loss")
        mb = given_micro_batch(self, micro_batch, samples, cu_seqlens, "DeferredPlan.loss")
        if mb is not None:
            return reduce_micro_batch(values, mb, parts=parts, what="DeferredPlan.loss")
        mb = self._micro_batch(samples, micro_batch, cu_seqlens, False)
        try:
            out = reduce_micro_batch(values, mb, parts=parts, what="DeferredPlan.loss")
        except BaseException:
            self._unregister(mb.samples, self._groups_of(mb.samples))
            raise
        self._logs.append(mb.log)
        return out

    def _groups_of(self, pos: torch.Tensor) -> list[tuple[str, int]]:
        groups = [("group", g) for g in torch.unique(self.group_index[pos]).tolist()] if self._whole_groups else []
        return groups + ([("session", g) for g in torch.unique(self.session_index[pos]).tolist()] if self._whole_sessions else [])

    def metrics(
        self,
        metrics: Mapping[str, torch.Tensor],
        micro_batch: MicroBatch | torch.Tensor,
        samples: Samples | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Contributions of per-token metrics under the default reducer (as
        :meth:`lossagg.StepPlan.metrics`), with the final counts recorded by this micro-batch
        (a :class:`lossagg.MicroBatch`, or mask, samples and cu_seqlens of samples whose loss ran):
        times :attr:`DeferredStep.metric_scale` they are final, and :attr:`DeferredStep.metrics`
        holds the step's values (summed over the ranks at :meth:`close`: every rank reports the
        same metric names)."""
        self._check_open("metrics")
        mb = given_micro_batch(self, micro_batch, samples, cu_seqlens, "DeferredPlan.metrics")
        if mb is None:
            mask = micro_batch
            check_holds_data("mask", mask)
            pos = sample_positions(samples, self.num_local_samples, torch.device("cpu"))
        else:
            mask, cu_seqlens, pos = mb.mask, mb.cu_seqlens, mb.samples
        missing = pos[~self._seen[pos]]
        if missing.numel():
            raise ValueError(
                f"DeferredPlan.metrics: sample {int(missing[0])} has no final mask yet: make its micro-batch (micro_batch() or loss()) first"
            )
        d = self._used_denoms(self._metric_spec, None, pos, f"mode={self._metric_spec.name} (the metrics reducer)")
        out = reduce_metrics(metrics, mask, cu_seqlens, d)
        with self._lock:
            for k in out:
                done = self._metric_samples.get(k)
                if done is not None and bool(done[pos].any()):
                    again = int(pos[done[pos]][0])
                    raise ValueError(
                        f"DeferredPlan.metrics: metric {k!r} was already reported for sample {again} in this step (each metric is given "
                        "once per sample: a second report would count it twice)"
                    )
            for k, v in out.items():
                self._metric_samples.setdefault(k, torch.zeros(self.num_local_samples, dtype=torch.bool))[pos] = True
                self._log(f"metric:{k}", v)
        return out

    def _log(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().to(torch.float64)
        # on the value's device (no host sync per micro-batch)
        self._logged[name] = value if name not in self._logged else self._logged[name].to(value.device) + value

    # --------------------------------------------------------------- the end
    def _local_problem(self) -> str | None:
        """What keeps this rank from closing the step, or None."""
        missing = torch.nonzero(~self._seen).flatten()
        if missing.numel():
            shown = ", ".join(map(str, missing[:8].tolist())) + (", ..." if missing.numel() > 8 else "")
            return (
                f"DeferredPlan.close: {missing.numel()} of this rank's {self.num_local_samples} samples never ran a micro-batch ({shown}): "
                "every sample's final mask must be given by micro_batch() or loss() before the step closes"
            )
        idle = [log for log in self._logs if log.parts is None]
        if idle:
            shown = ", ".join(map(str, idle[0].samples[:8].tolist()))
            return (
                f"DeferredPlan.close: {len(idle)} micro-batch(es) made by micro_batch() never ran loss() (the first holds samples {shown}): "
                "their terms would be missing from the step's J"
            )
        return None

    def _agree(self, problem: str | None) -> None:
        """Every rank closes the step or none does: over the CP group, then the DP group, one MAX
        all-reduce of a few numbers (whether a rank cannot close, and the count and a checksum of
        the names its buffer holds); a rank that cannot close, or buffers that differ, make every
        rank raise, naming the cause, before any all-reduce of the values (whose layouts would
        differ: a number on one rank and an error on another)."""
        groups = [g for g in (self.cp_group, self.process_group) if g is not None]
        if not groups:
            return
        names = sorted(set(self._logged))
        checksum = float(zlib.crc32("\n".join(names).encode()))
        failed, differ = (1.0 if problem is not None else 0.0), 0.0
        for group in groups:  # a flag raised in the CP group reaches the DP group through the ranks it shares
            buf = torch.tensor([failed, differ, len(names), checksum, -len(names), -checksum], dtype=torch.float64)
            torch.distributed.all_reduce(buf, op=torch.distributed.ReduceOp.MAX, group=group)
            failed = float(buf[0])
            differ = 1.0 if buf[1] > 0 or buf[2] != -buf[4] or buf[3] != -buf[5] else 0.0
        if problem is not None:
            raise ValueError(problem + " (the other ranks are told and raise too)")
        if failed:
            raise ValueError(
                "DeferredPlan.close: another rank could not close the step (it raises its own error, naming what it lacks), so no rank "
                "takes a number from this step"
            )
        if differ:
            shown = ", ".join(n.split(":", 1)[1] + (" (metric)" if n.startswith("metric:") else "") for n in names)
            raise ValueError(
                "DeferredPlan.close: the ranks do not report the same terms and metrics, so their buffers cannot be summed (this rank's: "
                f"{shown}): every rank must report the same metric names, a rank without samples included; declare them with "
                "DeferredPlan(..., metrics=[...])"
            )

    def _check_local_totals(self, plan: StepPlan, counts: torch.Tensor) -> None:
        """The per-sample totals the micro-batches computed from their own samples equal the step's
        (a session or group whose samples lie on several ranks makes them differ): ValueError naming it."""
        everything = torch.arange(self.num_local_samples)
        for name, spec in self._specs.items():
            local = self._local_totals(spec, everything, counts)
            if not local:
                continue
            final = read_totals(spec.totals, plan.totals, self.config.empty_samples, spec.name)
            for total, values in local.items():
                differ = values.to(torch.float64) != final[total].to(values.device, torch.float64)
                if bool(differ.any()):
                    i = int(differ.nonzero()[0, 0])
                    kind = "session" if "session" in total else "prompt group"
                    label = (self.session_index if kind == "session" else self.group_index)[i]
                    raise ValueError(
                        f"DeferredPlan.close: {TOTALS[total].symbol} of sample {i} is {float(final[total][i]):g} over the step but "
                        f"{float(values[i]):g} on this rank: its {kind} {int(label)} has samples on another rank, and "
                        f"mode={spec.name} (term {name!r}) reads it when its micro-batch runs: keep each {kind} on one rank"
                    )

    def close(self) -> DeferredStep:
        """After the last micro-batch: the step totals of the final masks (one sum all-reduce over the
        process group, plus one max all-reduce for a mode with a maximum; the logged values ride in
        the sum, after one all-reduce over the CP group when there is one) and the rescale."""
        if self._closed is not None:
            return self._closed
        problem = self._local_problem()
        self._agree(problem)
        if problem is not None:  # one process: no rank to tell
            raise ValueError(problem)
        sums = dict(self._logged)  # (a close() that fails leaves the plan as it was)
        for log in self._logs:  # the terms' J_k, in the order the micro-batches were made
            for n, part in zip(self._names, log.parts, strict=True):
                part = part.detach().to(torch.float64)
                sums[f"term:{n}"] = sums[f"term:{n}"].to(part.device) + part
        counts = self._counts if self._counts is not None else torch.zeros(0, dtype=torch.float64)
        keys = sorted(sums)
        logged = torch.stack([sums[k].to(counts.device) for k in keys]) if keys else None
        if logged is not None and self.cp_group is not None:
            torch.distributed.all_reduce(logged, group=self.cp_group)
        plan = StepPlan(
            self.config,
            counts,
            group_index=None if self.group_index is None else self.group_index.to(counts.device),
            process_group=self.process_group,
            num_group_labels=self.num_group_labels,
            session_index=None if self.session_index is None else self.session_index.to(counts.device),
            num_session_labels=self.num_session_labels,
            sample_weights=self.sample_weights,
            _extra_sums=logged,
        )
        self._check_local_totals(plan, counts)
        empty = self.config.empty_samples
        final = read_totals(tuple(FACTORS[f].reads for f in self._step_factors), plan.totals, empty, self._specs[PG_TERM].name)
        scale = _ratio(self._used, _value(self._step_factors, final))
        metric_final = read_totals(tuple(FACTORS[f].reads for f in self._metric_step_factors), plan.totals, empty, self._metric_spec.name)
        metric_scale = _ratio(self._metric_used, _value(self._metric_step_factors, metric_final))
        values = dict(zip(keys, logged.tolist() if logged is not None else [], strict=True))
        terms = {n: values[f"term:{n}"] * scale for n in self._names}
        loss = sum(self._coefficients[i] * terms[n] for i, n in enumerate(self._names))
        metrics = {k.split(":", 1)[1]: v * metric_scale for k, v in values.items() if k.startswith("metric:")}
        self._closed = DeferredStep(scale=scale, metric_scale=metric_scale, plan=plan, loss=loss, terms=terms, metrics=metrics)
        return self._closed
