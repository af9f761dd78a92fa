"""One micro-batch's share of the step's loss: the handle both plans make, and the one function that reduces it.

A plan (:class:`lossagg.StepPlan`, :class:`lossagg.DeferredPlan`) knows, for each of its samples,
every term's denominator ``d_k[i]`` (docs/terms.md) and weight ``w[i]``. Once per micro-batch,
``plan.micro_batch(samples, mask, cu_seqlens)`` checks what depends on the data (the positions,
that they match the layout, that every ``d_k[i]`` and weight survives the accumulation dtype) and
returns a :class:`MicroBatch` that holds the micro-batch's rows of those tables, ready for the
kernels. :func:`reduce_micro_batch` (what ``plan.loss`` runs) then reduces::

    J_mb = Σ_k c_k J_k,    J_k = Σ_{i in mb} w_k[i] · (Σ_{t in i} m[t] · l_k[t]) / d_k[i]

with checks on metadata only (names, shapes, dtypes), so a loss function that calls it compiles
whole (``torch.compile(fullgraph=True)``). A plan whose config has only the PG term takes one
tensor; a config with ``terms`` takes a mapping of every term's values by name, and one tensor
is refused, naming the terms. One term, unweighted, is one :func:`lossagg.reduce`; otherwise one
:func:`lossagg.reduce_terms` (one per term when the terms differ in dtype, each accumulating as
``reduce`` does for its own dtype, the total in the widest).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lossagg.ops import _readable, reduce, reduce_terms_of, segment_sum
from lossagg.validate import check_holds_data

Samples = slice | Sequence[int] | torch.Tensor
_STRIDED = torch.strided


# ------------------------------------------------------------------------------ samples and weights
def sample_positions(samples: Samples, n: int, device) -> torch.Tensor:
    """Positions among a rank's ``n`` samples (int64 on ``device``): integers in [0, n), a slice,
    or a bool selection of length n; each sample named at most once."""
    return positions_and_run(samples, n, device)[0]


def check_slice(samples: slice) -> None:
    """``samples`` given as a slice: integer bounds (or None) and a step >= 1 (a micro-batch's samples in order)."""
    for part in ("start", "stop", "step"):
        value = getattr(samples, part)
        if value is not None:
            try:
                operator.index(value)
            except TypeError:
                raise TypeError(f"samples as a slice must have integer bounds, got {part}={value!r}") from None
    if samples.step is not None and operator.index(samples.step) < 1:
        raise ValueError(f"samples as a slice must step forward (a step >= 1: the samples in order), got step={samples.step}")


def positions_and_run(samples: Samples, n: int, device, pieces: bool = False) -> tuple[torch.Tensor, slice | None]:
    """(:func:`sample_positions`, the same positions as a slice when they are one run of consecutive
    samples, else None): a plan's tables are then cut as views, with no gather. With ``pieces`` a
    sample may be named several times (each segment of the layout a piece of the sample it names)."""
    check_holds_data("samples", samples)
    if isinstance(samples, slice):
        check_slice(samples)
        lo, hi, step = samples.indices(n)
        run = slice(lo, max(hi, lo)) if step == 1 else None
        return torch.arange(n, device=device)[samples], run
    if isinstance(samples, (int, bool)) or (isinstance(samples, torch.Tensor) and samples.dim() == 0):
        raise TypeError("samples must be a 1-D selection of this rank's samples (integer positions, a slice or a bool mask), got a scalar")
    try:
        pos = samples if isinstance(samples, torch.Tensor) else torch.as_tensor(samples)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"samples must be integer positions, a slice or a bool selection, got {type(samples).__name__}") from None
    if pos.dim() != 1:
        raise ValueError(f"samples must be 1-D, got shape {tuple(pos.shape)}")
    if pos.numel() == 0 and pos.dtype != torch.bool:  # no samples (an empty list is float32 to torch)
        return torch.zeros(0, dtype=torch.long, device=device), slice(0, 0)
    if pos.dtype == torch.bool:
        if pos.shape[0] != n:
            raise ValueError(f"samples as a bool selection must have one entry per sample of this rank ({n}), got {pos.shape[0]}")
        return torch.nonzero(pos).flatten().to(device), None
    if pos.is_floating_point() or pos.is_complex():
        raise TypeError(f"samples must hold integer positions, got dtype {pos.dtype}")
    run = None
    if pos.numel() and pos.device.type == "cpu":  # positions on an accelerator are not read back (no host sync)
        lo, hi = (int(x) for x in torch.aminmax(pos))
        if lo < 0 or hi >= n:
            raise ValueError(f"samples must be positions in [0, {n}) among this rank's samples, got values in [{lo}, {hi}]")
        if pos.numel() == 1 or bool((pos[1:] > pos[:-1]).all()):  # increasing (the usual order): distinct
            run = slice(lo, hi + 1) if hi - lo + 1 == pos.numel() else None
            return pos.to(device=device, dtype=torch.long), run
        distinct, counts = torch.unique(pos, return_counts=True)
        if distinct.numel() != pos.numel() and not pieces:
            first = int(torch.nonzero(counts > 1)[0, 0])
            raise ValueError(
                f"samples must name each sample of the micro-batch once, got position {int(distinct[first])} {int(counts[first])} times "
                "(a sample counted twice would weigh twice in J)"
            )
    return pos.to(device=device, dtype=torch.long), run


