"""Step planning across micro-batches and data-parallel (DP) ranks (docs/composition.md).

A :class:`StepPlan` is built once per optimizer step on each rank from the rollout token
counts ``M[i]`` of all of this rank's samples. With a DP process group it gathers the step
totals its mode declares (:mod:`lossagg.totals`: the sums in one float64 all-reduce, a
maximum in a second one only when the mode needs it); then it hands each micro-batch its
global denominators ``d[i]`` (``sample_denoms``). A micro-batch's contribution
``reduce(l, m, sample_denoms=d)`` summed over every micro-batch and rank is the step
scalar J, so gradients do not depend on the split.

CP ranks of one DP rank hold the same samples (different tokens): pass the DP group
only, and token counts from the full (unsharded) rollout masks (see
:mod:`lossagg.context_parallel`).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from lossagg.config import LossAggregationConfig
from lossagg.config.model import PG_TERM
from lossagg.denom_program import FACTORS, DenomProduct
from lossagg.denominators import check_denoms, denoms_from_totals
from lossagg.layout import token_counts as _token_counts
from lossagg.micro_batch import (
    MicroBatch,
    Plan,
    Samples,
    check_layout,
    check_slice,
    cut_from_step,
    given_micro_batch,
    positions_and_run,
    reduce_metrics,
    sample_positions,
    stack_term_tables,
    table_rows,
    term_tables,
)
from lossagg.modes import METRIC_MODE, mode_registry, mode_spec
from lossagg.ops import plan_layout as native_plan_layout
from lossagg.ops import plan_totals as native_plan_totals
from lossagg.samples import RankSamples
from lossagg.totals import BASE_TOTALS, LATER, TOTALS, StepTotals, mode_totals, plan_totals, read_totals, stand_in
from lossagg.validate import as_int, check_holds_data, check_process_group

GRADIENT_CONVENTIONS = ("sum", "mean", "micro_batch_mean", "megatron")
_ALL = slice(None)
_STRIDED = torch.strided


def _samples(config, token_counts, group_index, session_index, sample_weights, num_group_labels, num_session_labels, totals) -> RankSamples:
    """This rank's samples as a plan takes them: a :class:`RankSamples` given alone, or its fields, checked once."""
    if isinstance(token_counts, RankSamples):
        given = {
            "group_index": group_index,
            "session_index": session_index,
            "sample_weights": sample_weights,
            "num_group_labels": num_group_labels,
            "num_session_labels": num_session_labels,
        }
        named = [name for name, value in given.items() if value is not None]
        if named:
            raise TypeError(f"StepPlan: the RankSamples record holds the samples' indices and weights; pass it alone, without {', '.join(named)}")
        return token_counts
    per_sample = (group_index, session_index, sample_weights, num_group_labels, num_session_labels)
    return RankSamples.of(config, token_counts, *per_sample, indices_required=totals is None)


@dataclass(frozen=True)
class _PlanInfo:
    """What a config's plans read of it, resolved once per config (and registry): its terms, the totals J reads
    (``needed``; every other term's with the PG mode's), the mode errors name, the default reducer's totals
    (``also``), every total a plan holds in its order (``names``), and whether the native route serves it."""

    terms: tuple
    needed: tuple[str, ...]
    mode: str
    also: tuple[str, ...]
    names: tuple[str, ...]
    native: bool
    groups: bool
    sessions: bool
    check_groups: bool
    sessions_in_groups: bool
    program: list  # every term's d[i] for the native route (_factor_codes), flat
    divisors: list  # every term's divisor L (0.0 where it has none)
    blocks: list  # the per-sample totals the plan holds, as the native route's blocks, in order


#: Where the native route (csrc/cpu/plan_totals.cpp) puts each total: its slot among the scalars (ints but for
#: :data:`_FLOAT_TOTALS`, as lossagg/totals.py gives them), or ``("per_sample", block)``.
_NATIVE_TOTALS = {
    "num_samples": 1,
    "num_nonempty_samples": 2,
    "total_tokens": 3,
    "max_tokens": 4,
    "num_groups": 5,
    "num_nonempty_groups": 6,
    "num_sessions": 7,
    "num_nonempty_sessions": 8,
    "group_token_sums": ("per_sample", 0),
    "session_sizes": ("per_sample", 1),
    "nonempty_session_sizes": ("per_sample", 2),
    "session_token_sums": ("per_sample", 3),
    "group_sessions": ("per_sample", 4),
    "nonempty_group_sessions": ("per_sample", 5),
}
_FLOAT_TOTALS = ("total_tokens", "max_tokens")
_SCALARS = 9  # the native output's scalars: status, then the slots above
_SERVED, _NOT_FLOAT32 = 0.0, 7.0  # the statuses the native route serves (7: the float32 table is d itself)
_INFO: dict[int, tuple[Any, Any, _PlanInfo]] = {}
_INFO_SIZE = 64
_CACHE_LOCK = threading.Lock()


def remember(cache: dict, size: int, key: int, entry: tuple) -> None:
    """Keep ``entry`` under ``key`` in ``cache``, dropping its oldest entry when it holds ``size``: under a lock, as
    threads planning at once would otherwise drop the same oldest entry twice (a ``KeyError``)."""
    with _CACHE_LOCK:
        while len(cache) >= size:
            cache.pop(next(iter(cache)), None)
        cache[key] = entry


