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
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lossagg.config import LossAggregationConfig
from lossagg.config.model import PG_TERM
from lossagg.denominators import denoms_from_totals
from lossagg.layout import token_counts as _token_counts
from lossagg.modes import METRIC_MODE, default_term_mode, mode_spec
from lossagg.ops import reduce, reduce_terms_of, segment_sum
from lossagg.totals import mode_totals, plan_totals, read_totals
from lossagg.validate import as_int, check_holds_data, check_token_counts

GRADIENT_CONVENTIONS = ("sum", "mean", "micro_batch_mean", "megatron")

Samples = slice | Sequence[int] | torch.Tensor


def _as_config(config) -> LossAggregationConfig:
    if isinstance(config, str):
        raise TypeError(
            f"config must be a LossAggregationConfig (or a mapping of its settings), got the string {config!r}: "
            f"pass LossAggregationConfig(mode={config!r}) or {{'mode': {config!r}}}"
        )
    if isinstance(config, Mapping):
        return LossAggregationConfig.from_dict(config)
    if not isinstance(config, LossAggregationConfig):
        raise TypeError(f"config must be a LossAggregationConfig (or a mapping of its settings), got {type(config).__name__}")
    return config


def _sample_weights(weights, weightings: Mapping[str, str], counts: torch.Tensor) -> torch.Tensor | None:
    """The samples' weights as float64 ``[n_local]``, checked: given exactly when a term of the
    config uses them, one per sample, finite (docs/terms.md, "Per-sample weights")."""
    users = [name for name, w in weightings.items() if w != "none"]
    if weights is None:
        if users:
            raise ValueError(f"the term(s) {', '.join(users)} weigh the samples (weighting={weightings[users[0]]}): pass sample_weights= to StepPlan")
        return None
    if not users:
        raise ValueError("sample_weights were given, but no term of the config uses them: set weighting for the PG term or a term (docs/terms.md)")
    check_holds_data("sample_weights", weights)
    if not isinstance(weights, torch.Tensor) or not weights.is_floating_point() or weights.dim() != 1 or weights.shape[0] != counts.shape[0]:
        got = f"{weights.dtype} tensor of shape {tuple(weights.shape)}" if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise ValueError(f"sample_weights must be a floating 1-D tensor with one weight per sample of this rank ({counts.shape[0]}), got a {got}")
    w = weights.detach().to(device=counts.device, dtype=torch.float64)
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"sample_weights[{i}] is {float(w[i])!r}: every weight must be finite")
    return w


def sample_positions(samples: Samples, n: int, device) -> torch.Tensor:
    """Positions among a rank's ``n`` samples (int64 on ``device``): integers in [0, n), a slice,
    or a bool selection of length n; each sample named at most once."""
    check_holds_data("samples", samples)
    if isinstance(samples, slice):
        return torch.arange(n, device=device)[samples]
    if isinstance(samples, (int, bool)) or (isinstance(samples, torch.Tensor) and samples.dim() == 0):
        raise TypeError("samples must be a 1-D selection of this rank's samples (integer positions, a slice or a bool mask), got a scalar")
    try:
        pos = samples if isinstance(samples, torch.Tensor) else torch.as_tensor(samples)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"samples must be integer positions, a slice or a bool selection, got {type(samples).__name__}") from None
    if pos.dim() != 1:
        raise ValueError(f"samples must be 1-D, got shape {tuple(pos.shape)}")
    if pos.numel() == 0 and pos.dtype != torch.bool:  # no samples (an empty list is float32 to torch)
        return torch.zeros(0, dtype=torch.long, device=device)
    if pos.dtype == torch.bool:
        if pos.shape[0] != n:
            raise ValueError(f"samples as a bool selection must have one entry per sample of this rank ({n}), got {pos.shape[0]}")
        return torch.nonzero(pos).flatten().to(device)
    if pos.is_floating_point() or pos.is_complex():
        raise TypeError(f"samples must hold integer positions, got dtype {pos.dtype}")
    if pos.numel() and pos.device.type == "cpu":  # positions on an accelerator are not read back (no host sync)
        lo, hi = int(pos.min()), int(pos.max())
        if lo < 0 or hi >= n:
            raise ValueError(f"samples must be positions in [0, {n}) among this rank's samples, got values in [{lo}, {hi}]")
        distinct, counts = torch.unique(pos, return_counts=True)
        if distinct.numel() != pos.numel():
            first = int(torch.nonzero(counts > 1)[0, 0])
            raise ValueError(
                f"samples must name each sample of the micro-batch once, got position {int(distinct[first])} {int(counts[first])} times "
                "(a sample counted twice would weigh twice in J)"
            )
    return pos.to(device=device, dtype=torch.long)


