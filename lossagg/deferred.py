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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lossagg.config import LossAggregationConfig
from lossagg.config.model import PG_TERM
from lossagg.denom_program import FACTORS, DenomInputs, DenomProduct, step_product
from lossagg.denominators import check_denoms
from lossagg.layout import token_counts as _token_counts
from lossagg.ledger import StepLedger
from lossagg.micro_batch import (
    MicroBatch,
    MicroBatchLog,
    Plan,
    Samples,
    check_layout,
    cut_from_step,
    given_micro_batch,
    reduce_metrics,
    reduce_micro_batch,
    sample_positions,
    stack_term_tables,
    term_tables,
)
from lossagg.modes import ModeSpec
from lossagg.samples import RankSamples
from lossagg.step import LabelLayout, StepPlan
from lossagg.totals import MAX_GROUP_LABELS, TOTALS, all_reduce_with_head, mode_totals, rank_share, read_as, read_totals
from lossagg.validate import check_holds_data, check_process_group, plain_number

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
                    f"DeferredStep.apply_: target holds a gradient of dtype {g.dtype}, which cannot be scaled by {self.scale!r} in place "
                    "(gradients are floating): pass the parameters, or floating gradient tensors, as target"
                )
            seen.add(id(g))
            grads.append(g)
        with torch.no_grad():
            for g in grads:
                g.mul_(self.scale)
        scaled = len(grads)
        return scaled