def _factor_codes(term, empty: str) -> list[int] | None:
    """A term's d[i] for the native route: [factors, (source, read as a count, clamped, zero as one) per factor], as
    ``DenomProduct.__call__`` reads each factor (its total under ``empty``'s stand-in, read as
    :func:`lossagg.totals.read_as` does); None when a factor has no native source (a weight sum) or d[i] is a function."""
    product = term.spec.denoms
    if not isinstance(product, DenomProduct):
        return None
    codes = [len(product.factors)]
    for symbol in product.factors:
        f = FACTORS[symbol]
        if f.reads == "divisor":
            source, as_count = -1, False
        elif f.reads == "token_counts":
            source, as_count = -2, False
        else:
            gathered = stand_in(f.reads, empty)
            slot = _NATIVE_TOTALS.get(gathered)
            if slot is None:
                return None
            source = _SCALARS + slot[1] if isinstance(slot, tuple) else slot
            as_count = gathered != f.reads and TOTALS[gathered].count
        codes += [source, int(as_count), int(f.clamped), int(f.zero_as_one)]
    return codes


def plan_info(config: LossAggregationConfig) -> _PlanInfo:
    """:class:`_PlanInfo` of ``config``, kept for the last configs used (a config is immutable; the entry is made
    again when the mode registry changed)."""
    registry = mode_registry()
    hit = _INFO.get(id(config))
    if hit is not None and hit[0] is config and hit[1] is registry:
        return hit[2]
    terms = config.loss_terms
    pg = terms[0]
    needed = tuple(dict.fromkeys(t for term in terms for t in term.spec.totals))
    grouped = next(
        (
            f"{t.mode} (the reducer of term {t.name!r})"
            for t in terms[1:]
            if (t.spec.needs_groups and not pg.spec.needs_groups) or (t.spec.needs_sessions and not pg.spec.needs_sessions)
        ),
        None,
    )
    also = (*mode_spec(METRIC_MODE).totals, *config.metric_spec.totals)
    empty = config.empty_samples
    names = tuple(dict.fromkeys((*needed, *mode_totals(needed, empty), *also, *mode_totals(also, empty), *BASE_TOTALS)))
    in_groups = any(name in ("group_sessions", "nonempty_group_sessions") for name in needed)
    codes = [_factor_codes(t, empty) for t in terms]
    native = all(t.weighting == "none" for t in terms) and all(name in _NATIVE_TOTALS for name in names) and None not in codes
    info = _PlanInfo(
        terms=terms,
        needed=needed,
        mode=grouped or pg.mode,
        also=also,
        names=names,
        native=native,
        groups=any(t.spec.needs_groups for t in terms),
        sessions=any(t.spec.needs_sessions for t in terms),
        check_groups="num_groups" in names and not in_groups,
        sessions_in_groups=in_groups,
        program=[c for term_codes in codes for c in term_codes] if native else [],
        divisors=[0.0 if t.divisor is None else float(t.divisor) for t in terms],
        blocks=[slot[1] for name in names if isinstance(slot := _NATIVE_TOTALS.get(name), tuple)],
    )
    remember(_INFO, _INFO_SIZE, id(config), (config, registry, info))
    return info


def _plain_tensor(t, n: int | None, dtypes) -> bool:
    return (
        type(t) is torch.Tensor
        and t.layout is _STRIDED
        and t.is_cpu
        and t.dim() == 1
        and t.dtype in dtypes
        and (n is None or t.shape[0] == n)
        and not t.requires_grad
    )


def plain_labels(t, n: int) -> bool:
    """Whether ``t`` is labels the native passes read as they are: a plain int64 CPU tensor ``[n]``."""
    return _plain_tensor(t, n, (torch.int64,))


#: The fewest samples for which a one-process DeferredPlan whose mode reads sessions does the labels' half of its close
#: when it is made (a LabelLayout): at 4,096 samples the close then takes 10-20 us less and the make as much more
#: (docs/benchmarks.md); below this the layout's own call costs more than it saves. Modes with prompt groups alone make
#: none: their close is within 50 us without it, and the layout cost their make more than it saved the close.
LAYOUT_FROM = 1024


class LabelLayout(NamedTuple):
    """The runs of a step's labels found before its counts are known (csrc/cpu/plan_totals.cpp's layout), which the
    native route reads in place of the labels' pass: a one-process :class:`lossagg.DeferredPlan` makes it with the
    plan and its close reads the counts only. Read only while the labels are the very tensors it was made of, not
    written in place since (their ``_version``)."""

    layout: torch.Tensor
    labels: tuple  # (group_index, session_index), None where the mode reads none
    versions: tuple

    @classmethod
    def of(cls, config, samples: RankSamples) -> LabelLayout | None:
        """The layout of ``samples``' labels, or None where the native route would not read one (no label the mode
        reads, or arguments it does not take: see :func:`_native_route`) or it would not pay (fewer samples than
        :data:`LAYOUT_FROM`, or a mode that reads no sessions)."""
        info = plan_info(config)
        if samples.num_samples < LAYOUT_FROM or not info.native or not info.sessions:
            return None
        if samples.sample_weights is not None or samples.num_group_labels is not None or samples.num_session_labels is not None:
            return None
        n = samples.num_samples
        labels = (samples.group_index if info.groups else None, samples.session_index if info.sessions else None)
        if any(t is not None and not (plain_labels(t, n) and t.is_contiguous()) for t in labels):
            return None
        per_prompt = -1 if config.n_samples_per_prompt is None else config.n_samples_per_prompt
        nonempty = any(_NATIVE_TOTALS.get(name) in (6, 8) for name in info.names)  # P' or S': read from the counts
        layout = native_plan_layout(*labels, per_prompt, info.check_groups, info.sessions_in_groups, nonempty)
        return cls(layout, labels, tuple(None if t is None else t._version for t in labels))

    def reads(self, group_index, session_index) -> bool:
        """Whether the route may read the layout for these labels (those the mode reads, as passed)."""
        return all(
            a is b and (a is None or a._version == v) for a, b, v in zip((group_index, session_index), self.labels, self.versions, strict=True)
        )