def check_layout(selected: int, mask: torch.Tensor, cu_seqlens) -> None:
    """The micro-batch's layout (``cu_seqlens`` a tensor or None, a padded mask 2-D) and the samples selected
    its own (one per segment of its layout)."""
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(
            f"cu_seqlens must be a 1-D int32/int64 tensor of the samples' offsets [B+1], or None for a padded mask, got {type(cu_seqlens).__name__}"
        )
    if cu_seqlens is None and mask.dim() != 2:
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} and cu_seqlens is None: a packed [T] mask needs cu_seqlens (its samples' offsets), "
            "a padded mask is [B, T]"
        )
    b = (cu_seqlens.shape[0] - 1 if cu_seqlens.dim() == 1 else -1) if isinstance(cu_seqlens, torch.Tensor) else mask.shape[0]
    if b >= 0 and selected != b:
        layout = "cu_seqlens has" if cu_seqlens is not None else "the padded mask has"
        raise ValueError(f"samples selects {selected} sample(s) but {layout} {b}: one position per sample of the micro-batch")


def cut_from_step(positions: torch.Tensor, mask: torch.Tensor, cu_seqlens) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """(the micro-batch's token selection, its mask, its own ``cu_seqlens``) cut from the rank's
    step layout (``mask`` and ``cu_seqlens`` of all its samples). Packed: the samples must be
    consecutive, the tokens a slice; padded: the rows of the samples (a slice when consecutive)."""
    check_holds_data("mask", mask)
    check_holds_data("cu_seqlens", cu_seqlens)
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    pos = positions.cpu()
    n = pos.shape[0]
    consecutive = n == 0 or bool((pos == torch.arange(int(pos[0]), int(pos[0]) + n)).all())
    if cu_seqlens is None:
        if mask.dim() != 2:
            raise ValueError(f"mask must be the step's padded [N, T] mask when cu_seqlens is None, got shape {tuple(mask.shape)}")
        rows = slice(int(pos[0]), int(pos[0]) + n) if consecutive and n else positions.to(mask.device)
        return rows, mask[rows], None
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        raise ValueError("cu_seqlens must be the step's 1-D [N+1] tensor to cut a micro-batch from it")
    if mask.dim() != 1 or cu_seqlens.numel() < 1 or int(cu_seqlens[-1]) != mask.shape[0]:
        ends = int(cu_seqlens[-1]) if cu_seqlens.numel() else None
        raise ValueError(
            f"with step_layout=True, mask must be the step's packed [T] mask and cu_seqlens its offsets: cu_seqlens ends at {ends}, "
            f"the mask has shape {tuple(mask.shape)}"
        )
    if not consecutive:
        raise ValueError(
            f"samples must be consecutive positions to cut a micro-batch from the step's packed layout (its tokens one slice), "
            f"got {pos.tolist()[:8]}{' ...' if n > 8 else ''}"
        )
    first = int(pos[0]) if n else 0
    bounds = cu_seqlens[first : first + n + 1]
    lo, hi = (int(bounds[0]), int(bounds[-1])) if n else (0, 0)
    tokens = slice(lo, hi)
    return tokens, mask[tokens], bounds - bounds[0] if n else cu_seqlens.new_zeros(1)