class DeferredPlan(Plan):
    """The plan of one optimizer step whose final masks are known only as the loss runs (module docstring):
    its arithmetic (the denominators known so far, the rescale at :meth:`close`) over a
    :class:`lossagg.ledger.StepLedger` (what the step recorded, open then closed).

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
        group_index, session_index, sample_weights, num_group_labels, num_session_labels: this
            rank's samples' labels, weights and label bounds, as for :class:`lossagg.StepPlan` (each
            session, and each prompt group a mode reads when its micro-batch runs, lies whole in
            one micro-batch of one rank).
        estimate: the step totals to use in the micro-batches' denominators until the final
            ones are known (``G_used``): a :class:`lossagg.StepPlan` of the step (its rollout
            masks, say), or a mapping of totals by name (``StepPlan.from_totals``'s keywords),
            the same on every rank (checked at :meth:`close`). None: 1 for every step-level factor.
            With an estimate close to the final totals, :attr:`DeferredStep.scale` is close to 1
            (docs/composition.md on why that matters for bf16 and fp16 gradients).
        metrics: the names of the metrics the step reports through :meth:`metrics`, declared so
            that a rank that holds no sample (or reports a metric on none of its samples) sends
            the same buffer at :meth:`close`. With a process group (or a CP group) every metric
            reported must be declared; without one, a metric not declared is added as it comes.

    At :meth:`close` every rank closes the step or every rank raises, naming why: what a rank lacks
    (a sample that never ran, a micro-batch whose loss did not run, an undeclared metric, a label
    out of range) travels in the one totals all-reduce, with a fingerprint of the terms, metrics
    and estimate every rank must share. A plan belongs to one step of one rank: a micro-batch's
    samples are checked and recorded atomically (two threads giving the same samples get one
    micro-batch and one error), but the plan is not meant to be shared between threads otherwise
    (docs/composition.md).
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
        self.config = config
        self.process_group = check_process_group(process_group, "process_group", "the DP group of this rank")
        self.cp_group = check_process_group(cp_group, "cp_group", "the CP group of this rank")
        self._terms = config.loss_terms
        pg = self._terms[0]
        step_factors, whole_groups = {}, False
        for term in self._terms:
            step_factors[term.name], groups = deferred_factors(term.spec, term.what)
            whole_groups = whole_groups or groups
        for term in self._terms[1:]:
            if sorted(step_factors[term.name]) != sorted(step_factors[PG_TERM]):
                raise ValueError(_different_factors(config, term, step_factors[term.name], step_factors[PG_TERM]))
        self._step_factors = step_factors[PG_TERM]
        self._metric_spec = config.metric_spec
        self._metric_step_factors, _ = deferred_factors(self._metric_spec)
        self._step_reads = tuple(FACTORS[f].reads for f in self._step_factors)  # the totals each reads, for close
        self._metric_step_reads = tuple(FACTORS[f].reads for f in self._metric_step_factors)
        per_sample = (group_index, session_index, sample_weights, num_group_labels, num_session_labels)
        self.samples = RankSamples.of(config, None, *per_sample, num_samples=num_local_samples, owner="DeferredPlan")
        self.num_local_samples = n = self.samples.num_samples
        self.sample_weights = self.samples.sample_weights
        self.group_index, self.session_index = self.samples.group_index, self.samples.session_index
        whole = {}
        if whole_groups:  # a group holding sessions is whole when all of this rank's samples of it are (its size varies)
            of_samples = not any("group_sessions" in t.spec.totals for t in self._terms)
            if of_samples and config.n_samples_per_prompt is None:
                raise ValueError(
                    f"DeferredPlan: mode={pg.mode} reads c(Sg[g(i)]), known when a micro-batch runs only if each prompt group lies "
                    "whole in it: set n_samples_per_prompt in the config so that the plan can check it"
                )
            whole["group"] = config.n_samples_per_prompt if of_samples else "rank"
        if any(whole_sessions(t.spec) for t in self._terms):
            whole["session"] = "rank"
        if isinstance(metrics, str) or not isinstance(metrics, (list, tuple)) or not all(isinstance(k, str) for k in metrics):
            raise TypeError(f"metrics must be a list of the metric names every rank reports (strings), got {metrics!r}")
        needed = {FACTORS[f].reads for f in (*self._step_factors, *self._metric_step_factors)}
        self._estimate_read = estimate_read(estimate, needed, config)
        self._used = step_product(self._step_factors, self._estimate_read)
        self._metric_used = step_product(self._metric_step_factors, self._estimate_read)
        agreed = self.process_group is not None or self.cp_group is not None
        self._whole = whole
        self.ledger = StepLedger(n, [t.name for t in self._terms], list(metrics), self.group_index, self.session_index, whole, pg.mode, agreed)
        # one process: the labels' runs found now, so that the close's native pass reads the counts only
        self._layout = None if agreed else LabelLayout.of(config, self.samples)
        self._closed: DeferredStep | None = None

    # ---------------------------------------------------------------- set-up
    # ---------------------------------------------------------- one micro-batch
    def micro_batch(
        self, samples: Samples, mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *, step_layout: bool = False, pieces: bool = False
    ) -> MicroBatch:
        """One micro-batch of the step with its final (post-filter) ``mask``, checked once: its
        samples' kept tokens are recorded (summed over the CP group: one all-reduce of ``B``
        numbers) and its denominators known so far computed, for :meth:`loss` and :meth:`metrics`
        (arguments as for :meth:`lossagg.StepPlan.micro_batch`; ``pieces`` is refused: each
        sample's final mask is one segment). Each sample's final mask is given once in a step;
        every micro-batch made must reduce every term in :meth:`loss` before :meth:`close`."""
        if pieces:
            raise ValueError(
                "DeferredPlan.micro_batch: pieces=True is not served: a deferred plan records each sample's final kept tokens from its one "
                "segment of the layout (give each sample's tokens as one segment)"
            )
        mb = self._micro_batch(samples, mask, cu_seqlens, step_layout)
        self.ledger.add(mb.log)
        return mb

    def _made(self, samples, mask, cu_seqlens) -> MicroBatch:
        return self._micro_batch(samples, mask, cu_seqlens, False)

    def _micro_batch(self, samples, mask, cu_seqlens, step_layout: bool) -> MicroBatch:
        """:meth:`micro_batch`, not yet listed among the step's micro-batches."""
        self.ledger.check_open("micro_batch")
        check_holds_data("mask", mask)
        check_holds_data("cu_seqlens", cu_seqlens)
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
        pos = sample_positions(samples, self.num_local_samples, torch.device("cpu"))
        tokens = None
        if step_layout:
            tokens, mask, cu_seqlens = cut_from_step(pos, mask, cu_seqlens)
        check_layout(pos.shape[0], mask, cu_seqlens)
        kept = _token_counts(mask, cu_seqlens).to(torch.float64)
        if self.cp_group is not None:  # each CP rank holds a shard of every sample's tokens
            torch.distributed.all_reduce(kept, group=self.cp_group)
        labels = self.ledger.record(pos, kept)
        try:
            denoms = {t.name: self._used_denoms(t.spec, t.divisor, pos, t.what) for t in self._terms}
            weights = None if self.sample_weights is None else self.sample_weights[pos]
            tables = term_tables(*stack_term_tables(self._terms, denoms, weights), mask.device)
        except BaseException:
            self.ledger.forget(pos, labels)
            raise
        names = tuple(t.name for t in self._terms)
        log = MicroBatchLog(pos)
        log.labels = labels
        return MicroBatch(self, names, [t.coefficient for t in self._terms], pos, mask, cu_seqlens, tables, tokens, log)

    def _used_denoms(self, spec: ModeSpec, divisor, pos: torch.Tensor, what: str) -> torch.Tensor:
        """``d_used[i]`` of the micro-batch's samples under ``spec`` (float64 ``[B]``): the step-level
        factors from the estimate, the others final."""
        kept = self.ledger.counts[pos.to(self.ledger.counts.device)]
        read = dict(self._estimate_read)
        read.update(self._local_totals(spec, pos, kept))
        d = spec.denoms(DenomInputs(kept, read, None if divisor is None else float(divisor)))
        return check_denoms(d, what, tuple(kept.shape), {k: v for k, v in read.items() if isinstance(v, float)}, kept.device)

    def _local_totals(self, spec: ModeSpec, pos: torch.Tensor, kept: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-sample totals ``spec`` reads, from the micro-batch's own samples (its groups and
        sessions lie whole in it), as the mode reads them under ``empty_samples``."""
        wanted = tuple(name for name in _LOCAL_TOTALS if name in spec.totals)
        if not wanted:
            return {}
        share = rank_share(wanted, self.samples.take(pos, kept), mode=spec.name)
        empty = self.config.empty_samples
        gathered = {}
        for name in mode_totals(wanted, empty):
            total = TOTALS[name]
            gathered[name] = total.value(total.share(share), share)
        return {name: read_as(name, gathered, empty) for name in wanted}

    def _reduce(self, values, mb: MicroBatch, made: bool, **how):
        """The reduction of :meth:`loss`; a micro-batch made by the call itself is listed once its loss
        ran, and forgotten if it failed (nothing half-applied)."""
        self.ledger.check_open("loss")
        if not made:
            return reduce_micro_batch(values, mb, **how)
        try:
            out = reduce_micro_batch(values, mb, **how)
        except BaseException:
            self.ledger.forget(mb.samples, mb.log.labels)
            raise
        self.ledger.add(mb.log)
        return out

    def _metrics(self, metrics, micro_batch, samples, cu_seqlens) -> dict[str, torch.Tensor]:
        """:meth:`metrics` with the counts recorded by the micro-batch (a :class:`lossagg.MicroBatch`, or mask,
        samples and cu_seqlens of samples whose loss ran); each metric once per sample, logged for :meth:`close`."""
        self.ledger.check_open("metrics")
        mb = given_micro_batch(self, micro_batch, samples, cu_seqlens, "DeferredPlan.metrics")
        if mb is None:
            mask = micro_batch
            check_holds_data("mask", mask)
            pos = sample_positions(samples, self.num_local_samples, torch.device("cpu"))
        else:
            mask, cu_seqlens, pos = mb.mask, mb.cu_seqlens, mb.samples
        missing = pos[~self.ledger.seen[pos]]
        if missing.numel():
            raise ValueError(
                f"DeferredPlan.metrics: sample {int(missing[0])} has no final mask yet: make its micro-batch (micro_batch() or loss()) first"
            )
        d = self._used_denoms(self._metric_spec, None, pos, f"mode={self._metric_spec.name} (the metrics reducer)")
        out = reduce_metrics(metrics, mask, cu_seqlens, d)
        for k, v in out.items():
            self.ledger.metric(k, v, pos)
        return out

    # --------------------------------------------------------------- the end
    def _fingerprint(self) -> str:
        """What every rank's plan must share besides the buffer's layout: its terms, metrics and estimate."""
        estimate = ",".join(f"{k}={v!r}" for k, v in sorted(self._estimate_read.items()))
        return f"terms={','.join(t.name for t in self._terms)}|metrics={','.join(self.ledger.declared)}|estimate={estimate}"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (its result is then what a second call returns)."""
        return self._closed is not None

    def close(self) -> DeferredStep:
        """After the last micro-batch: the step totals of the final masks (one sum all-reduce over the
        process group, plus one max all-reduce for a mode with a maximum; the logged values ride in
        the sum, after one all-reduce over the CP group when there is one) and the rescale. What
        keeps a rank from closing travels in those all-reduces: every rank raises, naming it."""
        if self._closed is not None:
            return self._closed
        problem = self.ledger.problem()
        problem = None if problem is None else ValueError(problem)
        counts = self.ledger.counts
        if problem is None and counts is not None and self.process_group is None and self.cp_group is None:
            values = self.ledger.host_sums()
            if values is not None:  # one process, every logged value on the host: no buffer to all-reduce
                s = self.samples
                moved = (None if t is None else t.to(counts.device) for t in (s.group_index, s.session_index, s.sample_weights))
                samples = RankSamples(s.num_samples, counts, *moved, s.num_group_labels, s.num_session_labels)
                # the close reads the plan's totals only: each d is made if the step's plan is read for it
                return self._finish(StepPlan(self.config, samples, _denoms_when_read=True, _layout=self._layout), values)
        sums = self.ledger.sums()
        if problem is not None or counts is None:  # the layout of a rank that cannot close, or holds no sample
            counts = torch.zeros(self.num_local_samples, dtype=torch.float64, device=None if counts is None else counts.device)
        keys = sorted(sums)
        logged = torch.stack([sums[k].to(counts.device) for k in keys])
        if self.cp_group is not None:  # each CP rank logged its shard's contributions (the presence below is not summed over CP)
            problem = all_reduce_with_head(logged, self.cp_group, problem, self._fingerprint(), self.config.mode)
        presence = [] if self.process_group is None else presence_of(self.samples, self._whole, self.config)
        extra = torch.cat([logged, *(p.to(counts.device) for _, p in presence)])
        plan = StepPlan(
            self.config,
            self.samples.with_counts(counts),
            process_group=self.process_group,
            _extra_sums=extra,
            _problem=problem,
            _fingerprint=self._fingerprint(),
        )
        held, at = {}, len(keys)
        for kind, present in presence:
            held[kind], at = extra[at : at + present.numel()], at + present.numel()
        _check_whole_on_one_rank(held, self.config.mode)
        return self._finish(plan, dict(zip(keys, extra[: len(keys)].tolist(), strict=True)))

    def _finish(self, plan: StepPlan, values: dict[str, float]) -> DeferredStep:
        """The step closed: the rescales from the plan's final totals, the logged ``values`` (by ledger key) rescaled."""
        empty = self.config.empty_samples
        totals = plan.totals  # a gathered plan's: every total the factors read is there (read_as under empty_samples)
        final = {name: read_as(name, totals, empty) for name in self._step_reads}
        scale = _ratio(self._used, step_product(self._step_factors, final))
        metric_final = {name: read_as(name, totals, empty) for name in self._metric_step_reads}
        metric_scale = _ratio(self._metric_used, step_product(self._metric_step_factors, metric_final))
        terms = {t.name: values[f"term:{t.name}"] * scale for t in self._terms}
        loss = sum(t.coefficient * terms[t.name] for t in self._terms)
        metrics = {k.split(":", 1)[1]: v * metric_scale for k, v in values.items() if k.startswith("metric:")}
        self.ledger.close()
        self._closed = DeferredStep(scale=scale, metric_scale=metric_scale, plan=plan, loss=loss, terms=terms, metrics=metrics)
        return self._closed


def estimate_read(estimate, needed: set[str], config) -> dict[str, float]:
    """The totals ``needed`` (what the step-level factors read) until the final ones are known: from
    ``estimate`` (a :class:`lossagg.StepPlan` or a mapping of totals by name), or 1 without one; each a
    finite number >= 0."""
    empty = config.empty_samples
    if estimate is None:
        return {name: 1.0 for name in needed}
    totals = estimate.totals if isinstance(estimate, StepPlan) else estimate
    if not isinstance(totals, Mapping):
        raise TypeError(f"estimate must be a StepPlan or a mapping of step totals by name, got {type(estimate).__name__}")
    missing = [name for name in mode_totals(tuple(needed), empty) if name not in totals]
    if missing:
        raise ValueError(
            f"estimate must hold the step total(s) {', '.join(missing)} that mode={config.mode} reads until the final ones are "
            f"known, got {', '.join(map(str, totals)) or 'none'}"
        )
    read = read_totals(tuple(needed), totals, empty, config.mode)
    out = {}
    for name in needed:
        value = read[name]
        number = plain_number(value)  # a Python or NumPy number, or a 0-dim tensor
        try:
            number = None if number is None else float(number)
        except OverflowError:  # an integer beyond float64
            number = None
        if number is None or not math.isfinite(number) or number < 0:
            raise ValueError(f"estimate: the step total {name} must be a finite number >= 0, got {value!r}")
        out[name] = number
    return out


def presence_of(samples: RankSamples, whole: Mapping[str, Any], config) -> list[tuple[str, torch.Tensor]]:
    """For each label kind that must lie whole on one rank (``whole[kind] == "rank"``: sessions, prompt groups
    holding sessions, whose totals are read when their micro-batch runs), 1.0 for each label this rank holds,
    over the step's labels: summed over the ranks in the one totals all-reduce, a label held by two ranks is
    seen by every rank alike (a label out of bounds is the plan's own error)."""
    out = []
    gbs, n = config.global_batch_size, config.n_samples_per_prompt
    for kind, size in whole.items():
        if size != "rank":
            continue
        index = samples.session_index if kind == "session" else samples.group_index
        bound = samples.num_session_labels if kind == "session" else samples.num_group_labels
        if bound is None and gbs is not None:
            bound = gbs if kind == "session" else (gbs // n if n else None)
        if bound is None or bound > MAX_GROUP_LABELS:
            continue  # the plan's own error names the missing bound
        present = torch.zeros(bound, dtype=torch.float64)
        present[index[(index >= 0) & (index < bound)]] = 1.0
        out.append((kind, present))
    return out


def _check_whole_on_one_rank(held: Mapping[str, torch.Tensor], mode: str) -> None:
    """Every rank raises alike for a session (or a prompt group holding sessions) held by several ranks: its
    totals were read when its micro-batch ran, from this rank's samples only."""
    for kind, ranks in held.items():
        split = torch.nonzero(ranks > 1.5).flatten()
        if split.numel():
            what = "session" if kind == "session" else "prompt group"
            raise ValueError(
                f"DeferredPlan.close: {what} {int(split[0])} has samples on {int(round(float(ranks[split[0]])))} ranks "
                f"({split.numel()} such {what}(s)): mode={mode} reads a {what}'s samples and tokens when its micro-batch runs, "
                f"from one rank's samples: keep each {what} on one rank"
            )


def _different_factors(config, term, factors, pg_factors) -> str:
    return (
        f"DeferredPlan cannot serve {term.what} beside the PG term (mode={config.mode}): one rescale after the last micro-batch "
        f"serves the whole gradient, so every term must divide by the same step-level factors, and {term.name!r} has "
        f"{' · '.join(factors) or 'none'} where the PG term has {' · '.join(pg_factors) or 'none'}: give {term.name!r} the PG term's "
        f"mode and weighting (mode={config.mode}"
        + (f", weighting={config.weighting}" if config.weighting != "none" else "")
        + "), or, when the filter does not change the step's counts, use a StepPlan of the rollout masks"
    )