def _native_route(
    config,
    info: _PlanInfo,
    counts,
    group_index,
    session_index,
    sample_weights,
    num_group_labels,
    num_session_labels,
    with_denoms: bool = True,
    blocks: bool = True,
    layout: LabelLayout | None = None,
):
    """(samples, totals, each term's d, the kernels' tables) of a one-process plan from one native pass
    (csrc/cpu/plan_totals.cpp), or None where the Python route (lossagg/totals.py, lossagg/denominators.py) takes
    it: arguments other than the plain ones (CPU tensors, int64 or float64 counts, int64 labels exactly where the
    mode reads them (and any the mode does not read), no weights or label bounds; given alone or as a :class:`RankSamples` holding just those), or a
    step the native pass declines (a count that is not a whole number >= 0, a group or session of the wrong size, a
    d[i] that is not finite and > 0: the Python route raises naming it). Without ``with_denoms`` the pass makes the
    totals only (no term's d: the d returned is None), and without ``blocks`` too the per-sample totals are made when
    first read (by the pass again). ``layout``: the labels' runs found before (read where it :meth:`~LabelLayout.reads`
    the labels passed)."""
    record = None
    if type(counts) is RankSamples:  # a record given alone (a closing DeferredPlan's): its fields
        if any(x is not None for x in (group_index, session_index, sample_weights, num_group_labels, num_session_labels)):
            return None  # the Python route refuses it, naming them
        record = r = counts
        counts, group_index, session_index = r.token_counts, r.group_index, r.session_index
        sample_weights, num_group_labels, num_session_labels = r.sample_weights, r.num_group_labels, r.num_session_labels
    if sample_weights is not None or num_group_labels is not None or num_session_labels is not None:
        return None
    if not _plain_tensor(counts, None, (torch.int64, torch.float64)):
        return None
    n = counts.shape[0]
    for given, needed in ((group_index, info.groups), (session_index, info.sessions)):
        # labels the mode does not read are held as given (the Python route holds them too), not passed to the pass
        if (given is None and needed) or (given is not None and not _plain_tensor(given, n, (torch.int64,))):
            return None
    per_prompt = config.n_samples_per_prompt
    as_given = counts.dtype is torch.float64
    groups = group_index.contiguous() if info.groups else None
    sessions = session_index.contiguous() if info.sessions else None
    out = native_plan_totals(
        counts.contiguous(),
        groups,
        sessions,
        -1 if per_prompt is None else per_prompt,
        info.check_groups,
        info.sessions_in_groups,
        info.blocks if with_denoms or blocks else [],
        not as_given,
        info.program if with_denoms else [],
        info.divisors if with_denoms else [],
        layout.layout if layout is not None and layout.reads(groups, sessions) else None,
    )
    scalars = out[0].tolist()
    if scalars[0] not in (_SERVED, _NOT_FLOAT32):
        return None
    values: dict[str, Any] = {}
    at = 1
    later, pending = not (with_denoms or blocks), False
    for name in info.names:
        slot = _NATIVE_TOTALS[name]
        if isinstance(slot, tuple):
            if later:
                values[name], pending = LATER, True
            else:
                values[name], at = out[at], at + 1
        else:
            values[name] = scalars[slot] if name in _FLOAT_TOTALS else int(scalars[slot])
    counts64 = counts if as_given else out[at]
    # a record given with float64 counts is the plan's as it is (its labels held as given, no weight or bound)
    samples = record if record is not None and as_given else RankSamples(n, counts64, group_index, session_index)
    if later:  # the per-sample totals from the pass again, when first read (a closing DeferredPlan's are seldom read)
        made = _per_sample_later(config, info, samples) if pending else None
        return samples, StepTotals(values, info.mode, made), None, None
    if not with_denoms:
        return samples, StepTotals(values, info.mode), None, None
    d, d32 = out[-2], out[-1]
    if scalars[0] == _NOT_FLOAT32:  # some d[i] is not a normal finite float32: the float32 kernels read d itself
        d32 = d
    return samples, StepTotals(values, info.mode), d, {torch.float32: (d32, None), torch.float64: (d, None)}


def _per_sample_later(config, info: _PlanInfo, samples: RankSamples):
    """The call that makes a plan's per-sample totals, left for later by :func:`_native_route`."""

    def made() -> dict[str, Any]:
        native = _native_route(config, info, samples, None, None, None, None, None, with_denoms=False)
        if native is None:  # not met: the same pass served these samples once
            raise RuntimeError("lossagg: the native pass declined the samples it served before")
        totals = native[1]
        return {name: totals[name] for name in info.names if isinstance(_NATIVE_TOTALS[name], tuple)}

    return made