# ------------------------------------------------------------------------------------- the handle
#: The float64 numbers that round (to nearest, ties to even) to a normal float32 >= its smallest normal 2**-126,
#: and to a finite float32: [2**-126 - 2**-150, 2**128 - 2**103); both bounds are exact in float64.
_F32_NORMAL_FROM, _F32_FINITE_BELOW = 2.0**-126 - 2.0**-150, 2.0**128 - 2.0**103


def term_tables(denoms: torch.Tensor, weights: torch.Tensor | None, device, bounds: tuple[float, float] | None = None) -> dict:
    """``d`` ``[K, B]`` and ``w`` (or None) as the kernels take them, by accumulation dtype (float32,
    float64), on ``device``: rounded once here as the kernels would round them. A ``d_k[i]`` or a
    weight that float32 cannot carry (out of its range, or subnormal there) stays as given, so that
    the op refuses it naming the value (docs/ops.md, "Bad input"). ``bounds``: the smallest and the
    largest ``d_k[i]`` when known (read when they were checked), so that ``d`` is not read again."""
    denoms = denoms.to(device)
    weights = None if weights is None else weights.to(device)
    tiny = torch.finfo(torch.float32).tiny  # the smallest normal float32: the kernels refuse a subnormal divisor or weight
    d32 = denoms.to(torch.float32)
    if bounds is not None:  # rounding is monotonic: d32's extremes are the rounded bounds (host numbers, no read of d)
        fits = not denoms.numel() or (bounds[0] >= _F32_NORMAL_FROM and bounds[1] < _F32_FINITE_BELOW)
    else:
        fits = bool((torch.isfinite(d32) & (d32 >= tiny)).all())
    if not fits:
        d32 = denoms
    w32 = None if weights is None else weights.to(torch.float32)
    if w32 is not None and not bool((torch.isfinite(w32) & ((w32.abs() >= tiny) | (weights == 0))).all()):
        w32 = weights
    return {torch.float32: (d32, w32), torch.float64: (denoms, weights)}


def table_rows(tables: dict, cut, device) -> dict:
    """The micro-batch's rows of a plan's kernel tables (``cut``: a slice of consecutive samples, cut as
    views, or their positions), on ``device``."""
    out = {}
    for acc, (d, w) in tables.items():
        d, w = d[:, cut], None if w is None else w[:, cut]  # contiguous: a column cut of K > 1 rows is copied here once, not per call
        out[acc] = (d.to(device).contiguous(), None if w is None else w.to(device).contiguous())
    return out


