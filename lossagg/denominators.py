"""The per-sample denominators ``d[i]`` (``sample_denoms``) of a plan, as docs/modes.md defines them.

What ``d[i]`` is made of is the mode's entry in :mod:`lossagg.modes` (usually a
:class:`lossagg.DenomProduct`, lossagg/denom_program.py); the step totals it reads come from
:mod:`lossagg.totals` (which a plan needs, gathered or taken from a trainer, read as the mode
reads them). :func:`denoms_from_totals` evaluates and checks ``d[i]``. Everything is vectorised
and float64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import torch

from lossagg.denom_program import DenomInputs
from lossagg.modes import ModeSpec
from lossagg.totals import DEFAULT_EMPTY_SAMPLES, StepTotals, stand_in


def check_divisor(spec: ModeSpec, divisor) -> None:
    if spec.needs_divisor and (divisor is None or not (math.isfinite(float(divisor)) and float(divisor) > 0)):
        raise ValueError(f"divisor must be a finite number > 0 under mode={spec.name}, got {divisor!r}")


def denoms_from_totals(
    spec: ModeSpec,
    token_counts: torch.Tensor,
    read: StepTotals,
    divisor: float | None = None,
    empty_samples: str = DEFAULT_EMPTY_SAMPLES,
    bounds: list | None = None,
) -> torch.Tensor:
    """``d[i]`` (float64) of local samples with counts ``M[i]``, from the step totals ``spec`` reads
    (:func:`lossagg.totals.read_totals`: under ``empty_samples="skip"`` its ``num_samples`` is
    ``c(N')`` and its ``num_groups`` ``c(P')``), checked."""
    check_divisor(spec, divisor)
    # named in an error as the user knows them: the totals gathered (or given to from_totals)
    inputs = {stand_in(name, empty_samples): read[name] for name in spec.totals if isinstance(read[name], (int, float))}
    if spec.needs_divisor:
        inputs["divisor"] = divisor
    d = spec.denoms(DenomInputs(token_counts.to(torch.float64), read, None if divisor is None else float(divisor)))
    return check_denoms(d, f"mode={spec.name}", tuple(token_counts.shape), inputs, token_counts.device, bounds)


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_denoms(
    d, what: str, shape: tuple[int, ...], inputs: Mapping[str, object] = MappingProxyType({}), device=None, bounds: list | None = None
) -> torch.Tensor:
    """``d[i]`` as a mode (``what``) built it, checked before any op sees it; float64.

    A real floating tensor of ``shape`` holding data (not meta) on ``device`` (when given),
    every entry finite and > 0. ``inputs`` are the settings and totals it was made of, named in
    the message when an entry overflows float64 or is not > 0, so the error points at the
    number the user gave rather than at the op's ``sample_denoms``. ``bounds`` (a list), when given,
    receives the smallest and the largest entry of a ``d`` that passes (read here anyway).
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
        lo, hi = lo.item(), hi.item()
        if lo > 0 and hi < math.inf:
            if bounds is not None:  # read here anyway: the plan's kernel tables need them (lossagg.micro_batch.term_tables)
                bounds[:] = [lo, hi]
            return d
    else:
        if bounds is not None:
            bounds[:] = [math.inf, -math.inf]
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