def _holds_data(t) -> bool:
    return isinstance(t, torch.Tensor) and t.layout is _STRIDED and not t.is_meta


#: The attributes a plan built with ``_denoms_when_read`` makes when first read.
_DENOMS_WHEN_READ = frozenset({"sample_denoms", "term_denoms", "_kernel_tables"})


class StepPlan(Plan):
    """Global per-sample denominators ``sample_denoms`` (``d[i]``) of one optimizer step, for this rank's samples.

    Args:
        config: the aggregation config.
        token_counts: ``[n_local]`` rollout token counts ``M[i]`` of this rank's samples
            (all its micro-batches), from the full rollout masks; or this rank's
            :class:`lossagg.RankSamples` (then no other per-sample argument).
        process_group: the DP group (``torch.distributed``); None for one process.
        group_index, session_index, sample_weights, num_group_labels, num_session_labels: this
            rank's samples' prompt groups and sessions (for the modes that read them), weights (for
            a term that weighs them) and label bounds (with a process group), as
            :meth:`lossagg.RankSamples.of` checks and holds them.

    ``plan.totals`` holds, by name, the step totals the config's terms read (their stand-ins under
    ``empty_samples="skip"``), and ``num_samples`` and ``total_tokens`` always. With a process group,
    a check that fails on one rank makes every rank raise after the one sum all-reduce, that rank
    naming it (docs/composition.md).

    The private keywords are for the library's own constructors: ``_totals`` (:meth:`from_totals`),
    ``_extra_sums``, ``_problem`` and ``_fingerprint`` (a :class:`lossagg.DeferredPlan`'s logged
    values, what its rank lacks, and what every rank must share, all in the one sum all-reduce).
    """

    def __init__(
        self,
        config: LossAggregationConfig,
        token_counts: torch.Tensor | RankSamples,
        *,
        group_index: torch.Tensor | None = None,
        process_group=None,
        num_group_labels: int | None = None,
        session_index: torch.Tensor | None = None,
        num_session_labels: int | None = None,
        sample_weights: torch.Tensor | None = None,
        _totals: Mapping[str, Any] | None = None,
        _extra_sums: torch.Tensor | None = None,
        _problem: Exception | None = None,
        _fingerprint: str = "",
        _denoms_when_read: bool = False,
        _layout: LabelLayout | None = None,
    ):
        if not isinstance(config, LossAggregationConfig):
            config = LossAggregationConfig.coerce(config)
        info = plan_info(config)
        native = None
        # without a process group the logged sums (_extra_sums) are the step's as they are: the native route serves
        # a closing DeferredPlan's record too
        if process_group is None and _totals is None and _problem is None and info.native:
            native = _native_route(
                config,
                info,
                token_counts,
                group_index,
                session_index,
                sample_weights,
                num_group_labels,
                num_session_labels,
                not _denoms_when_read,
                not _denoms_when_read,
                _layout,
            )
        if native is not None:  # one process, counts on the CPU: the step totals and every d_k from one native pass
            samples, self.totals, d, tables = native
        else:
            process_group = check_process_group(process_group, "process_group", "the DP group of this rank")
            samples = _samples(config, token_counts, group_index, session_index, sample_weights, num_group_labels, num_session_labels, _totals)
            self.totals = plan_totals(
                info.needed,
                samples,
                mode=info.mode,
                # the default reducer's (plan.metrics), and sample_mean's whatever the mode (trainers read N, N')
                also=info.also,
                empty_samples=config.empty_samples,
                given=_totals,
                n_samples_per_prompt=config.n_samples_per_prompt,
                global_batch_size=config.global_batch_size,
                process_group=process_group,
                extra_sums=_extra_sums,
                problem=_problem,
                fingerprint=_fingerprint,
            )
        self.config = config
        self.samples = samples
        self.token_counts = samples.token_counts
        self.sample_weights = samples.sample_weights
        self.device = samples.token_counts.device
        self._terms = info.terms
        if native is not None and d is None:  # a closing DeferredPlan's: every d made when first read (__getattr__)
            self._info = info
            return
        if native is not None:
            self._keep_native(d, tables)
            return
        self._make_denoms()

    def _keep_native(self, d: torch.Tensor, tables: dict) -> None:
        rows = (d[0],) if len(self._terms) == 1 else d.unbind(0)  # every term's row in one call
        self.sample_denoms = rows[0]
        self.term_denoms = {t.name: row for t, row in zip(self._terms, rows, strict=True)}
        self._kernel_tables = tables

    def _make_denoms(self) -> None:
        bounds: list = []
        self.sample_denoms = self._denoms(self._terms[0], bounds)
        self._make_tables({PG_TERM: self.sample_denoms}, bounds)

    def __getattr__(self, name: str):
        """The d of a plan built without them (``_denoms_when_read``: a one-process :class:`lossagg.DeferredPlan`'s
        close, which reads the totals only), made at the first read of any of them: by the native pass again, else
        by the Python route, which raises naming a d[i] that is not finite and > 0, as a build would have."""
        if name not in _DENOMS_WHEN_READ or "_info" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        info = self.__dict__["_info"]  # (kept until the d are made: a second thread reading meanwhile makes them too)
        native = _native_route(self.config, info, self.samples, None, None, None, None, None)
        if native is not None:
            self._keep_native(native[2], native[3])
        else:
            self._make_denoms()
        self.__dict__.pop("_info", None)
        return self.__dict__[name]

    def _denoms(self, term, bounds: list | None = None) -> torch.Tensor:
        """``d_k[i]`` of one of the loss's terms (``config.loss_terms``), from the totals this plan holds
        (``bounds`` receives its smallest and largest entry)."""
        empty = self.config.empty_samples
        what = term.mode if term.name == PG_TERM else f"{term.mode} (the reducer of term {term.name!r})"
        read = read_totals(term.spec.totals, self.totals, empty, what)
        return denoms_from_totals(term.spec, self.token_counts, read, term.divisor, empty, bounds)

    def _make_tables(self, denoms: dict[str, torch.Tensor], bounds: list) -> None:
        """Every term's ``d_k`` (:attr:`term_denoms`: those not in ``denoms`` made here) and the kernels' tables,
        made when the plan is built: a micro-batch then reads nothing of them back to the host (on a GPU, no
        synchronisation after the plan is built). ``bounds``: the smallest and largest entry of ``denoms``'."""
        lo, hi = bounds
        for t in self._terms:
            if t.name not in denoms:
                more: list = []
                denoms[t.name] = self._denoms(t, more)
                lo, hi = min(lo, more[0]), max(hi, more[1])
        self.term_denoms = {t.name: denoms[t.name] for t in self._terms}
        stacked, weights = stack_term_tables(self._terms, self.term_denoms, self.sample_weights)
        self._kernel_tables = term_tables(stacked, weights, self.device, (lo, hi))

    #: ``d_k[i]`` of every term of the loss (float64 ``[n_local]``, by name): the PG term's, ``"pg"``, is
    #: :attr:`sample_denoms`; each of ``config.terms`` has its own mode's and divisor's, from the totals this
    #: plan gathered (docs/terms.md).
    term_denoms: dict[str, torch.Tensor]
    #: Every term's ``d_k`` and weights (:func:`lossagg.micro_batch.stack_term_tables`) by accumulation dtype,
    #: rounded once per plan as the kernels round them.
    _kernel_tables: dict

    @functools.cached_property
    def metric_denoms(self) -> torch.Tensor:
        """``d[i]`` of the default reducer, for metrics other than the PG loss: sample_mean, or
        token_mean when the step itself is token-level (as a term that names no reducer,
        docs/terms.md), under the config's ``empty_samples`` (under skip, empty samples do not
        count in sample_mean's N either)."""
        spec = self.config.metric_spec
        empty = self.config.empty_samples
        missing = [name for name in mode_totals(spec.totals, empty) if name not in self.totals]
        if missing:
            raise ValueError(f"StepPlan.metrics reduces by {spec.name} and needs the step total(s) {', '.join(missing)}: pass them to from_totals")
        return denoms_from_totals(spec, self.token_counts, read_totals(spec.totals, self.totals, empty, spec.name), empty_samples=empty)

    @classmethod
    def from_mask(
        cls,
        config: LossAggregationConfig,
        rollout_mask: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        **kwargs,
    ) -> StepPlan:
        """The plan of this rank's samples given their rollout mask (token counts are counted from it)."""
        return cls(config, _token_counts(rollout_mask, cu_seqlens), **kwargs)

    @classmethod
    def from_totals(cls, config: LossAggregationConfig, token_counts: torch.Tensor, *, sample_weights=None, **totals) -> StepPlan:
        """The plan of this rank's samples from step totals a trainer already has (no collective).

        The keywords are the step totals of :data:`lossagg.totals.TOTALS` by name (docs/modes.md,
        "Step totals": ``num_samples`` is verl's ``global_batch_size``, ``total_tokens`` its
        ``batch_num_tokens`` and TRL's ``num_items_in_batch``, ``num_nonempty_samples`` NeMo-RL's
        ``global_valid_seqs``; a per-sample total has one entry per local sample). The totals the
        config's terms read are required (under ``empty_samples="skip"`` their stand-ins), and
        ``num_samples`` for :meth:`metrics`; each is checked against this rank's ``token_counts``
        and against the others. A weighted mean also needs ``sample_weights`` (docs/terms.md).
        """
        return cls(config, token_counts, sample_weights=sample_weights, _totals=totals)

    @classmethod
    def from_denoms(cls, sample_denoms, *, config: LossAggregationConfig | None = None, sample_weights: torch.Tensor | None = None) -> StepPlan:
        """A plan whose ``d_k[i]`` were made elsewhere: by a trainer's own rule (verl's own
        ``loss_agg_mode`` names, whose masks are weights: lossagg.integrations.verl), or by a plan made
        where the step was whole and carried with the samples to the micro-batches (verl's driver:
        lossagg.integrations.verl_trainer). Its micro-batches reduce through the same handle as every
        plan's.

        ``sample_denoms``: a 1-D float tensor, the ``d[i]`` of one unweighted term; or, with ``config``,
        a mapping of each of ``config.loss_terms``' names to its ``d_k[i]`` (one per sample, the same
        samples), and ``sample_weights`` ``w_i`` when a term weighs its samples. Each is checked finite
        and > 0 (weights finite and >= 0). It holds no step total, so :meth:`metrics`, :attr:`empty`
        and :meth:`scalar_term` are refused by name.
        """
        config = LossAggregationConfig() if config is None else LossAggregationConfig.coerce(config)
        terms = config.loss_terms
        names = [t.name for t in terms]
        if isinstance(sample_denoms, Mapping):
            if sorted(sample_denoms) != sorted(names):
                raise ValueError(
                    f"StepPlan.from_denoms: sample_denoms must map each of the loss's terms ({', '.join(names)}) to its d_k[i], "
                    f"got {sorted(sample_denoms)}"
                )
            given = {name: sample_denoms[name] for name in names}
        elif len(terms) > 1:
            raise ValueError(
                f"StepPlan.from_denoms: the config has the terms {', '.join(names)}: sample_denoms must map each to its d_k[i], got one tensor"
            )
        else:
            given = {PG_TERM: sample_denoms}
        denoms = {}
        lo, hi = math.inf, -math.inf
        for name, d in given.items():
            what = "StepPlan.from_denoms: sample_denoms" + (f"[{name!r}]" if isinstance(sample_denoms, Mapping) else "")
            if not isinstance(d, torch.Tensor) or d.dim() != 1:
                got = f"shape {tuple(d.shape)}" if isinstance(d, torch.Tensor) else type(d).__name__
                raise ValueError(f"{what} must be a 1-D floating tensor of d[i] (one per sample), got {got}")
            n = next(iter(denoms.values())).shape[0] if denoms else d.shape[0]
            bounds: list = []
            denoms[name] = check_denoms(d, what, (n,), bounds=bounds)
            lo, hi = min(lo, bounds[0]), max(hi, bounds[1])
        n = denoms[PG_TERM].shape[0]
        weighted = [t.name for t in terms if t.weighting != "none"]
        if weighted and sample_weights is None:
            raise ValueError(
                f"StepPlan.from_denoms: the term(s) {', '.join(weighted)} weigh their samples: pass sample_weights (w_i, one per sample)"
            )
        if sample_weights is not None and not weighted:
            raise ValueError("StepPlan.from_denoms: sample_weights were given but no term of the config weighs its samples (weighting none)")
        plan = cls.__new__(cls)
        plan.config = config
        device = denoms[PG_TERM].device
        plan.samples = (
            RankSamples.of(config, None, sample_weights=sample_weights, num_samples=n, indices_required=False) if weighted else RankSamples(n)
        )
        weights = plan.samples.sample_weights
        plan.token_counts, plan.sample_weights, plan.device = None, None if weights is None else weights.to(device), device
        plan._terms = terms
        plan.totals = StepTotals({}, "given denominators")
        plan.sample_denoms = denoms[PG_TERM]
        plan._make_tables(denoms, [lo, hi])
        return plan

    # ------------------------------------------------------------------- use
    def sample_denoms_for(self, samples: Samples, *, dtype=torch.float32, device=None) -> torch.Tensor:
        """``sample_denoms`` of a micro-batch, given its samples' positions among this rank's samples."""
        d = self.sample_denoms[self._positions(samples)]
        return d.to(dtype=dtype, device=device or self.device)

    def _positions(self, samples: Samples) -> torch.Tensor:
        """Positions among this rank's samples: integers in [0, n_local), a slice, or a bool selection of length n_local."""
        return sample_positions(samples, self.samples.num_samples, self.device)

    def micro_batch(
        self, samples: Samples, mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *, step_layout: bool = False, pieces: bool = False
    ) -> MicroBatch:
        """One micro-batch of this plan, checked once (:class:`lossagg.MicroBatch`): what :meth:`loss`
        and :meth:`metrics` reduce, with no data-dependent check left for them (a loss function that
        takes it compiles whole).

        ``samples`` are the positions of the micro-batch's samples among this rank's (integers, a
        slice or a bool selection); ``mask`` and ``cu_seqlens`` its own layout (packed ``[T]`` with
        ``cu_seqlens``, padded ``[B, T]``), on this CP rank's tokens if sharded. With
        ``step_layout=True`` they are the layout of all this rank's samples instead, and the
        micro-batch is cut from it (its tokens at ``mb.tokens``; packed: consecutive samples). With
        ``pieces=True`` each segment of the layout is a piece of the sample ``samples`` names for it,
        and a sample may be named by several segments (its tokens split over segments: slime's
        training samples of one rollout); ``d[i]`` is then the sample's for each of its pieces.
        """
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.layout is not _STRIDED or mask.is_meta or (cu_seqlens is not None and not _holds_data(cu_seqlens)):
            check_holds_data("mask", mask)
            check_holds_data("cu_seqlens", cu_seqlens)
        n = self.samples.num_samples
        whole = type(samples) is slice and samples == _ALL
        if whole:
            positions, run = self._all_positions, None
        elif type(samples) is slice:  # views of the plan's positions and tables
            check_slice(samples)
            lo, hi, step = samples.indices(n)
            positions, run = self._all_positions[samples], (slice(lo, max(hi, lo)) if step == 1 else None)
        else:
            positions, run = positions_and_run(samples, n, self.device, pieces)
        tokens = None
        if step_layout:
            tokens, mask, cu_seqlens = cut_from_step(positions, mask, cu_seqlens)
        check_layout(positions.shape[0], mask, cu_seqlens)
        # the plan's own tables, moved once per device; a run of consecutive samples: views, no gather
        tables = self._whole_tables(mask.device) if whole else table_rows(self._kernel_tables, positions if run is None else run, mask.device)
        return MicroBatch(self, tuple(t.name for t in self._terms), [t.coefficient for t in self._terms], positions, mask, cu_seqlens, tables, tokens)

    @functools.cached_property
    def _all_positions(self) -> torch.Tensor:
        return torch.arange(self.samples.num_samples, device=self.device)

    def _whole_tables(self, device) -> dict:
        """:attr:`_kernel_tables` on ``device`` (each moved once per plan)."""
        cache = self.__dict__.setdefault("_tables_on", {})
        if device not in cache:
            cache[device] = {acc: (d.to(device), None if w is None else w.to(device)) for acc, (d, w) in self._kernel_tables.items()}
        return cache[device]

    def _made(self, samples, mask, cu_seqlens) -> MicroBatch:
        return self.micro_batch(samples, mask, cu_seqlens)

    def _metrics(self, metrics, micro_batch, samples, cu_seqlens) -> dict[str, torch.Tensor]:
        mb, _ = self._handle(micro_batch, samples, cu_seqlens, "StepPlan.metrics")
        return reduce_metrics(metrics, mb.mask, mb.cu_seqlens, self.metric_denoms[mb.samples])

    @property
    def empty(self) -> bool:
        """Whether the step holds no loss token on any rank (``T = 0``): then ``J = 0`` and every
        gradient from the plan is 0, but an optimizer step would still move the weights (weight
        decay, momentum). A trainer that owns its optimizer step skips it (docs/terms.md,
        "Scalar terms", empty steps)."""
        if "total_tokens" not in self.totals:
            raise ValueError("StepPlan.empty reads the step's rollout tokens T: pass total_tokens to from_totals")
        return float(self.totals.total_tokens) == 0.0

    def scalar_term(self, value: torch.Tensor, micro_batch: MicroBatch, *, weight: str = "tokens", cp_size: int = 1) -> torch.Tensor:
        """A per-micro-batch scalar term (a MoE router auxiliary loss, an MTP loss: one number per
        micro-batch, itself a mean over the micro-batch) scaled by the micro-batch's share of the step,
        so that summed over every micro-batch and rank it is the step's weighted mean of those numbers,
        and so is its gradient, the same under any split (docs/terms.md, "Scalar terms").

        ``weight="tokens"``: the share is this rank's loss tokens of the micro-batch (``micro_batch.mask``,
        this CP rank's own when sharded, with ``value`` this CP rank's own number) over the step's
        ``T``; ``"samples"``: its samples over the step's ``N`` and ``cp_size`` (each CP rank of a
        micro-batch holds all its samples). Both totals come from the plan's one all-reduce. Multiply
        by the engine's factor (``gradient_scale``) as for :meth:`loss`.
        """
        return scalar_term(self, value, micro_batch, weight=weight, cp_size=cp_size)

    def token_weights(
        self,
        mask: torch.Tensor,
        samples: Samples,
        cu_seqlens: torch.Tensor | None = None,
        *,
        convention: str,
        dp_size: int = 1,
        cp_size: int = 1,
        num_micro_batches: int = 1,
        dtype: torch.dtype = torch.float32,
        term: str = PG_TERM,
    ) -> torch.Tensor:
        """Per-token weights of a micro-batch, for trainers that fold the reduction into the advantages
        or into a loss's per-token weights (SkyRL's advantages, verl's ``rollout_is_weights``;
        docs/trainers/skyrl.md): of the PG term, or of the loss's ``term``.

        Every token of sample ``i`` (of ``mask``'s token shape: padded ``[B, T]``, or packed ``[T]``
        with ``cu_seqlens``; on its device, in ``dtype``), masked or not, holds
        ``gradient_scale(convention, ...) / d_k[i]`` (times ``w_i`` for a term that weighs its
        samples). The mask is not in the weights (the trainer masks the loss itself), so
        ``(weights * per_token_loss * mask).sum()`` is ``plan.loss`` of the micro-batch times the
        scale wherever the loss is finite. Scaling the advantages instead gives the same loss when
        the per-token loss scales with its advantage, ``l(w·A) = w·l(A)`` for ``w > 0`` (PPO-clip,
        dual clip, a plain policy gradient); a weight that ``dtype`` cannot carry is refused.
        """
        return token_weights(
            self,
            mask,
            samples,
            cu_seqlens,
            scale=gradient_scale(convention, dp_size=dp_size, cp_size=cp_size, num_micro_batches=num_micro_batches),
            dtype=dtype,
            term=term,
        )