def stack_term_tables(terms, denoms: Mapping[str, torch.Tensor], weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss's terms (``config.loss_terms``) as :func:`lossagg.reduce_terms` takes them: ``d_k[i]``
    ``[K, B]`` from each term's row ``denoms[name]`` and the weights ``[K, B]`` (the samples' weights
    for a term that weighs them, 1 for one that does not; None when no term does)."""
    d = denoms[terms[0].name].unsqueeze(0) if len(terms) == 1 else torch.stack([denoms[t.name] for t in terms])
    if all(t.weighting == "none" for t in terms):
        return d, None
    ones = torch.ones_like(weights)
    return d, torch.stack([ones if t.weighting == "none" else weights for t in terms])


class MicroBatch:
    """One micro-batch of a plan, checked once: made by ``plan.micro_batch(...)``, reduced by
    ``plan.loss(values, mb)`` and ``plan.metrics(metrics, mb)``.

    * ``mask``, ``cu_seqlens``: the micro-batch's own layout (packed ``[T]`` with ``cu_seqlens``,
      padded ``[B, T]``);
    * ``samples``: the positions of its ``B`` samples among the rank's (int64 ``[B]``);
    * ``tokens``: where its tokens lie in the rank's step tensors when it was cut from them
      (``plan.micro_batch(..., step_layout=True)``: a slice, or the rows of a padded layout), else
      None: ``values[mb.tokens]`` selects a step tensor's share;
    * ``names``: the terms ``plan.loss`` takes, ``"pg"`` first.
    """

    def __init__(self, owner, names, coefficients, samples, mask, cu_seqlens, tables, tokens=None, log=None):
        self.owner = owner
        self.names = tuple(names)
        self.coefficients = list(coefficients)
        self.samples = samples
        self.mask = mask
        self.cu_seqlens = cu_seqlens
        self.tokens = tokens
        self.tables = tables
        # a DeferredPlan's record of what this micro-batch's loss returned (the terms' J_k)
        self.log = log
        self._readable = None  # whether the layout and tables pass ops._readable's test (tested on first use)

    def layout_read(self) -> bool:
        """The mask, ``cu_seqlens`` and every table pass :func:`lossagg.ops._readable`'s test as if saved
        for the backward: tested once (the kernels read them where they lie); not while torch.compile traces
        (the usual route then, whose fake kernels check what a trace can see)."""
        if self._readable is None:
            if torch.compiler.is_compiling():
                return False
            tables = [t for pair in self.tables.values() for t in pair]
            self._readable = _readable((self.mask, self.cu_seqlens, *tables), True)
        return self._readable

    @property
    def num_samples(self) -> int:
        return int(self.samples.shape[0])

    def __repr__(self) -> str:
        layout = "packed" if self.cu_seqlens is not None else "padded"
        return f"MicroBatch({self.num_samples} samples, {layout} {tuple(self.mask.shape)}, terms {', '.join(self.names)})"


def given_micro_batch(plan, micro_batch, samples, cu_seqlens, what: str) -> MicroBatch | None:
    """The :class:`MicroBatch` a call of ``plan`` names (checked: the plan's own, alone), or None when
    the call names the micro-batch by its mask, samples and cu_seqlens instead."""
    if isinstance(micro_batch, MicroBatch):
        if samples is not None or cu_seqlens is not None:
            raise TypeError(f"{what}: a MicroBatch already holds its samples and layout; pass it alone, without samples or cu_seqlens")
        if micro_batch.owner is not plan:
            raise ValueError(f"{what}: the MicroBatch was made by another plan (plan.micro_batch of this step's plan makes one)")
        return micro_batch
    if samples is None:
        raise TypeError(f"{what}: pass a MicroBatch (plan.micro_batch(samples, mask, cu_seqlens)) or mask, samples and cu_seqlens")
    return None


class MicroBatchLog:
    """What a :class:`lossagg.DeferredPlan` keeps of one micro-batch until ``close()``: its samples
    and each term's ``J_k`` its loss returned, by name (filled by the loss, compiled or not; each
    term once: a second reduction of a term on one micro-batch would count in the gradients twice
    and in the step's J once)."""

    def __init__(self, samples: torch.Tensor):
        self.samples = samples
        self.parts: dict[str, torch.Tensor] = {}


# --------------------------------------------------------------------------------- the reduction
def _selected(mb: MicroBatch, terms, what: str) -> tuple[tuple[str, ...], list[int]]:
    """The terms a call reduces (all of the micro-batch's, or ``terms``: a name or a sequence of names)
    and their rows in its tables."""
    if terms is None:
        return mb.names, list(range(len(mb.names)))
    names = (terms,) if isinstance(terms, str) else tuple(terms) if isinstance(terms, (list, tuple)) else None
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what}: terms must be a term's name or a list of them (of {', '.join(mb.names)}), got {terms!r}")
    unknown = [n for n in names if n not in mb.names]
    if unknown or len(set(names)) != len(names):
        why = f"not terms of the config: {', '.join(map(repr, unknown))}" if unknown else "a term named twice"
        raise ValueError(f"{what}: terms must name terms of the loss ({', '.join(mb.names)}) once each, got {list(names)}: {why}")
    return names, [mb.names.index(n) for n in names]


def _term_values(values, names: tuple[str, ...], what: str, every: bool = True) -> list:
    """The values of the terms ``names`` in order (``every`` term of the loss, or those a call names),
    from one tensor (one term) or a mapping."""
    if isinstance(values, torch.Tensor):
        if len(names) != 1:
            raise ValueError(
                f"{what}: the config has the terms {', '.join(names[1:])} besides {names[0]!r}, so the loss takes a mapping of every term's "
                f"per-token values by name ({', '.join(map(repr, names))}), got one tensor (it would be the PG term alone)"
                if every
                else f"{what}: terms names {', '.join(map(repr, names))}, so values must map each to its per-token values, got one tensor"
            )
        return [values]
    if not isinstance(values, Mapping):
        raise TypeError(f"{what}: values must be a tensor (the PG term) or a mapping of term name -> per-token values, got {type(values).__name__}")
    if len(values) != len(names) or not all(n in values for n in names):
        missing = [n for n in names if n not in values]
        unknown = [n for n in values if n not in names]
        got = ", ".join(map(repr, values)) or "none"
        raise ValueError(
            (
                f"{what}: values must hold exactly the loss's terms, {', '.join(names)} ('pg' and the config's terms), got {got}"
                if every
                else f"{what}: values must hold exactly the terms it names (terms=), {', '.join(names)}, got {got}"
            )
            + (f": missing {', '.join(missing)}" if missing else "")
            + (f"; not terms {'of the config' if every else 'named here'}: {', '.join(map(repr, unknown))}" if unknown else "")
        )
    return [values[n] for n in names]


