"""Per-sample global denominators ``d[i]`` (``sample_denoms``), as docs/modes.md defines them.

``d[i]`` is made of step totals and the sample's own token count; which totals, for each
mode, is the mode's entry in :mod:`lossagg.modes`. :func:`plan_totals` gathers them (from
the rank's own samples, combined over the DP group) or takes them from a trainer
(:func:`lossagg.totals.given_totals`); :func:`denoms_from_totals` turns them into ``d[i]``.
:class:`lossagg.StepPlan` calls these. Everything is vectorised and float64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import torch

from lossagg.modes import METRIC_MODE, DenomInputs, ModeSpec, mode_spec
from lossagg.totals import DEFAULT_EMPTY_SAMPLES, RankShare, StepTotals, check_group_label_count, gather_totals, read_as, stand_in
from lossagg.validate import check_group_index, check_group_sizes, check_token_counts  # shared with the step totals


def check_divisor(spec: ModeSpec, divisor) -> None:
    if spec.needs_divisor and (divisor is None or not (math.isfinite(float(divisor)) and float(divisor) > 0)):
        raise ValueError(f"divisor must be a finite number > 0 under mode={spec.name}, got {divisor!r}")


def mode_totals(spec: ModeSpec, empty_samples: str = DEFAULT_EMPTY_SAMPLES) -> tuple[str, ...]:
    """The totals ``d[i]`` of ``spec`` is made of under the ``empty_samples`` convention: the
    mode's own, each replaced by its stand-in (``num_samples`` by ``num_nonempty_samples`` under skip)."""
    return tuple(dict.fromkeys(stand_in(name, empty_samples) for name in spec.totals))


def needed_totals(spec: ModeSpec, empty_samples: str = DEFAULT_EMPTY_SAMPLES) -> tuple[str, ...]:
    """The totals a plan of ``spec`` gathers: the mode's own and the metric reducer's, with their
    stand-ins under the convention (the totals they stand in for are gathered too: ``P`` checks
    the group sizes against ``n_samples_per_prompt``)."""
    metric = mode_spec(METRIC_MODE)
    return tuple(dict.fromkeys((*spec.totals, *mode_totals(spec, empty_samples), *metric.totals, *mode_totals(metric, empty_samples))))


def rank_share(
    spec: ModeSpec,
    token_counts: torch.Tensor,
    group_index,
    *,
    n_samples_per_prompt=None,
    process_group=None,
    num_group_labels=None,
    labels_from: str = "num_group_labels",
) -> RankShare:
    """This rank's own data for the totals of ``spec``: its counts and, with prompt groups, its
    samples' group labels (the distinct labels it holds; with a process group, labels
    ``0..num_group_labels-1`` shared by every rank)."""
    if not spec.needs_groups:
        return RankShare(token_counts, n_samples_per_prompt=n_samples_per_prompt)
    group_index = check_group_index(group_index, token_counts.shape[0], token_counts.device, spec.name)
    if process_group is None:
        labels, dense = torch.unique(group_index, return_inverse=True)
        return RankShare(token_counts, labels, dense, n_samples_per_prompt)
    g = num_group_labels
    check_group_label_count(g, labels_from)
    if group_index.numel() and (group_index.min() < 0 or group_index.max() >= g):
        raise ValueError(
            f"group_index must lie in [0, {g}) (global prompt index within the step), "
            f"got values in [{int(group_index.min())}, {int(group_index.max())}]"
        )
    return RankShare(token_counts, torch.arange(g, device=token_counts.device), group_index.long(), n_samples_per_prompt)


#: Totals every gathered plan holds besides its mode's: ``N`` (the metrics reducer) and ``T``
#: (Megatron's per-token-loss scale); both travel in the one sum all-reduce.
BASE_TOTALS = ("num_samples", "total_tokens")


def plan_totals(spec: ModeSpec, share: RankShare, process_group=None, empty_samples: str = DEFAULT_EMPTY_SAMPLES) -> StepTotals:
    """The totals a plan of ``spec`` holds, gathered from the rank's share over ``process_group``
    (a stand-in, such as ``N'`` under ``empty_samples="skip"``, travels in the same all-reduce as ``N``)."""
    return gather_totals((*needed_totals(spec, empty_samples), *BASE_TOTALS), share, process_group, spec.name)