def scalar_term(plan: StepPlan, value: torch.Tensor, micro_batch, *, weight: str, cp_size) -> torch.Tensor:
    """:meth:`StepPlan.scalar_term`'s arithmetic (its docstring)."""
    if not isinstance(micro_batch, MicroBatch):
        raise TypeError(
            f"StepPlan.scalar_term: micro_batch must be a MicroBatch of this plan (plan.micro_batch(samples, mask, cu_seqlens)), "
            f"got {type(micro_batch).__name__}"
        )
    mb = given_micro_batch(plan, micro_batch, None, None, "StepPlan.scalar_term")
    if not isinstance(value, torch.Tensor) or value.dim() != 0 or not value.is_floating_point():
        got = f"shape {tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"StepPlan.scalar_term: value must be a 0-dim floating tensor (one number for the micro-batch), got {got}")
    if weight not in ("tokens", "samples"):
        raise ValueError(f"StepPlan.scalar_term: weight must be 'tokens' or 'samples', got {weight!r}")
    cp = as_int("cp_size", cp_size, minimum=1)
    total = "total_tokens" if weight == "tokens" else "num_samples"
    if total not in plan.totals:
        raise ValueError(f"StepPlan.scalar_term: weight={weight!r} reads the step's {total}: pass {total} to StepPlan.from_totals")
    if weight == "tokens":  # this CP rank's own tokens and number: no CP factor
        return scalar_share(value, (mb.mask != 0).sum().to(torch.float64), max(float(plan.totals.total_tokens), 1.0))
    return scalar_share(value, torch.tensor(float(mb.num_samples), dtype=torch.float64), float(plan.totals.num_samples) * cp)