def _usual(seq: list) -> bool:
    """The terms of the usual call as :func:`reduce_terms_of` reads them untested: each a plain floating tensor of
    one dtype, dense and contiguous, not made under inference mode where a gradient may be recorded. Their shapes
    and devices are the op's own checks: a call it refuses is taken again by the general route, which names the
    term. A test per term of four reads, where the general route's two tests read eight."""
    first = seq[0]
    if type(first) is not torch.Tensor or not first.is_floating_point():
        return False
    dtype, grad = first.dtype, torch.is_grad_enabled() and not torch.compiler.is_compiling()  # a trace has no inference tensors to test
    for t in seq:
        if type(t) is not torch.Tensor or t.dtype is not dtype or t.layout is not _STRIDED or not t.is_contiguous() or (grad and t.is_inference()):
            return False
    return True


def _plain(seq: list, mask) -> bool:
    """Every term a dense tensor of the mask's shape, one dtype and device: the usual call, whose
    named checks are skipped (the op checks the rest)."""
    first = seq[0]
    if type(first) is not torch.Tensor or not first.is_floating_point():
        return False
    shape, dtype, device = mask.shape, first.dtype, first.device
    if first.layout is not _STRIDED or first.shape != shape:
        return False
    for t in seq[1:]:
        if not (isinstance(t, torch.Tensor) and t.layout is _STRIDED and t.shape == shape and t.dtype is dtype and t.device == device):
            return False
    return True


@functools.lru_cache(maxsize=256)
def _labels(names: tuple[str, ...], one: bool) -> tuple[str, ...]:
    """The values as the user passed them: ``values`` alone (``one`` tensor), or ``values['kl']`` of a mapping."""
    return ("values",) if one else tuple(f"values[{n!r}]" for n in names)


def _check_values(labels, seq, mb: MicroBatch, what: str) -> None:
    """Each term's values named as the user passed them: a tensor holding data with the token shape of the mask."""
    for label, t in zip(labels, seq, strict=True):
        check_holds_data(label, t)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(mb.mask.shape):
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what}: {label} must be a tensor with the token shape of the micro-batch's mask {tuple(mb.mask.shape)}, got {got}")
        if not t.is_floating_point():
            raise TypeError(f"{what}: {label} must have a floating dtype (per-token values), got {t.dtype}")
        if t.device != mb.mask.device:
            raise ValueError(f"{what}: {label} must be on the device of the micro-batch's mask ({mb.mask.device}), got {t.device}")