def denoms_from_totals(
    spec: ModeSpec, token_counts: torch.Tensor, totals: StepTotals, divisor: float | None = None, empty_samples: str = DEFAULT_EMPTY_SAMPLES
) -> torch.Tensor:
    """``d[i]`` (float64) of local samples with counts ``M[i]``, given the step totals of ``spec``.

    Under ``empty_samples="skip"`` the mode reads ``c(N')`` as its ``num_samples`` and ``c(P')`` as
    its ``num_groups`` (:func:`lossagg.totals.read_as`).
    """
    check_divisor(spec, divisor)
    missing = [name for name in mode_totals(spec, empty_samples) if name not in totals]
    if missing:
        raise ValueError(f"mode={spec.name} needs the step total(s) {', '.join(missing)}")
    # only what the mode declared, under the names it declared them
    view = StepTotals({name: read_as(name, totals, empty_samples) for name in spec.totals}, spec.name)
    d = spec.denoms(DenomInputs(token_counts.to(torch.float64), view, None if divisor is None else float(divisor)))
    # named in an error as the user knows them: the totals gathered (or given to from_totals)
    inputs = {stand_in(name, empty_samples): view[name] for name in spec.totals if isinstance(view[name], (int, float))}
    if spec.needs_divisor:
        inputs["divisor"] = divisor
    return check_denoms(d, f"mode={spec.name}", tuple(token_counts.shape), inputs, token_counts.device)


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_denoms(d, what: str, shape: tuple[int, ...], inputs: Mapping[str, object] = MappingProxyType({}), device=None) -> torch.Tensor:
    """``d[i]`` as a mode (``what``) built it, checked before any op sees it; float64.

    A real floating tensor of ``shape`` holding data (not meta) on ``device`` (when given),
    every entry finite and > 0. ``inputs`` are the settings and totals it was made of, named in
    the message when an entry overflows float64 or is not > 0, so the error points at the
    number the user gave rather than at the op's ``sample_denoms``.
    """
    if not isinstance(d, torch.Tensor):
        raise TypeError(f"{what}: its denoms must return a tensor of d[i] (one per local sample), got {type(d).__name__}")
    if tuple(d.shape) != shape:
        raise ValueError(f"{what}: its denoms must return one d[i] per local sample (shape {shape}), got {tuple(d.shape)}")
    if not d.is_floating_point():
        raise TypeError(f"{what}: its denoms must return a real floating tensor of d[i], got dtype {d.dtype}")
    if d.layout != torch.strided:
        raise TypeError(f"{what}: its denoms must return a dense (strided) tensor of d[i], got layout {d.layout}")
    if d.device.type == "meta":
        raise ValueError(f"{what}: its denoms returned a meta tensor (no data); d[i] must hold numbers on the device of the token counts")
    if device is not None and d.device != device:
        raise ValueError(f"{what}: its denoms must return d[i] on the device of the token counts ({device}), got {d.device}")
    d = d.to(torch.float64)
    if d.numel():
        lo, hi = torch.aminmax(d)  # one pass; NaN propagates to both
        if lo.item() > 0 and hi.item() < math.inf:
            return d
    else:
        return d
    bad = ~torch.isfinite(d) | (d <= 0)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        value = float(d[i])
        made_of = ", ".join(f"{name}={_shown(v)}" for name, v in inputs.items())
        if math.isinf(value) and all(math.isfinite(float(v)) for v in inputs.values()):
            why = f"it overflows float64 (made of {made_of}): the settings or totals are too large" if made_of else "it overflows float64"
        else:
            why = f"made of {made_of}" if made_of else "its denoms returned it"
        raise ValueError(f"{what}: d[{i}] = {value!r}, but every d[i] must be finite and > 0 ({int(bad.sum())} of {d.numel()} are not); {why}")
    return d


def prompt_mask_sums(token_counts, group_index, n_samples_per_prompt: int | None = None) -> torch.Tensor:
    """``Sg[g(i)]`` for every sample: the rollout token count of its prompt group (float64 ``[N]``)."""
    counts = check_token_counts(token_counts)
    group_index = check_group_index(group_index, counts.shape[0], counts.device)
    labels, dense, sizes = torch.unique(group_index, return_inverse=True, return_counts=True)
    check_group_sizes(labels, sizes, n_samples_per_prompt)
    sums = torch.zeros(labels.numel(), dtype=torch.float64, device=counts.device).index_add_(0, dense, counts)
    return sums[dense]