def token_weights(plan: StepPlan, mask, samples, cu_seqlens, *, scale: float, dtype, term: str) -> torch.Tensor:
    """:meth:`StepPlan.token_weights` with the engine's factor ``scale`` already computed: ``scale / d_k[i]``
    (times ``w_i`` for a weighted term) on every token of sample ``i``, checked to survive ``dtype``."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (the weights are 1/d[i]), got {dtype!r}")
    chosen = next((t for t in plan._terms if t.name == term), None)
    if chosen is None:
        raise ValueError(f"StepPlan.token_weights: term must be one of the loss's terms ({', '.join(t.name for t in plan._terms)}), got {term!r}")
    try:  # the layout checks of the ops, on mask and cu_seqlens (one pass over the mask; the counts are not needed)
        _token_counts(mask, cu_seqlens)
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("lossagg.token_counts: ", "StepPlan.token_weights: ", 1)) from None
    check_holds_data("mask", mask)
    check_holds_data("cu_seqlens", cu_seqlens)
    positions = plan._positions(samples)
    d = plan.term_denoms[chosen.name][positions].to(device=mask.device, dtype=torch.float64)
    check_layout(d.shape[0], mask, cu_seqlens)
    per_sample = d.new_full(d.shape, scale) / d  # float64, rounded once (a number over a tensor is its reciprocal times it)
    if chosen.weighting != "none":  # the sample's weight too: w_i · scale / d[i], any sign, 0 a weight of 0
        per_sample = per_sample * plan.sample_weights[positions.to(plan.sample_weights.device)].to(per_sample.device)
        rounded = per_sample.to(dtype)
        lost = ~torch.isfinite(rounded) | ((rounded == 0) & (per_sample != 0))
    else:
        rounded = per_sample.to(dtype)
        lost = ~(torch.isfinite(rounded) & (rounded > 0))
    if per_sample.numel() and bool(lost.any()):
        i = int(torch.nonzero(lost)[0, 0])
        raise ValueError(
            f"StepPlan.token_weights: the weight of sample {i} is {float(per_sample[i])!r}, which is {float(rounded[i])!r} in {dtype} "
            f"(gradient_scale {scale} / d[i] = {float(d[i])!r}): the identity with plan.loss would fail silently; use dtype=torch.float32"
        )
    if cu_seqlens is None:
        weights = per_sample[:, None].expand(mask.shape)
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=mask.device, dtype=torch.long)
        weights = torch.repeat_interleave(per_sample, lengths, output_size=mask.shape[0])
    return weights.to(dtype).contiguous()


def scalar_share(value: torch.Tensor, own, total) -> torch.Tensor:
    """A per-micro-batch scalar term ``value`` weighted by the micro-batch's share of the step, ``own / total``
    (its loss tokens over the step's ``T``, or its samples over ``N``; a total of 0 is read as 1, the term's
    share then being 0): the arithmetic of :meth:`StepPlan.scalar_term`, for an adapter that holds the two
    counts itself (docs/terms.md, "Scalar terms"). Differentiable in ``value``."""
    own = torch.as_tensor(own, dtype=torch.float64)
    total = torch.as_tensor(total, dtype=torch.float64).clamp(min=1.0)
    return value * (own / total).to(device=value.device, dtype=value.dtype)


def gradient_scale(convention: str, *, dp_size: int = 1, cp_size: int = 1, num_micro_batches: int = 1) -> float:
    """Factor to multiply each contribution by so the final gradient is dJ/dθ.

    * ``sum``: gradients are summed over micro-batches and ranks -> 1.
    * ``mean``: DDP/FSDP average gradients over the DP×CP world -> ``dp_size * cp_size``.
    * ``micro_batch_mean``: the trainer divides each micro-batch loss by the number of
      micro-batches -> ``num_micro_batches``.
    * ``megatron``: Megatron-Core without per-token loss (a loss function returning two
      values): its schedule multiplies each micro-batch loss by the CP size and divides it
      by the number of micro-batches, and its DDP averages gradients over DP×CP; the CP
      factors cancel -> ``num_micro_batches * dp_size`` (``cp_size`` is accepted and
      checked, and changes nothing). Read from megatron-core 0.19.2
      (``pipeline_parallel/schedules.py``, ``distributed/distributed_data_parallel.py``) and
      tested against it (tests/test_megatron_engine.py).
    """
    dp_size = as_int("dp_size", dp_size, minimum=1)
    cp_size = as_int("cp_size", cp_size, minimum=1)
    num_micro_batches = as_int("num_micro_batches", num_micro_batches, minimum=1)
    if convention == "sum":
        return 1.0
    if convention == "mean":
        return float(dp_size * cp_size)
    if convention == "micro_batch_mean":
        return float(num_micro_batches)
    if convention == "megatron":
        return float(num_micro_batches * dp_size)
    raise ValueError(f"convention must be one of {', '.join(GRADIENT_CONVENTIONS)}, got {convention!r}")