def _plain_terms(values: list, mask) -> bool:
    """Every term a dense tensor of the mask's shape, of one dtype and device, the mask dense and
    holding data: the usual call, for which :meth:`StepPlan.loss_terms` skips its checks by name
    and makes one :func:`lossagg.reduce_terms` call."""
    if not isinstance(mask, torch.Tensor) or mask.layout is not torch.strided or mask.is_meta:
        return False
    first = values[0]
    if not isinstance(first, torch.Tensor):
        return False
    shape, dtype, device = mask.shape, first.dtype, first.device
    for t in values:
        if not (isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_meta and t.shape == shape and t.dtype is dtype):
            return False
    return all(t.device == device for t in values[1:])


class StepPlan:
    """Global per-sample denominators ``sample_denoms`` (``d[i]``) of one optimizer step, for this rank's samples.

    Args:
        config: the aggregation config.
        token_counts: ``[n_local]`` rollout token counts ``M[i]`` of this rank's samples
            (all its micro-batches), from the full rollout masks.
        group_index: ``[n_local]`` prompt-group index of each sample; required by modes
            with prompt groups. With a process group the labels must mean the same on
            every rank and lie in ``[0, num_group_labels)``, where ``num_group_labels`` is
            given or ``global_batch_size // n_samples_per_prompt``.
        process_group: the DP group (``torch.distributed``); None for one process.
        num_group_labels: how many group labels the step's ``group_index`` can take
            (with a process group). The groups actually present, ``P``, are counted from
            the data: ``plan.totals.num_groups``.

    ``plan.totals`` holds the step totals the mode declares and, gathered by every plan built
    here, ``num_samples`` and ``total_tokens`` (the metrics reducer and Megatron's
    per-token-loss scale use them), by name. Under ``config.empty_samples == "skip"`` it holds the
    stand-ins the mode reads instead (``num_nonempty_samples`` for ``N``, ``num_nonempty_groups``
    for ``P``; gathered in the same all-reduce), and ``num_samples`` still.

    ``_totals`` is private: :meth:`from_totals` hands a trainer's step totals through it
    (checked by :func:`lossagg.totals.plan_totals` instead of gathered), so that every plan is
    built by this one constructor. So is ``_extra_sums``: float64 values summed over the
    process group in the plan's own sum all-reduce, in place (a :class:`lossagg.DeferredPlan`'s
    logged values).
    """

    def __init__(
        self,
        config: LossAggregationConfig,
        token_counts: torch.Tensor,
        *,
        group_index: torch.Tensor | None = None,
        process_group=None,
        num_group_labels: int | None = None,
        sample_weights: torch.Tensor | None = None,
        _totals: Mapping[str, Any] | None = None,
        _extra_sums: torch.Tensor | None = None,
    ):
        config = _as_config(config)
        counts = check_token_counts(token_counts)
        self.config = config
        self.token_counts = counts
        self.device = counts.device
        empty = config.empty_samples
        weightings = {PG_TERM: config.weighting, **{name: term.weighting for name, term in config.terms.items()}}
        self.sample_weights = _sample_weights(sample_weights, weightings, counts)
        # each term's mode, as a weighted mean where its weighting says so (N replaced by W or W_abs)
        spec = mode_spec(config.mode).weighted(config.weighting)
        terms = {name: mode_spec(term.mode).weighted(term.weighting) for name, term in config.terms.items()}
        self._specs = {PG_TERM: spec, **terms}
        # what J reads: the PG mode's totals and every other term's, gathered in the same all-reduces
        needed = tuple(dict.fromkeys((*spec.totals, *(t for term in terms.values() for t in term.totals))))
        grouped = next((f"{s.name} (the reducer of term {n!r})" for n, s in terms.items() if s.needs_groups and not spec.needs_groups), None)
        self.totals = plan_totals(
            needed,
            counts,
            mode=grouped or spec.name,
            # the default reducer's (plan.metrics), and sample_mean's whatever the mode (trainers read N, N')
            also=(*mode_spec(METRIC_MODE).totals, *mode_spec(default_term_mode(config.mode)).totals),
            empty_samples=empty,
            given=_totals,
            group_index=group_index,
            n_samples_per_prompt=config.n_samples_per_prompt,
            global_batch_size=config.global_batch_size,
            process_group=process_group,
            num_group_labels=num_group_labels,
            weights=self.sample_weights,
            extra_sums=_extra_sums,
        )
        self.sample_denoms = denoms_from_totals(spec, counts, read_totals(spec.totals, self.totals, empty, spec.name), config.divisor, empty)

    @functools.cached_property
    def term_denoms(self) -> dict[str, torch.Tensor]:
        """``d_k[i]`` of every term of the loss (float64 ``[n_local]``, by name): the PG term's,
        ``"pg"``, is :attr:`sample_denoms`; each of ``config.terms`` has its own mode's and divisor's,
        from the totals this plan gathered (docs/terms.md)."""
        empty = self.config.empty_samples
        out = {PG_TERM: self.sample_denoms}
        for name, term in self.config.terms.items():
            spec = self._specs[name]
            read = read_totals(spec.totals, self.totals, empty, f"{spec.name} (the reducer of term {name!r})")
            out[name] = denoms_from_totals(spec, self.token_counts, read, term.divisor, empty)
        return out

    @functools.cached_property
    def _term_table(self) -> tuple[tuple[str, ...], torch.Tensor, torch.Tensor | None, list[float]]:
        """The terms as :func:`lossagg.reduce_terms` takes them, for every sample of this rank:
        their names in order (``"pg"`` first), ``d_k[i]`` ``[K, n_local]``, the weights ``[K, n_local]``
        (1 for a term that does not weigh its samples; None when no term does) and the coefficients."""
        names = (PG_TERM, *self.config.terms)
        denoms = torch.stack([self.term_denoms[n] for n in names])
        weightings = [self.config.weighting, *(t.weighting for t in self.config.terms.values())]
        weights = None
        if any(w != "none" for w in weightings):
            ones = torch.ones_like(self.sample_weights)
            weights = torch.stack([ones if w == "none" else self.sample_weights for w in weightings])
        return names, denoms, weights, [1.0, *(t.coefficient for t in self.config.terms.values())]

    def _term_table_in(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:attr:`_term_table`'s ``d`` and ``w`` in ``dtype`` (each converted once per plan)."""
        cache = self.__dict__.setdefault("_term_tables", {})
        if dtype not in cache:
            _, denoms, weights, _ = self._term_table
            rounded = denoms.to(dtype)
            if not bool((torch.isfinite(rounded) & (rounded > 0)).all()):
                rounded = denoms  # a d[i] out of dtype's range: the op refuses it, naming the value as given
            rounded_w = None if weights is None else weights.to(dtype)
            if rounded_w is not None and not bool(torch.isfinite(rounded_w).all()):
                rounded_w = weights  # likewise a weight
            cache[dtype] = (rounded, rounded_w)
        return cache[dtype]

    @functools.cached_property
    def metric_denoms(self) -> torch.Tensor:
        """``d[i]`` of the default reducer, for metrics other than the PG loss: sample_mean, or
        token_mean when the step itself is token-level (as a term that names no reducer,
        docs/terms.md), under the config's ``empty_samples`` (under skip, empty samples do not
        count in sample_mean's N either)."""
        spec = mode_spec(default_term_mode(self.config.mode))
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

        The keywords are the step totals of :data:`lossagg.totals.TOTALS`: ``num_samples``
        (``N``, verl's ``global_batch_size``), ``num_nonempty_samples`` (``N'``, NeMo-RL's
        ``global_valid_seqs``), ``total_tokens`` (``T``, verl's ``batch_num_tokens``, TRL's
        ``num_items_in_batch``), ``max_tokens`` (``L_max``), ``num_groups`` (``P``),
        ``num_nonempty_groups`` (``P'``) and ``group_token_sums`` (``Sg[g(i)]`` of each local
        sample). The mode's totals (``lossagg.MODES[mode].totals``) are required, ``num_samples``
        also for :meth:`metrics`; under ``empty_samples="skip"`` their stand-ins instead
        (``num_nonempty_samples`` for ``num_samples``, ``num_nonempty_groups`` for
        ``num_groups``). Each value is checked against this rank's own ``token_counts`` and
        against the others. A weighted mean (docs/terms.md) also needs ``weight_sum`` or
        ``abs_weight_sum`` (their ``nonempty_`` stand-ins under skip), and ``sample_weights``.
        """
        return cls(config, token_counts, sample_weights=sample_weights, _totals=totals)

    # ------------------------------------------------------------------- use
    def sample_denoms_for(self, samples: Samples, *, dtype=torch.float32, device=None) -> torch.Tensor:
        """``sample_denoms`` of a micro-batch, given its samples' positions among this rank's samples."""
        d = self.sample_denoms[self._positions(samples)]
        return d.to(dtype=dtype, device=device or self.device)

    def _positions(self, samples: Samples) -> torch.Tensor:
        """Positions among this rank's samples: integers in [0, n_local), a slice, or a bool selection of length n_local."""
        return sample_positions(samples, self.token_counts.shape[0], self.device)

    def _micro_batch_denoms(self, samples: Samples, mask: torch.Tensor, cu_seqlens, device) -> torch.Tensor:
        check_holds_data("mask", mask)
        check_holds_data("cu_seqlens", cu_seqlens)
        d = self.sample_denoms_for(samples, dtype=torch.float64, device=device)
        self._check_micro_batch(d.shape[0], mask, cu_seqlens)
        return d

    @staticmethod
    def _check_micro_batch(selected: int, mask: torch.Tensor, cu_seqlens) -> None:
        """The samples selected are the micro-batch's (one per segment of its layout)."""
        b = (cu_seqlens.shape[0] - 1 if cu_seqlens.dim() == 1 else -1) if isinstance(cu_seqlens, torch.Tensor) else mask.shape[0]
        if b >= 0 and selected != b:
            layout = "cu_seqlens has" if cu_seqlens is not None else "the padded mask has"
            raise ValueError(f"samples selects {selected} sample(s) but {layout} {b}: one position per sample of the micro-batch")

    def loss(
        self,
        per_token_loss: torch.Tensor,
        mask: torch.Tensor,
        samples: Samples,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This micro-batch's contribution to J (on this CP rank's tokens, if sharded)."""
        d = self._micro_batch_denoms(samples, mask, cu_seqlens, per_token_loss.device)
        if self.config.weighting == "none":
            return reduce(per_token_loss, mask, cu_seqlens=cu_seqlens, sample_denoms=d)
        # weighted numerators: the sample's sum times its weight, then added as reduce adds them
        sums = segment_sum(per_token_loss, mask, cu_seqlens)
        return self._weighted_total(sums, d, self._positions(samples))

    def _weighted_total(self, sums: torch.Tensor, d: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Σ_i w_i S_i / d[i] of a micro-batch's sums ``S`` ``[B]``, added as reduce adds a sample's
        quotients (over B one-token rows)."""
        w = self.sample_weights[positions.to(self.sample_weights.device)].to(device=sums.device, dtype=sums.dtype)
        rows = torch.ones((sums.shape[-1], 1), dtype=torch.bool, device=sums.device)
        return reduce((sums * w).unsqueeze(1), rows, sample_denoms=d)

    def loss_terms(
        self,
        terms: Mapping[str, torch.Tensor],
        mask: torch.Tensor,
        samples: Samples,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This micro-batch's contribution to the whole loss ``J = Σ_k c_k J_k`` (docs/terms.md).

        ``terms`` maps every term's name to its per-token values (each with the token shape of
        ``mask``; each term accumulates as :func:`lossagg.reduce` does for its dtype, and the
        total is in the widest of them): ``"pg"`` (the config's own mode, coefficient 1) and each
        of ``config.terms`` (its own reducer and coefficient). ``J_k`` is the term's
        ``Σ_i S_ki / d_k[i]`` over this micro-batch's samples, with ``d_k`` from this plan
        (:attr:`term_denoms`): summed over every micro-batch and rank it is the step's value of
        every term at once, and so is the gradient of each term's values,
        ``c_k · m[t] / d_k[i(t)]``. Terms of one dtype are reduced by one
        :func:`lossagg.reduce_terms` call: one native pass over the K values where they lie, with
        one read of the mask, each ``J_k`` added as :func:`lossagg.reduce` adds it (a weighted
        term's sums multiplied by the weights first), so a step with the PG term alone gives the
        bits of :meth:`loss`. Terms of several dtypes take one :func:`lossagg.reduce` per term.
        """
        return self._loss_terms(terms, mask, samples, cu_seqlens)[0]

    def loss_terms_parts(
        self,
        terms: Mapping[str, torch.Tensor],
        mask: torch.Tensor,
        samples: Samples,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(:meth:`loss_terms`, each term's own contribution ``J_k`` before its coefficient, by
        name): the total is differentiable, the parts are detached (for a tracker: summed over
        micro-batches and ranks they are each term's step value)."""
        total, parts = self._loss_terms(terms, mask, samples, cu_seqlens)
        names = self._term_table[0]
        return total, dict(zip(names, parts.unbind(0) if isinstance(parts, torch.Tensor) else parts, strict=True))

    def _loss_terms(self, terms, mask, samples, cu_seqlens):
        """(J, the terms' J_k: a [K] tensor, or a list for terms of several dtypes)."""
        names, _, _, coefficients = self._term_table
        if not isinstance(terms, Mapping):
            raise TypeError(f"terms must be a mapping of term name -> per-token values ({', '.join(names)}), got {type(terms).__name__}")
        if len(terms) != len(names) or not all(n in terms for n in names):
            missing = [n for n in names if n not in terms]
            unknown = [n for n in terms if n not in names]
            got = ", ".join(map(repr, terms)) or "none"
            raise ValueError(
                f"terms must hold exactly the loss's terms, {', '.join(names)} ('pg' and the config's terms), got {got}"
                + (f": missing {', '.join(missing)}" if missing else "")
                + (f"; not terms of the config: {', '.join(map(repr, unknown))}" if unknown else "")
            )
        values = [terms[n] for n in names]
        first = values[0]
        one_call = _plain_terms(values, mask)
        if not one_call:  # the usual call skips these checks (each names what is wrong)
            check_holds_data("mask", mask)
            for n, t in zip(names, values, strict=True):
                check_holds_data(f"terms[{n!r}]", t)
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(mask.shape):
                    got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"terms[{n!r}] must be a tensor with the token shape of mask {tuple(mask.shape)}, got {got}")
            one_call = all(v.dtype == first.dtype and v.device == first.device for v in values)
        if one_call:
            # one native pass over the K values where they lie, with one read of the mask; d and w in
            # the accumulation dtype, rounded once here as the kernel would round them
            check_holds_data("cu_seqlens", cu_seqlens)
            denoms, weights = self._term_table_in(torch.float64 if first.dtype is torch.float64 else torch.float32)
            if not (isinstance(samples, slice) and samples == slice(None)):
                positions = self._positions(samples)
                denoms = denoms[:, positions]
                weights = None if weights is None else weights[:, positions]
            self._check_micro_batch(denoms.shape[1], mask, cu_seqlens)
            if denoms.device != first.device:
                denoms = denoms.to(first.device)
                weights = None if weights is None else weights.to(first.device)
            return reduce_terms_of(values, mask, cu_seqlens, denoms, weights, coefficients)
        # terms of several dtypes: one reduce per term, each accumulating as reduce does for its own
        d = self._micro_batch_denoms(samples, mask, cu_seqlens, first.device)
        positions = self._positions(samples)
        total, parts = None, []
        for n, v in zip(names, values, strict=True):
            d_k = d if n == PG_TERM else self.term_denoms[n][positions].to(device=d.device)
            weighting = self.config.weighting if n == PG_TERM else self.config.terms[n].weighting
            if weighting == "none":
                j_k = reduce(v, mask, cu_seqlens=cu_seqlens, sample_denoms=d_k)
            else:  # the sums times the samples' weights, then added as reduce adds them
                j_k = self._weighted_total(segment_sum(v, mask, cu_seqlens), d_k, positions)
            parts.append(j_k.detach())
            part = j_k if n == PG_TERM else j_k * self.config.terms[n].coefficient
            total = part if total is None else total + part
        return total, parts

    def metrics(
        self,
        metrics: dict[str, torch.Tensor],
        mask: torch.Tensor,
        samples: Samples,
        cu_seqlens: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Contributions of several per-token metrics under the default reducer (:attr:`metric_denoms`:
        sample_mean, or token_mean when the step is token-level).

        One native segment_sum launch over the stacked ``[K, tokens]`` metrics. Sum the returned
        values over micro-batches (and all-reduce over ranks) for the step-level value of each
        metric.
        """
        names = list(metrics)
        if not names:
            return {}
        for k in names:
            if not isinstance(metrics[k], torch.Tensor) or tuple(metrics[k].shape) != tuple(mask.shape):
                got = tuple(metrics[k].shape) if isinstance(metrics[k], torch.Tensor) else type(metrics[k]).__name__
                raise ValueError(f"metric {k!r} must have the token shape of mask {tuple(mask.shape)}, got {got}")
        stacked = torch.stack([metrics[k].detach() for k in names])
        sums = segment_sum(stacked, mask, cu_seqlens)
        positions = self._positions(samples)
        if positions.shape[0] != sums.shape[-1]:
            raise ValueError(f"samples selects {positions.shape[0]} sample(s) but the micro-batch holds {sums.shape[-1]}")
        d = self.metric_denoms[positions].to(sums.device, torch.float64)
        contrib = (sums.to(torch.float64) / d).sum(-1)
        return {k: contrib[i] for i, k in enumerate(names)}

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
    ) -> torch.Tensor:
        """Per-token weights of a micro-batch, for trainers that fold the reduction into the advantages
        (SkyRL's style; docs/integration.md, "Advantage scaling (SkyRL)").

        The result has the token shape of ``mask`` (padded ``[B, T]``, or packed ``[T]`` with
        ``cu_seqlens``), on its device, in ``dtype`` (a floating dtype, float32 by default): every
        token of sample ``i``, masked or not, holds ``gradient_scale(convention, dp_size=...,
        cp_size=..., num_micro_batches=...) / d[i]``. The mask is not in the weights (the
        trainer masks the loss itself), so::

            (weights * per_token_loss * mask).sum() == plan.loss(per_token_loss, mask, samples, cu_seqlens) * scale

        up to float rounding, wherever ``per_token_loss`` is finite (``plan.loss`` drops a NaN
        or inf under a zero mask, a product does not). Scaling the advantages instead,
        ``advantages * weights``, gives the same loss when the per-token loss scales with its
        advantage, ``l(w·A) = w·l(A)`` for ``w > 0`` (PPO-clip, dual clip, a plain policy
        gradient); terms without the advantage (a KL or entropy term) are
        not reweighted and need their own reduction (``plan.loss`` or ``plan.metrics``).
        ``mask`` and ``cu_seqlens`` are checked as the ops check them (docs/ops.md, "Bad input").
        """
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype (the weights are 1/d[i]), got {dtype!r}")
        scale = gradient_scale(convention, dp_size=dp_size, cp_size=cp_size, num_micro_batches=num_micro_batches)
        try:  # the layout checks of the ops, on mask and cu_seqlens (one pass over the mask; the counts are not needed)
            _token_counts(mask, cu_seqlens)
        except (TypeError, ValueError) as exc:
            raise type(exc)(str(exc).replace("lossagg.token_counts: ", "StepPlan.token_weights: ", 1)) from None
        d = self._micro_batch_denoms(samples, mask, cu_seqlens, mask.device)
        per_sample = d.new_full(d.shape, scale) / d  # float64, rounded once (a number over a tensor is its reciprocal times it)
        if self.config.weighting != "none":  # the sample's weight too: w_i · scale / d[i], any sign, 0 a weight of 0
            per_sample = per_sample * self.sample_weights[self._positions(samples).to(self.sample_weights.device)].to(per_sample.device)
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
      tested against it (tests/test_engine_megatron.py).
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
