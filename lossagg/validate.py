"""Argument checks shared by every layer that takes a user's data: numbers given as Python,
NumPy or 0-dim tensor values, per-sample token counts and prompt groups, ``cu_seqlens``; each
error names the argument the user typed, what was expected and what came. A leaf: it imports
torch and nothing of lossagg, so the ops, the step totals, the planner and the adapters all
check with it."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch
import torch.distributed as dist


def plain_number(value):
    """A Python number from an int/float, a NumPy scalar or a 0-dim tensor; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex() or value.device.type == "meta":
            return None
        return value.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


#: The largest count accepted: counts and sizes are used in float64, exact up to 2**53.
MAX_INT = 2**53


def as_int(name: str, value, *, minimum: int) -> int:
    """``value`` as an int in ``[minimum, 2**53]`` (Python/NumPy integers and 0-dim integer
    tensors; floats are refused, integral or not: a count is an integer)."""
    plain = plain_number(value)
    if not isinstance(plain, int) or plain < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if plain > MAX_INT:
        raise ValueError(f"{name} must be an integer <= 2**53 (counts are used in float64), got {value!r}")
    return plain


def as_number(name: str, value, *, positive: bool = True) -> float:
    """``value`` as a finite float, > 0 when ``positive`` else >= 0."""
    plain = plain_number(value)
    if isinstance(plain, int) and abs(plain) > MAX_INT:
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'} exact in float64, got {value!r} (an integer beyond 2**53)")
    try:
        plain = None if plain is None else float(plain)
    except OverflowError:  # an int beyond float64
        plain = None
    ok = plain is not None and math.isfinite(plain) and (plain > 0 if positive else plain >= 0)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(plain)


_STRIDED = torch.strided


def check_holds_data(name: str, value) -> None:
    """A tensor argument the code will read (or move): dense and holding data, refused by the user's name
    otherwise (a meta tensor would reach ``.to()`` and fail with torch's "Cannot copy out of meta tensor")."""
    if isinstance(value, torch.Tensor):
        if value.layout is not _STRIDED:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {value.layout}: pass {name}.to_dense()")
        if value.is_meta:
            raise ValueError(f"{name} must hold data (a CPU or CUDA tensor), got a meta tensor")