def reduce_micro_batch(values, mb: MicroBatch, *, terms=None, coefficients: bool = True, parts: bool = False, what: str = "plan.loss"):
    """``J_mb = Σ_k c_k J_k`` of one micro-batch (module docstring) over its terms, or over the terms
    ``terms`` names (without their coefficients when ``coefficients`` is False: one term's ``J_k`` as
    a trainer that applies the coefficient itself takes it): a 0-dim tensor differentiable in every
    term's values, in the widest accumulation dtype of the terms; with ``parts``, also each term's
    ``J_k`` before its coefficient, detached, by name."""
    if type(values) is dict and terms is None and coefficients and not parts and len(mb.names) > 1 and (mb.log is None or not mb.log.parts):
        seq = [values.get(n) for n in mb.names]  # the usual call: each term's tensor by name, the checks below passed
        if len(values) == len(seq) and _usual(seq) and mb.layout_read():
            d, w = mb.tables[torch.float64 if seq[0].dtype is torch.float64 else torch.float32]
            try:
                total, split = reduce_terms_of(seq, mb.mask, mb.cu_seqlens, d, w, mb.coefficients, _labels(mb.names, False), True, True)
            except (TypeError, ValueError):  # a term of another shape or device than the mask's: the route below names it
                pass
            else:
                if mb.log is not None:
                    mb.log.parts.update(zip(mb.names, split, strict=True))
                return total
    names, rows = _selected(mb, terms, what)
    seq = _term_values(values, names, what, terms is None)
    labels = _labels(names, isinstance(values, torch.Tensor))
    plain = _plain(seq, mb.mask)  # then every term has one dtype
    if not plain:
        _check_values(labels, seq, mb, what)
    if mb.log is not None:
        again = [n for n in names if n in mb.log.parts]
        if again:
            raise ValueError(
                f"{what}: the term(s) {', '.join(again)} of this micro-batch were already reduced: a DeferredPlan counts each term of a "
                "micro-batch once (a second reduction would count twice in the gradients and once in the step's J); make a new "
                "micro-batch for other samples"
            )
    whole = len(rows) == len(mb.names)
    coefs = mb.coefficients if whole and coefficients else [mb.coefficients[k] if coefficients else 1.0 for k in rows]
    first = seq[0]
    if plain or all(v.dtype is first.dtype for v in seq):
        d, w = mb.tables[torch.float64 if first.dtype is torch.float64 else torch.float32]
        if not whole:
            d, w = _rows(d, rows), None if w is None else _rows(w, rows)
        if len(seq) == 1 and w is None and coefs[0] == 1.0:
            total = reduce(first, mb.mask, cu_seqlens=mb.cu_seqlens, sample_denoms=d[0])
            split = [total.detach()]
        else:
            total, split = reduce_terms_of(seq, mb.mask, mb.cu_seqlens, d, w, coefs, labels)  # split: [K], read by row below
    else:  # one reduce_terms per term, each accumulating as reduce does for its dtype; the total in the widest
        total, split = None, []
        for j, (k, v) in enumerate(zip(rows, seq, strict=True)):
            d, w = mb.tables[torch.float64 if v.dtype is torch.float64 else torch.float32]
            table = None if w is None else w[k : k + 1]
            j_k, part = reduce_terms_of([v], mb.mask, mb.cu_seqlens, d[k : k + 1], table, [coefs[j]], labels[j : j + 1])
            split.append(part[0])
            total = j_k if total is None else total + j_k
    if mb.log is not None:
        mb.log.parts.update(zip(names, split, strict=True))
    if parts:
        return total, dict(zip(names, split, strict=True))
    return total