def as_tensor(name: str, value, *, dims: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.device.type == "meta":
        raise ValueError(f"{name} must hold data (a CPU or CUDA tensor), got a meta tensor")
    if dims is not None and value.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-D tensor, got shape {tuple(value.shape)}")
    return value


def _as_tensor(name: str, value, what: str, device=None) -> torch.Tensor:
    """``value`` as a dense tensor holding data (a meta or sparse tensor is refused by name)."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {value.layout}: pass {name}.to_dense()")
        if value.device.type == "meta":
            raise ValueError(f"{name} must hold data (a CPU or CUDA tensor), got a meta tensor")
        return value if device is None else value.to(device)
    try:
        return torch.as_tensor(value, device=device)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}") from None


def check_token_counts(token_counts, name: str = "token_counts") -> torch.Tensor:
    """Per-sample token counts as a float64 ``[N]`` tensor; real, finite and >= 0 (``name`` is the user's argument)."""
    counts = _as_tensor(name, token_counts, "a 1-D tensor of per-sample token counts")
    if counts.is_complex() or counts.dtype == torch.bool:
        raise TypeError(f"{name} must hold real numbers (token counts), got dtype {counts.dtype}")
    if counts.dim() != 1:
        raise ValueError(f"{name} must be a 1-D [N] tensor of per-sample token counts, got shape {tuple(counts.shape)}")
    if counts.device.type == "meta":
        raise ValueError(f"{name} must hold data (a CPU or CUDA tensor), got a meta tensor")
    if counts.is_floating_point() and not torch.isfinite(counts).all():
        raise ValueError(f"{name} must be finite")
    if counts.numel() and counts.min().item() < 0:
        raise ValueError(f"{name} must be >= 0, got a minimum of {counts.min().item()!r}")
    return counts.to(torch.float64)


def check_group_index(group_index, num_samples: int, device=None, mode: str = "prompt_mean") -> torch.Tensor:
    """``group_index`` validated: present (required by modes with prompt groups), one integer per sample."""
    if group_index is None:
        raise ValueError(
            f"group_index is required under mode={mode}: every sample needs the index of its prompt group "
            "(samples without one are never grouped silently)"
        )
    group_index = _as_tensor(
        "group_index", group_index, "a 1-D tensor of integer prompt-group indices (map prompt ids such as strings to integers first)", device
    )
    if group_index.dim() != 1 or group_index.shape[0] != num_samples:
        raise ValueError(f"group_index must be a 1-D tensor with one entry per sample (N = {num_samples}), got shape {tuple(group_index.shape)}")
    if group_index.is_floating_point() or group_index.is_complex() or group_index.dtype == torch.bool:
        raise TypeError(f"group_index must hold integers, got dtype {group_index.dtype}")
    return group_index


def check_session_index(session_index, num_samples: int, device=None, mode: str = "session_mean") -> torch.Tensor:
    """``session_index`` validated: present (required by modes with sessions), one integer per sample."""
    if session_index is None:
        raise ValueError(
            f"session_index is required under mode={mode}: every sample needs the index of its session (the trajectory it "
            "belongs to: slime's rollout_id, a multi-turn episode's id; docs/modes.md, 'Sessions')"
        )
    session_index = _as_tensor("session_index", session_index, "a 1-D tensor of integer session indices (map session ids to integers first)", device)
    if session_index.dim() != 1 or session_index.shape[0] != num_samples:
        raise ValueError(f"session_index must be a 1-D tensor with one entry per sample (N = {num_samples}), got shape {tuple(session_index.shape)}")
    if session_index.is_floating_point() or session_index.is_complex() or session_index.dtype == torch.bool:
        raise TypeError(f"session_index must hold integers, got dtype {session_index.dtype}")
    return session_index


def check_group_sizes(labels: torch.Tensor, sizes: torch.Tensor, n_samples_per_prompt: int | None) -> None:
    """Every group present in the step holds exactly ``n_samples_per_prompt`` samples."""
    if n_samples_per_prompt is None:
        return
    wrong = (sizes > 0) & (sizes != n_samples_per_prompt)
    if wrong.any():
        first = int(torch.nonzero(wrong)[0, 0])
        raise ValueError(
            f"prompt_mean needs whole prompt groups of n_samples_per_prompt = {n_samples_per_prompt} samples in "
            f"the step; group {int(labels[first])} has {int(sizes[first])} sample(s) "
            f"({int(wrong.sum())} group(s) of the wrong size)"
        )


def _first(bad: torch.Tensor, mask: torch.Tensor):
    if not bool(bad.any()):
        return None
    return mask[bad][0].item(), tuple(torch.nonzero(bad)[0].tolist())


def zero_one_violation(mask: torch.Tensor):
    """The first entry of ``mask`` that is neither 0 nor 1, as ``(value, index)``, or None: the
    check of every adapter whose trainer divides by a mask's sum where lossagg counts its
    non-zero entries (the two agree for a 0/1 mask only). Reads the mask (a host sync on an
    accelerator, none for a bool mask)."""
    if mask.dtype == torch.bool:
        return None
    return _first((mask != 0) & (mask != 1), mask)


def weight_violation(mask: torch.Tensor):
    """The first entry of ``mask`` that is not a finite weight >= 0, as ``(value, index)``, or None:
    the check of every adapter whose trainer multiplies each token's loss by its mask entry
    (lossagg's step totals are sums of non-negative counts). NaN and inf are refused."""
    if mask.dtype == torch.bool or not (mask.is_floating_point() or mask.is_signed()):
        return None
    bad = ~(mask >= 0)  # NaN fails the comparison too
    if mask.is_floating_point():
        bad |= torch.isinf(mask)
    return _first(bad, mask)


def check_cu_seqlens(cu_seqlens, num_tokens: int | None = None, *, name: str = "cu_seqlens") -> torch.Tensor:
    """``cu_seqlens`` validated for the Python helpers: a 1-D integer tensor starting at 0,
    non-decreasing, ending at ``num_tokens`` when given. Reads the data (a host sync on CUDA)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D int32/int64 tensor [B+1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be a 1-D [B+1] tensor with at least one element, got shape {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(cu_seqlens[0])}")
    steps = cu_seqlens[1:] - cu_seqlens[:-1]
    if steps.numel() and int(steps.min()) < 0:
        i = int(torch.nonzero(steps < 0)[0, 0]) + 1
        raise ValueError(f"{name} must be non-decreasing, got {name}[{i}] = {int(cu_seqlens[i])} < {name}[{i - 1}] = {int(cu_seqlens[i - 1])}")
    if num_tokens is not None and int(cu_seqlens[-1]) != num_tokens:
        raise ValueError(f"{name}[-1] must equal the number of tokens T = {num_tokens}, got {int(cu_seqlens[-1])}")
    return cu_seqlens


def check_sample_weights(weights, weightings: Mapping[str, str], n: int, device, owner: str = "StepPlan") -> torch.Tensor | None:
    """The samples' weights as float64 ``[n]`` on ``device``, checked: given exactly when a term of
    the config uses them (``weightings``: each term's weighting by name), one per sample, finite,
    and not asking for a gradient (docs/terms.md, "Per-sample weights")."""
    users = [name for name, w in weightings.items() if w != "none"]
    if weights is None:
        if users:
            raise ValueError(f"the term(s) {', '.join(users)} weigh the samples (weighting={weightings[users[0]]}): pass sample_weights= to {owner}")
        return None
    if not users:
        raise ValueError("sample_weights were given, but no term of the config uses them: set weighting for the PG term or a term (docs/terms.md)")
    check_holds_data("sample_weights", weights)
    if not isinstance(weights, torch.Tensor) or not weights.is_floating_point() or weights.dim() != 1 or weights.shape[0] != n:
        got = f"{weights.dtype} tensor of shape {tuple(weights.shape)}" if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise ValueError(f"sample_weights must be a floating 1-D tensor with one weight per sample of this rank ({n}), got a {got}")
    if weights.requires_grad:
        raise ValueError(
            "sample_weights require grad, but the loss is not differentiable in them (they scale the samples' numerators and "
            "their sum is a step total): pass sample_weights.detach()"
        )
    w = weights.to(device=device, dtype=torch.float64)
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"sample_weights[{i}] is {float(w[i])!r}: every weight must be finite")
    return w


def check_process_group(group, name: str, what: str):
    """``group`` as given (None: one rank), checked: a process group of an initialised
    ``torch.distributed`` (``what`` it is, for the message); errors name the argument as the
    caller's signature spells it (``name``)."""
    if group is None:
        return None
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed process group ({what}) or None, got {type(group).__name__} {group!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{name} was given but torch.distributed is not initialised: call torch.distributed.init_process_group first, or pass None")
    return group