def _rows(table: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows of a ``[K, B]`` table: a view for one row or a run of rows, else a gather."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return table[rows[0] : rows[0] + len(rows)]
    return table[rows]


def reduce_metrics(metrics: Mapping[str, torch.Tensor], mask, cu_seqlens, denoms: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each per-token metric's ``Σ_i S_i / d[i]`` over a micro-batch (float64, detached): one native
    ``segment_sum`` over the stacked ``[K, tokens]`` metrics, divided by ``denoms`` (float64 ``[B]``)."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of metric name -> per-token values, got {type(metrics).__name__}")
    names = list(metrics)
    if not names:
        return {}
    for k in names:
        if not isinstance(metrics[k], torch.Tensor) or tuple(metrics[k].shape) != tuple(mask.shape):
            got = tuple(metrics[k].shape) if isinstance(metrics[k], torch.Tensor) else type(metrics[k]).__name__
            raise ValueError(f"metrics[{k!r}] must have the token shape of mask {tuple(mask.shape)}, got {got}")
        if not metrics[k].is_floating_point():
            raise TypeError(f"metrics[{k!r}] must have a floating dtype, got {metrics[k].dtype}")
    stacked = torch.stack([metrics[k].detach() for k in names])
    sums = segment_sum(stacked, mask, cu_seqlens)
    if denoms.shape[0] != sums.shape[-1]:
        raise ValueError(f"samples selects {denoms.shape[0]} sample(s) but the micro-batch holds {sums.shape[-1]}")
    contrib = (sums.to(torch.float64) / denoms.to(sums.device, torch.float64)).sum(-1)
    return {k: contrib[i] for i, k in enumerate(names)}


# --------------------------------------------------------------------------------- the plans' entrance
class Plan:
    """What both plans share (:class:`lossagg.StepPlan`, :class:`lossagg.DeferredPlan`): the micro-batch
    handle (``micro_batch``, each plan's own) and its reduction, :meth:`loss`, the one way a micro-batch's
    share of the step's loss is computed (:func:`reduce_micro_batch`)."""

    _loss_what = "Plan.loss"  # each plan's own name in its messages

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._loss_what = f"{cls.__name__}.loss"

    def _made(self, samples, mask, cu_seqlens) -> MicroBatch:  # the plan's own handle of (mask, samples, cu_seqlens)
        raise NotImplementedError

    def _handle(self, micro_batch, samples, cu_seqlens, what: str) -> tuple[MicroBatch, bool]:
        """The micro-batch a call names: a :class:`MicroBatch` of this plan, or (mask, samples, cu_seqlens),
        made here (then True)."""
        mb = given_micro_batch(self, micro_batch, samples, cu_seqlens, what)
        return (mb, False) if mb is not None else (self._made(samples, micro_batch, cu_seqlens), True)

    def _reduce(self, values, mb: MicroBatch, made: bool, **how):
        return reduce_micro_batch(values, mb, **how)

    def loss(self, values, micro_batch, samples=None, cu_seqlens=None, *, terms=None, coefficients: bool = True, parts: bool = False):
        """This micro-batch's contribution to the whole loss ``J = Σ_k c_k J_k`` (docs/terms.md), on
        this CP rank's tokens if sharded: summed over every micro-batch and rank it is the step's
        J, and so is its gradient, ``c_k · w_k[i] · m[t] / d_k[i(t)]`` for each term's values.

        ``values``: the per-token loss (one tensor, for a config with the PG term only), or a
        mapping of every term's per-token values by name (``"pg"``, the config's own mode and
        coefficient 1, and each of ``config.terms``, its own reducer and coefficient); a config
        with terms given one tensor is refused, naming the terms. ``micro_batch``: a
        :class:`lossagg.MicroBatch` from ``plan.micro_batch`` (checked once: the call that a
        trainer compiles), or the micro-batch's ``mask``, followed by ``samples`` and
        ``cu_seqlens``.

        ``terms`` (a term's name or a list of them) reduces those terms only: ``values`` then holds
        exactly them (one tensor for one term); with ``coefficients=False`` their ``J_k`` are summed
        without their coefficients (one term's share as a trainer that applies the coefficient
        itself takes it). With ``parts=True`` returns ``(J_mb, {name: J_k})``, each term's
        contribution before its coefficient, detached (summed over micro-batches and ranks: each
        term's step value, for a tracker).

        One term, unweighted, is one :func:`lossagg.reduce`; the terms of one dtype one
        :func:`lossagg.reduce_terms` (each ``J_k`` added as ``reduce`` adds it); terms of several
        dtypes one call each, each accumulating as ``reduce`` does for its dtype, the total in
        the widest (lossagg/micro_batch.py).
        """
        what = self._loss_what
        if type(micro_batch) is MicroBatch and micro_batch.owner is self and samples is None and cu_seqlens is None:  # its own handle
            return self._reduce(values, micro_batch, False, terms=terms, coefficients=coefficients, parts=parts, what=what)
        mb, made = self._handle(micro_batch, samples, cu_seqlens, what)
        return self._reduce(values, mb, made, terms=terms, coefficients=coefficients, parts=parts, what=what)

    def _metrics(self, metrics, micro_batch, samples, cu_seqlens) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def metrics(self, metrics: Mapping[str, torch.Tensor], micro_batch, samples=None, cu_seqlens=None) -> dict[str, torch.Tensor]:
        """Each per-token metric's contribution under the default reducer (``sample_mean``, or ``token_mean`` when
        the step is token-level; docs/terms.md), float64, detached: one native ``segment_sum`` over the stacked
        ``[K, tokens]`` metrics. Summed over micro-batches (and ranks) it is each metric's step value; a
        :class:`lossagg.DeferredPlan`'s, times :attr:`lossagg.DeferredStep.metric_scale` (its :meth:`close`
        sums them over the ranks: every rank reports the same, declared, metric names). ``micro_batch`` as
        for :meth:`loss`."""
        return self._metrics(metrics, micro_batch, samples, cu_seqlens)


__all__ = ["MicroBatch", "Plan", "reduce_micro_batch", "reduce_metrics", "sample_positions"]
