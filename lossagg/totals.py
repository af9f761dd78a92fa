"""The step totals a mode's denominators are made of, declared as one table (docs/modes.md, "Step totals").

Each :class:`StepTotal` says what the number is, how a rank computes its share from its own
samples, how ranks combine their shares (``sum`` or ``max``), and how a value handed to
``StepPlan.from_totals`` under the same name is checked against the rank's own data. A mode
lists the totals it needs (``ModeSpec.totals``). This module is also the plan's one place for
them: which totals a plan needs, gathering them and reading them (:func:`plan_totals`: every
``sum`` total in one all-reduce, the ``max`` totals in a second one only when the mode has
any; or, for ``from_totals``, exactly the ones the mode reads, a missing one being a named
error, never a rank-local stand-in; :func:`read_totals`: what the mode's ``d[i]`` reads).

How empty samples (no rollout token) count is the config's ``empty_samples``
(:data:`EMPTY_SAMPLES`, docs/modes.md, "Empty samples"): under ``skip`` a total a mode
declares is gathered as its stand-in (``N`` as ``N'``, ``P`` as ``P'``, :func:`stand_in`)
and read by the mode as ``c(stand-in)`` (:func:`read_as`).

Inside a mode's ``denoms`` the totals are read as attributes (``x.totals.num_samples``);
reading one the mode did not declare is an error, so a mode cannot silently depend on a
number the planner never gathered across ranks.

Importing this module does not import torch (the configuration works without it): the
totals' shares and checks reach torch, and lossagg's argument checks (:mod:`lossagg.validate`,
which import it), through :func:`_torch` and :func:`_checks` when they first run.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from lossagg.messages import did_you_mean

COMBINES = ("sum", "max")
# A bound on the group labels of one step (the all-reduce buffer holds two float64 per label,
# three with empty_samples=skip): 2**24 prompt groups is far beyond any real step and keeps the
# buffer at 256 MiB (384 MiB). The same bound holds the session labels (up to twelve float64 each
# under prompt_session_mean with skip; a step's session labels default to its global_batch_size).
MAX_GROUP_LABELS = 2**24


@dataclass(frozen=True)
class RankShare:
    """What one rank knows of the step: its own samples.

    ``token_counts`` are the rollout token counts ``M[i]`` (float64 ``[n_local]``);
    ``group_dense`` the index of each sample's group label in ``group_labels`` (when the mode
    has prompt groups); ``n_samples_per_prompt`` the group size the config promises;
    ``weights`` the samples' weights when a term is a weighted mean.
    """

    token_counts: Any
    group_labels: Any = None
    group_dense: Any = None
    n_samples_per_prompt: int | None = None
    weights: Any = None  # the samples' weights w_i (float64 [n_local]), for a weighted mean (docs/terms.md)
    session_labels: Any = None  # the session labels (sessions, docs/modes.md "Sessions"), as group_labels
    session_dense: Any = None  # the index of each sample's session label in session_labels
    group_values: Any = None  # each sample's prompt group, as its index in group_labels (int64), for the sessions' groups
    sessions_per_prompt: bool = False  # n_samples_per_prompt counts sessions per group, not samples

    @property
    def num_labels(self) -> int:
        return 0 if self.group_labels is None else int(self.group_labels.numel())

    @property
    def num_session_labels(self) -> int:
        return 0 if self.session_labels is None else int(self.session_labels.numel())


@dataclass(frozen=True)
class StepTotal:
    """One step total: a number (or per-sample values) every rank must agree on."""

    name: str  # attribute of StepTotals and keyword of StepPlan.from_totals
    symbol: str  # as the formulas write it
    combine: str  # "sum" or "max": how the ranks' shares make the step's value
    meaning: str  # one line, for the docs and the errors
    share: Callable[[RankShare], Any]  # the rank's share: a float64 1-D tensor
    value: Callable[[Any, RankShare], Any]  # the step's value from the combined shares
    given: Callable[[Any, RankShare], Any]  # a value handed to from_totals, checked against the rank's own data
    per_group: bool = False  # needs each sample's prompt group
    per_session: bool = False  # needs each sample's session (docs/modes.md, "Sessions")
    per_sample: bool = False  # the value is one entry per local sample (not one number for the step)
    count: bool = True  # a count (of samples, groups, tokens); standing in for another it is read as c(x) = max(x, 1)

    def __post_init__(self):
        if self.combine not in COMBINES:
            raise ValueError(f"StepTotal {self.name!r}: combine must be one of {', '.join(COMBINES)}, got {self.combine!r}")


#: A per-sample total a plan makes when first read (:class:`StepTotals`' ``later``).
LATER = object()


class StepTotals(Mapping):
    """The totals a plan holds, by name; read as attributes (``totals.num_samples``).

    Only the totals the mode declared are here: reading another one raises an error naming it. ``later``, where
    given, makes the values held as :data:`LATER` (a closing plan's per-sample totals) when one is first read.
    """

    def __init__(self, values: Mapping[str, Any], mode: str | None = None, later: Callable[[], Mapping[str, Any]] | None = None):
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_mode", mode)
        object.__setattr__(self, "_later", later)

    def _value(self, name: str):
        values = object.__getattribute__(self, "_values")
        value = values[name]
        if value is LATER:  # made once (a second thread reading meanwhile makes the same values)
            values.update(object.__getattribute__(self, "_later")())
            value = values[name]
        return value

    def __getattr__(self, name: str):
        values = object.__getattribute__(self, "_values")
        if name in values:
            return self._value(name)
        if name.startswith("_") or name not in TOTALS:
            raise AttributeError(name)
        mode = object.__getattribute__(self, "_mode")
        raise AttributeError(
            f"step total {name!r} was not gathered: mode {mode!r} does not list it in its totals "
            f"({', '.join(values) or 'none'}); add it to the mode's ModeSpec.totals"
        )

    def __setattr__(self, name, value):
        raise AttributeError("StepTotals is read-only")

    def __getitem__(self, name: str):
        return self._value(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __reduce__(self):
        """Pickled (and copied) as the values themselves, those left for later made first."""
        return (StepTotals, ({k: self._value(k) for k in self._values}, object.__getattribute__(self, "_mode")))

    def __repr__(self) -> str:
        shown = {k: (v if isinstance(v, (int, float)) else f"<{type(v).__name__}>") for k, v in ((k, self._value(k)) for k in self._values)}
        return f"StepTotals({shown})"


# ------------------------------------------------------------ rank shares and checks
def _torch():
    import torch  # deferred: the configuration imports this module and works without torch

    return torch


def _checks():
    from lossagg import validate  # deferred: it imports torch (see _torch)

    return validate


def _scalar(value) -> Any:
    return _torch().tensor([float(value)], dtype=_torch().float64)


def group_sums(values, group_dense, num_labels: int | None = None):
    """``Σ_{i in g} values[i]`` of every group, float64 ``[num_labels]``, for dense group labels
    ``group_dense`` in ``[0, num_labels)`` (default: one more than the largest). With the token
    counts as values, each group's tokens ``Sg`` (``Sg[g(i)]`` is ``group_sums(counts, dense)[dense]``):
    the one place the planner and the deferred plan compute it."""
    torch = _torch()
    if num_labels is None:
        num_labels = int(group_dense.max()) + 1 if group_dense.numel() else 0
    sums = torch.zeros(num_labels, dtype=torch.float64, device=values.device)
    return sums.index_add_(0, group_dense.to(values.device), values.to(torch.float64))


def _group_sizes(share: RankShare):
    return group_sums(_torch().ones_like(share.token_counts), share.group_dense, share.num_labels)


def _group_token_sums(share: RankShare):
    return group_sums(share.token_counts, share.group_dense, share.num_labels)


def _num_groups(sizes, share: RankShare) -> int:
    if not share.sessions_per_prompt:  # with sessions, n_samples_per_prompt counts a group's sessions (group_sessions checks it)
        _checks().check_group_sizes(share.group_labels, sizes.long(), share.n_samples_per_prompt)
    return int((sizes > 0).sum().item())


def _nonempty(counts):
    """1.0 for each sample with at least one rollout token (a weight sum > 0), else 0.0 (float64)."""
    return (counts > 0).to(_torch().float64)


def _nonempty_group_sizes(share: RankShare):
    return group_sums(_nonempty(share.token_counts), share.group_dense, share.num_labels)


def _weights(share: RankShare):
    if share.weights is None:
        raise ValueError("a weighted mean needs the samples' weights: pass sample_weights= to StepPlan (docs/terms.md, 'Per-sample weights')")
    return share.weights


def _given_weight_total(name: str, what: str, local: Callable[[RankShare], Any], signed: bool) -> Callable[[Any, RankShare], float]:
    def check(value, share: RankShare) -> float:
        number = _checks().as_number(name, value, positive=signed)
        own = float(local(share))
        if not signed and number < own:
            raise ValueError(f"{name} ({what}) must be >= this rank's own {own:g}, got {value!r}")
        return number

    return check


def _given_num_samples(value, share: RankShare) -> int:
    n = share.token_counts.shape[0]
    value = _checks().as_int("num_samples", value, minimum=0)
    if value < n:
        raise ValueError(f"num_samples (N, the step's samples) must be >= this rank's {n} sample(s), got {value}")
    return value


def _given_num_nonempty_samples(value, share: RankShare) -> int:
    own = int(_nonempty(share.token_counts).sum())
    value = _checks().as_int("num_nonempty_samples", value, minimum=0)
    if value < own:
        raise ValueError(
            f"num_nonempty_samples (N', the step's samples with at least one rollout token) must be >= this rank's {own} such sample(s), got {value}"
        )
    return value


def _given_num_nonempty_groups(value, share: RankShare) -> int:
    own = bool(_nonempty(share.token_counts).any())
    return _checks().as_int("num_nonempty_groups", value, minimum=1 if own else 0)


def _given_at_least_local(name: str, what: str, local: Callable[[Any], float]) -> Callable[[Any, RankShare], float]:
    def check(value, share: RankShare) -> float:
        number = _checks().as_number(name, value, positive=False)
        own = local(share.token_counts)
        if number < own:
            raise ValueError(f"{name} ({what}) must be >= this rank's own {own:g}, got {value!r}")
        return number

    return check


def _given_num_groups(value, share: RankShare) -> int:
    return _checks().as_int("num_groups", value, minimum=1 if share.token_counts.shape[0] else 0)


def _given_group_token_sums(value, share: RankShare):
    counts = share.token_counts
    sums = _checks().check_token_counts(value, name="group_token_sums").to(counts.device)
    if sums.shape != counts.shape:
        raise ValueError(f"group_token_sums must have one entry per local sample ({counts.shape[0]}), got shape {tuple(sums.shape)}")
    short = sums < counts
    if bool(short.any()):
        i = int(short.nonzero()[0, 0])
        raise ValueError(
            f"group_token_sums[{i}] (Sg, the tokens of sample {i}'s prompt group) must be >= the sample's own "
            f"{float(counts[i]):g} tokens, got {float(sums[i]):g}"
        )
    return sums


# ------------------------------------------------------------------ sessions
def _session_sums(values, share: RankShare):
    return group_sums(values, share.session_dense, share.num_session_labels)


def _session_groups_share(share: RankShare):
    """Per session label: its samples, its non-empty samples, and the sum and the sum of squares of
    its samples' prompt-group labels ([4 x labels]): summed over the ranks they give each session's
    group and show whether all its samples share one (n·Σg² = (Σg)² exactly when they do)."""
    torch = _torch()
    g = share.group_values.to(torch.float64)
    ones = torch.ones_like(share.token_counts)
    return torch.cat(
        [_session_sums(ones, share), _session_sums(_nonempty(share.token_counts), share), _session_sums(g, share), _session_sums(g * g, share)]
    )


def _group_sessions(x, share: RankShare, nonempty: bool):
    """``Sp[g(i)]`` (or ``Sp'[g(i)]``): the sessions (with a rollout token) in each local sample's
    prompt group, from the summed :func:`_session_groups_share`; a session whose samples lie in
    several prompt groups, and under ``n_samples_per_prompt`` a group without that many sessions,
    are errors naming them."""
    torch = _torch()
    k = share.num_session_labels
    sizes, kept, g1, g2 = (x[j * k : (j + 1) * k] for j in range(4))
    present = sizes > 0
    labels = share.session_labels[present.to(share.session_labels.device)]
    n, s1, s2 = sizes[present].round().long(), g1[present].round().long(), g2[present].round().long()
    # exact in float64 while every Σg² < 2**53: (group labels - 1)² x the largest session's samples
    largest = int(n.max()) if n.numel() else 0
    if (max(share.num_labels, 1) - 1) ** 2 * largest >= 2**53:
        raise ValueError(
            f"session_index: {share.num_labels} group labels and a session of {largest} samples are too many for the exact check that a "
            "session lies in one prompt group (the labels' squares must sum below 2**53): number the groups densely from 0"
        )
    # one group exactly when n | Σg and Σg² = (Σg / n)·Σg (n·Σg² >= (Σg)², equal only for equal labels), in int64
    g = torch.div(s1, n.clamp(min=1), rounding_mode="floor")
    split = (s1 != g * n) | (s2 != g * s1)
    if bool(split.any()):
        j = int(split.nonzero()[0, 0])
        raise ValueError(
            f"session_index: session {int(labels[j])} holds samples of more than one prompt group (group_index): a session "
            "(one trajectory) answers one prompt, so all its samples must carry its group's label"
        )
    groups = g
    per_prompt = share.n_samples_per_prompt
    if per_prompt is not None and groups.numel():
        uniq, sessions = torch.unique(groups, return_counts=True)
        wrong = sessions != per_prompt
        if bool(wrong.any()):
            j = int(wrong.nonzero()[0, 0])
            raise ValueError(
                f"n_samples_per_prompt ({per_prompt}) counts the sessions of each prompt group under a mode with sessions in prompt "
                f"groups; group {int(share.group_labels[int(uniq[j])])} has {int(sessions[j])} session(s) "
                f"({int(wrong.sum())} group(s) of the wrong size)"
            )
    counted = groups[kept[present] > 0] if nonempty else groups
    uniq, sessions = torch.unique(counted, return_counts=True)
    own = share.group_values.to(uniq.device)
    if not uniq.numel():
        return torch.zeros(own.shape, dtype=torch.float64, device=share.token_counts.device)
    at = torch.searchsorted(uniq, own).clamp(max=uniq.numel() - 1)
    hit = uniq[at] == own
    return torch.where(hit, sessions[at], torch.zeros_like(sessions[at])).to(torch.float64).to(share.token_counts.device)


def _given_per_sample(name: str, what: str, own: Callable[[Any], Any], at_least: str, counts_of: bool = False) -> Callable[[Any, RankShare], Any]:
    """A per-sample total handed to from_totals: one entry per local sample, each >= the sample's own share
    (and a whole number when it ``counts_of`` samples or sessions)."""

    def check(value, share: RankShare):
        counts = share.token_counts
        values = _checks().check_token_counts(value, name=name).to(counts.device)
        if values.shape != counts.shape:
            raise ValueError(f"{name} must have one entry per local sample ({counts.shape[0]}), got shape {tuple(values.shape)}")
        if counts_of and bool((values != values.round()).any()):
            i = int((values != values.round()).nonzero()[0, 0])
            raise ValueError(f"{name}[{i}] ({what}) must be a whole number, got {float(values[i]):g}")
        least = own(counts)
        short = values < least
        if bool(short.any()):
            i = int(short.nonzero()[0, 0])
            raise ValueError(f"{name}[{i}] ({what}) must be >= {at_least} ({float(least[i]):g}), got {float(values[i]):g}")
        return values

    return check


def _given_num_sessions(value, share: RankShare) -> int:
    return _checks().as_int("num_sessions", value, minimum=1 if share.token_counts.shape[0] else 0)


def _given_num_nonempty_sessions(value, share: RankShare) -> int:
    own = bool(_nonempty(share.token_counts).any())
    return _checks().as_int("num_nonempty_sessions", value, minimum=1 if own else 0)


def _local_max(counts) -> float:
    return float(counts.max()) if counts.numel() else 0.0


_ENTRIES = (
    StepTotal(
        name="num_samples",
        symbol="N",
        combine="sum",
        meaning="samples in the step (empty ones included)",
        share=lambda s: _scalar(s.token_counts.shape[0]),
        value=lambda x, s: int(round(x.item())),
        given=_given_num_samples,
    ),
    StepTotal(
        name="num_nonempty_samples",
        symbol="N'",
        combine="sum",
        meaning="samples in the step with at least one rollout token",
        share=lambda s: _nonempty(s.token_counts).sum().reshape(1),
        value=lambda x, s: int(round(x.item())),
        given=_given_num_nonempty_samples,
    ),
    StepTotal(
        name="total_tokens",
        symbol="T",
        combine="sum",
        meaning="rollout tokens of the step",
        share=lambda s: s.token_counts.sum().reshape(1),
        value=lambda x, s: float(x.item()),
        given=_given_at_least_local("total_tokens", "T, the step's rollout tokens", lambda c: float(c.sum())),
    ),
    StepTotal(
        name="max_tokens",
        symbol="L_max",
        combine="max",
        meaning="rollout tokens of the step's longest sample",
        share=lambda s: _scalar(_local_max(s.token_counts)),
        value=lambda x, s: float(x.item()),
        given=_given_at_least_local("max_tokens", "L_max, the step's longest rollout", _local_max),
    ),
    StepTotal(
        name="num_groups",
        symbol="P",
        combine="sum",
        meaning="prompt groups present in the step",
        share=_group_sizes,
        value=_num_groups,
        given=_given_num_groups,
        per_group=True,
    ),
    StepTotal(
        name="num_nonempty_groups",
        symbol="P'",
        combine="sum",
        meaning="prompt groups in the step with at least one rollout token",
        share=_nonempty_group_sizes,
        value=lambda x, s: int((x > 0).sum().item()),
        given=_given_num_nonempty_groups,
        per_group=True,
    ),
    StepTotal(
        name="group_token_sums",
        symbol="Sg[g(i)]",
        combine="sum",
        meaning="rollout tokens of each local sample's prompt group",
        share=_group_token_sums,
        value=lambda x, s: x[s.group_dense],
        given=_given_group_token_sums,
        per_group=True,
        per_sample=True,
    ),
    StepTotal(
        name="num_sessions",
        symbol="S",
        combine="sum",
        meaning="sessions (trajectories) present in the step",
        share=lambda s: _session_sums(_torch().ones_like(s.token_counts), s),
        value=lambda x, s: int((x > 0).sum().item()),
        given=_given_num_sessions,
        per_session=True,
    ),
    StepTotal(
        name="num_nonempty_sessions",
        symbol="S'",
        combine="sum",
        meaning="sessions in the step with at least one rollout token",
        share=lambda s: _session_sums(_nonempty(s.token_counts), s),
        value=lambda x, s: int((x > 0).sum().item()),
        given=_given_num_nonempty_sessions,
        per_session=True,
    ),
    StepTotal(
        name="session_sizes",
        symbol="K[s(i)]",
        combine="sum",
        meaning="samples of each local sample's session",
        share=lambda s: _session_sums(_torch().ones_like(s.token_counts), s),
        value=lambda x, s: x[s.session_dense],
        given=_given_per_sample("session_sizes", "K, the samples of the sample's session", lambda c: _torch().ones_like(c), "1", counts_of=True),
        per_session=True,
        per_sample=True,
    ),
    StepTotal(
        name="nonempty_session_sizes",
        symbol="K'[s(i)]",
        combine="sum",
        meaning="samples with at least one rollout token in each local sample's session",
        share=lambda s: _session_sums(_nonempty(s.token_counts), s),
        value=lambda x, s: x[s.session_dense],
        given=_given_per_sample(
            "nonempty_session_sizes", "K', the non-empty samples of the sample's session", _nonempty, "1 for a non-empty sample", counts_of=True
        ),
        per_session=True,
        per_sample=True,
    ),
    StepTotal(
        name="session_token_sums",
        symbol="Ts[s(i)]",
        combine="sum",
        meaning="rollout tokens of each local sample's session",
        share=lambda s: _session_sums(s.token_counts, s),
        value=lambda x, s: x[s.session_dense],
        given=_given_per_sample("session_token_sums", "Ts, the tokens of the sample's session", lambda c: c, "the sample's own tokens"),
        per_session=True,
        per_sample=True,
    ),
    StepTotal(
        name="group_sessions",
        symbol="Sp[g(i)]",
        combine="sum",
        meaning="sessions in each local sample's prompt group",
        share=_session_groups_share,
        value=lambda x, s: _group_sessions(x, s, nonempty=False),
        given=_given_per_sample(
            "group_sessions", "Sp, the sessions of the sample's prompt group", lambda c: _torch().ones_like(c), "1", counts_of=True
        ),
        per_group=True,
        per_session=True,
        per_sample=True,
    ),
    StepTotal(
        name="nonempty_group_sessions",
        symbol="Sp'[g(i)]",
        combine="sum",
        meaning="sessions with at least one rollout token in each local sample's prompt group",
        share=_session_groups_share,
        value=lambda x, s: _group_sessions(x, s, nonempty=True),
        given=_given_per_sample(
            "nonempty_group_sessions",
            "Sp', the non-empty sessions of the sample's prompt group",
            _nonempty,
            "1 for a non-empty sample",
            counts_of=True,
        ),
        per_group=True,
        per_session=True,
        per_sample=True,
    ),
    StepTotal(
        name="weight_sum",
        symbol="W",
        combine="sum",
        meaning="the samples' weights summed over the step (a weighted mean's sample count)",
        share=lambda s: _weights(s).sum().reshape(1),
        value=lambda x, s: float(x.item()),
        given=_given_weight_total("weight_sum", "W, the step's weights summed", lambda s: _weights(s).sum(), signed=True),
        count=False,
    ),
    StepTotal(
        name="nonempty_weight_sum",
        symbol="W'",
        combine="sum",
        meaning="the weights of the step's samples with at least one rollout token, summed",
        share=lambda s: (_weights(s) * _nonempty(s.token_counts)).sum().reshape(1),
        value=lambda x, s: float(x.item()),
        given=_given_weight_total("nonempty_weight_sum", "W', the non-empty samples' weights summed", lambda s: 0.0, signed=True),
        count=False,
    ),
    StepTotal(
        name="abs_weight_sum",
        symbol="W_abs",
        combine="sum",
        meaning="the samples' absolute weights summed over the step",
        share=lambda s: _weights(s).abs().sum().reshape(1),
        value=lambda x, s: float(x.item()),
        given=_given_weight_total("abs_weight_sum", "W_abs, the step's absolute weights summed", lambda s: _weights(s).abs().sum(), signed=False),
        count=False,
    ),
    StepTotal(
        name="nonempty_abs_weight_sum",
        symbol="W'_abs",
        combine="sum",
        meaning="the absolute weights of the step's samples with at least one rollout token, summed",
        share=lambda s: (_weights(s).abs() * _nonempty(s.token_counts)).sum().reshape(1),
        value=lambda x, s: float(x.item()),
        given=_given_weight_total(
            "nonempty_abs_weight_sum",
            "W'_abs, the non-empty samples' absolute weights summed",
            lambda s: (_weights(s).abs() * _nonempty(s.token_counts)).sum(),
            signed=False,
        ),
        count=False,
    ),
)

#: Every step total a mode can declare, by name.
TOTALS: Mapping[str, StepTotal] = MappingProxyType({t.name: t for t in _ENTRIES})

#: How empty samples (samples with no rollout token) count, the config's ``empty_samples``
#: (docs/modes.md, "Empty samples"): for each convention, the totals gathered in place of the
#: ones a mode declares. ``count`` (the default): every sample counts in ``N`` and every group
#: present in ``P``. ``skip``: ``N`` is read as ``c(N')`` and ``P`` as ``c(P')``, so a step's
#: empty samples, and its groups that hold only empty samples, count nowhere.
EMPTY_SAMPLES: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        "count": MappingProxyType({}),
        "skip": MappingProxyType(
            {
                "num_samples": "num_nonempty_samples",
                "num_groups": "num_nonempty_groups",
                "weight_sum": "nonempty_weight_sum",
                "abs_weight_sum": "nonempty_abs_weight_sum",
                "num_sessions": "num_nonempty_sessions",
                "session_sizes": "nonempty_session_sizes",
                "group_sessions": "nonempty_group_sessions",
            }
        ),
    }
)
DEFAULT_EMPTY_SAMPLES = "count"


def stand_in(name: str, empty_samples: str = DEFAULT_EMPTY_SAMPLES) -> str:
    """The total gathered (or asked of ``from_totals``) for a mode that declares ``name``."""
    return EMPTY_SAMPLES[empty_samples].get(name, name)


# ------------------------------------------------------------------ group labels
def needs_groups(names: Iterable[str]) -> bool:
    return any(TOTALS[name].per_group for name in names)


def needs_sessions(names: Iterable[str]) -> bool:
    return any(TOTALS[name].per_session for name in names)


def check_group_label_count(num_labels: int, what: str = "num_group_labels") -> None:
    if num_labels > MAX_GROUP_LABELS:
        raise ValueError(
            f"{what} must be <= {MAX_GROUP_LABELS} (the planner all-reduces a few float64 per label: two per group label, "
            f"three with empty_samples=skip, and up to twelve per session label), got {num_labels}"
        )


# ------------------------------------------------------------ the plan's totals: which, gathered, read
#: Totals every gathered plan holds besides its mode's: ``N`` (the metrics reducer) and ``T``
#: (Megatron's per-token-loss scale); both travel in the one sum all-reduce.
BASE_TOTALS = ("num_samples", "total_tokens")


def mode_totals(totals: Iterable[str], empty_samples: str = DEFAULT_EMPTY_SAMPLES) -> tuple[str, ...]:
    """The totals a mode that declares ``totals`` reads under the ``empty_samples`` convention:
    each replaced by its stand-in (``num_samples`` by ``num_nonempty_samples`` under skip)."""
    return tuple(dict.fromkeys(stand_in(name, empty_samples) for name in totals))


def plan_totals(
    totals: tuple[str, ...],
    samples,
    *,
    mode: str,
    also: tuple[str, ...] = (),
    empty_samples: str = DEFAULT_EMPTY_SAMPLES,
    given: Mapping[str, Any] | None = None,
    n_samples_per_prompt: int | None = None,
    global_batch_size: int | None = None,
    process_group=None,
    extra_sums=None,
    problem: Exception | None = None,
    fingerprint: str = "",
) -> StepTotals:
    """The step totals of a plan whose mode declares ``totals``, for this rank's ``samples`` (a
    :class:`lossagg.samples.RankSamples` with its token counts).

    With ``given`` (a trainer's totals, ``StepPlan.from_totals``) the ones the mode reads under
    ``empty_samples`` are required, and every given one is checked against this rank's own data
    and against the others. Otherwise they are gathered from the rank's share over its
    ``process_group``: the mode's own, their stand-ins, those of ``also`` (the metric reducer's)
    and :data:`BASE_TOTALS`, every ``sum`` total in one float64 all-reduce and the ``max`` totals
    in a second one only when there are any. ``extra_sums`` (a float64 1-D tensor, gathered plans
    only) travels in the same sum all-reduce and is replaced in place by its sum over the ranks
    (lossagg.DeferredPlan's logged values).

    Every rank closes the same step or raises, none waits: a check that fails on one rank only
    (a label out of range, ``problem``: what the caller found this rank lacks) travels inside the
    sum all-reduce as a flag, with a fingerprint of what shapes the buffer (the totals, the label
    bounds, the extra sums and the caller's ``fingerprint``: its terms, metrics, estimate), so every
    rank raises after that one collective, this rank its own error and the others one naming it.
    """
    if given is not None:
        rank = RankShare(samples.token_counts, n_samples_per_prompt=n_samples_per_prompt, weights=samples.sample_weights)
        what = mode if empty_samples == DEFAULT_EMPTY_SAMPLES else f"{mode} with empty_samples={empty_samples}"
        return _given(mode_totals(totals, empty_samples), given, rank, what)
    shaping = {"mode": mode, "n_samples_per_prompt": n_samples_per_prompt, "global_batch_size": global_batch_size, "process_group": process_group}
    try:
        rank = rank_share(totals, samples, **shaping)
    except (TypeError, ValueError) as exc:
        if process_group is None:
            raise
        # the buffer of a rank without samples has the same layout (the label bounds are arguments): sent with the flag
        try:
            rank = rank_share(totals, _without_samples(samples), **shaping)
        except (TypeError, ValueError):
            raise exc from None  # an argument every rank shares (a label bound): refused before any collective
        problem = problem or exc
    # the totals they stand in for are gathered too: P checks the group sizes against n_samples_per_prompt
    names = (*totals, *mode_totals(totals, empty_samples), *also, *mode_totals(also, empty_samples), *BASE_TOTALS)
    return _gather(names, rank, process_group, mode, extra_sums, problem, fingerprint)


def _without_samples(samples):
    """``samples`` with none of its samples (the same label bounds): the layout of its share, for a rank whose own share failed."""
    torch = _torch()
    device = samples.token_counts.device if samples.token_counts is not None else None
    empty = torch.zeros(0, dtype=torch.float64, device=device)
    labels = torch.zeros(0, dtype=torch.int64, device=empty.device)
    return replace(
        samples,
        num_samples=0,
        token_counts=empty,
        group_index=None if samples.group_index is None else labels,
        session_index=None if samples.session_index is None else labels,
        sample_weights=None if samples.sample_weights is None else empty,
    )


def read_totals(totals: tuple[str, ...], plan: Mapping[str, Any], empty_samples: str, mode: str) -> StepTotals:
    """The totals a mode that declares ``totals`` reads from a plan's: under their declared names,
    each the total itself or ``c(x) = max(x, 1)`` of its stand-in (:func:`read_as`). A total
    the plan lacks is an error naming it."""
    missing = [name for name in mode_totals(totals, empty_samples) if name not in plan]
    if missing:
        raise ValueError(f"mode={mode} needs the step total(s) {', '.join(missing)}")
    return StepTotals({name: read_as(name, plan, empty_samples) for name in totals}, mode)


def read_as(name: str, totals: Mapping[str, Any], empty_samples: str = DEFAULT_EMPTY_SAMPLES) -> Any:
    """The value a mode that declares ``name`` reads: the total itself, or its stand-in, a count
    read as ``c(x) = max(x, 1)`` (a step whose samples are all empty has J = 0 whatever N is; a
    count of 0 would make every d[i] 0); a weight sum standing in is read as it is."""
    gathered = stand_in(name, empty_samples)
    value = totals[gathered]
    if gathered == name or not TOTALS[gathered].count:
        return value
    return value.clamp(min=1.0) if TOTALS[gathered].per_sample else max(value, 1)


def rank_share(
    totals: Iterable[str],
    samples,
    *,
    mode: str,
    n_samples_per_prompt: int | None = None,
    global_batch_size: int | None = None,
    process_group=None,
) -> RankShare:
    """This rank's own data for the step totals ``totals``, from its ``samples`` (a
    :class:`lossagg.samples.RankSamples` with its token counts): its counts and, with prompt
    groups, its samples' group labels (the distinct labels it holds; with a process group, labels
    ``0..num_group_labels-1`` shared by every rank, given or ``global_batch_size // n_samples_per_prompt``);
    with sessions, its samples' session labels the same way (with a process group, labels
    ``0..num_session_labels-1``, given or ``global_batch_size``: a step holds at most that many sessions)."""
    totals = tuple(totals)
    groups, sessions = needs_groups(totals), needs_sessions(totals)
    share = RankShare(samples.token_counts, n_samples_per_prompt=n_samples_per_prompt, weights=samples.sample_weights)
    if groups:
        share = _with_groups(share, samples.group_index, mode, process_group, samples.num_group_labels, global_batch_size, n_samples_per_prompt)
    if sessions:
        share = _with_sessions(share, samples.session_index, mode, process_group, samples.num_session_labels, global_batch_size)
        in_groups = any(name in ("group_sessions", "nonempty_group_sessions") for name in totals)
        share = replace(share, group_values=share.group_values if groups else None, sessions_per_prompt=in_groups)
    return share


def _labels(index, what: str, count, process_group, default, default_from: str, counts):
    """(labels, each sample's index among them) of ``index``: its distinct values, or with a process
    group ``0..count-1`` (``count`` given, else ``default``), every value checked to lie there."""
    torch = _torch()
    name = f"num_{what}_labels"
    if count is not None:
        count = int(count)
    if process_group is None:
        labels, dense = torch.unique(index, return_inverse=True)
        return labels, dense
    labels_from = name
    if count is None:
        if default is None:
            raise ValueError(default_from)
        count, labels_from = default
    check_group_label_count(count, labels_from)
    if index.numel() and (index.min() < 0 or index.max() >= count):
        raise ValueError(
            f"{what}_index must lie in [0, {count}) (the global {what} index within the step, the same on every rank), "
            f"got values in [{int(index.min())}, {int(index.max())}]"
        )
    return torch.arange(count, device=counts.device), index.long()


def _with_groups(share: RankShare, group_index, mode, process_group, num_group_labels, global_batch_size, n_samples_per_prompt) -> RankShare:
    counts = share.token_counts
    group_index = _checks().check_group_index(group_index, counts.shape[0], counts.device, mode)
    default = None
    if global_batch_size is not None and n_samples_per_prompt is not None:
        default = (global_batch_size // n_samples_per_prompt, "num_group_labels (global_batch_size // n_samples_per_prompt of the config)")
    labels, dense = _labels(
        group_index,
        "group",
        num_group_labels,
        process_group,
        default,
        f"with a process group, mode={mode} needs the number of group labels in the step: set global_batch_size and "
        "n_samples_per_prompt in the config or pass num_group_labels",
        counts,
    )
    return replace(share, group_labels=labels, group_dense=dense, group_values=dense.long())


def _with_sessions(share: RankShare, session_index, mode, process_group, num_session_labels, global_batch_size) -> RankShare:
    counts = share.token_counts
    session_index = _checks().check_session_index(session_index, counts.shape[0], counts.device, mode)
    default = None if global_batch_size is None else (global_batch_size, "num_session_labels (global_batch_size of the config)")
    labels, dense = _labels(
        session_index,
        "session",
        num_session_labels,
        process_group,
        default,
        f"with a process group, mode={mode} needs the number of session labels in the step: set global_batch_size in the "
        "config or pass num_session_labels",
        counts,
    )
    return replace(share, session_labels=labels, session_dense=dense)


#: The head of every all-reduce that can carry a rank's failure: [ranks that failed, ranks, h, h², Σ (rank + 1) of the
#: failed ones], h a 20-bit fingerprint of the buffer's layout and of what every rank must share. After the sum every
#: rank reads the same head: the ranks agree exactly when ranks · Σh² = (Σh)² (so for every h alike), exact in
#: float64 up to 2**12 ranks.
_HEAD = 5
_TOLD = " (every rank of the process group raises with this one)"


def all_reduce_with_head(buf, group, problem: Exception | None, fingerprint: str, mode) -> Exception | None:
    """Sum ``buf`` (float64, 1-D) over ``group`` in place, behind the head (:data:`_HEAD`) that carries this
    rank's ``problem`` and ``fingerprint``; returns what every rank must raise: this rank's own problem, one
    naming the rank that failed, one saying the ranks differ, or None. Nothing is raised here, so a rank that
    learns of a failure in one group (CP) still carries it into the next (DP)."""
    torch = _torch()
    dist = torch.distributed
    h = float(zlib.crc32(f"{buf.numel()}|{fingerprint}".encode()) & 0xFFFFF)
    failed = problem is not None
    head = torch.tensor([float(failed), 1.0, h, h * h, dist.get_rank(group) + 1.0 if failed else 0.0], dtype=torch.float64, device=buf.device)
    both = torch.cat([head, buf])
    dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
    buf.copy_(both[_HEAD:])
    failed_ranks, ranks, h1, h2, who = (int(round(x)) for x in both[:_HEAD].tolist())
    if problem is not None:
        if _TOLD in str(problem):
            return problem
        try:
            told = type(problem)(f"{problem}{_TOLD}")
        except Exception:  # an exception type that takes other arguments
            told = ValueError(f"{problem}{_TOLD}")
        return told.with_traceback(problem.__traceback__)
    if failed_ranks:
        which = f"rank {who - 1} of the group" if failed_ranks == 1 else f"{failed_ranks} ranks"
        return ValueError(
            f"another rank ({which}) cannot go on with this step (mode={mode}): it raises naming what it found, so no rank takes a "
            "number from this step"
        )
    if ranks * h2 != h1 * h1:
        return ValueError(
            f"the ranks planned different steps (mode={mode}): the config, the label bounds (num_group_labels, num_session_labels), the "
            "declared metrics or the estimate differ between ranks; they must be the same on every rank"
        )
    return None


def _gather(
    names: Iterable[str], share: RankShare, process_group=None, mode: str | None = None, extra_sums=None, problem=None, fingerprint: str = ""
) -> StepTotals:
    """The totals ``names`` of the step: the rank's shares combined over ``process_group``.

    All ``sum`` totals travel in one float64 all-reduce behind the head that carries every rank's
    failure (:func:`all_reduce_with_head`); the ``max`` totals in a second one, only when there are any
    and no rank failed. Without a process group the rank's shares are the step's. ``extra_sums`` rides
    at the end of the sum all-reduce and is summed in place.
    """
    torch = _torch()
    wanted = [TOTALS[name] for name in dict.fromkeys(names)]
    values: dict[str, Any] = {}
    for combine in COMBINES:
        group = [t for t in wanted if t.combine == combine]
        if not group:
            continue
        shares = [t.share(share).to(torch.float64).reshape(-1) for t in group]
        sizes = [piece.numel() for piece in shares]
        if process_group is None:  # the rank's shares are the step's (no buffer to fill)
            if problem is not None:
                raise problem
            buf = torch.cat(shares)
        elif combine == "sum":
            extra = [] if extra_sums is None else [extra_sums.to(device=shares[0].device, dtype=torch.float64)]
            buf = torch.cat(shares + extra)
            layout = f"{mode}|{','.join(t.name for t in wanted)}|{sizes}|{fingerprint}"
            problem = all_reduce_with_head(buf, process_group, problem, layout, mode)
            if problem is not None:
                raise problem
            if extra_sums is not None:
                extra_sums.copy_(buf[sum(sizes) :])
        else:
            buf = torch.cat(shares)
            torch.distributed.all_reduce(buf, op=torch.distributed.ReduceOp.MAX, group=process_group)
        for t, piece in zip(group, buf[: sum(sizes)].split(sizes), strict=True):
            values[t.name] = t.value(piece, share)
    return StepTotals({t.name: values[t.name] for t in wanted}, mode)


def _given(names: Iterable[str], given: Mapping[str, Any], share: RankShare, mode: str | None = None) -> StepTotals:
    """The totals ``names`` from values a trainer already has (``StepPlan.from_totals``).

    Every total the mode needs must be given (a named error otherwise); each is checked
    against the rank's own data and against the others. Totals given but not needed are
    checked too and kept.
    """
    unknown = [k for k in given if k not in TOTALS]
    if unknown:
        raise TypeError(f"unknown step total {unknown[0]!r}{did_you_mean(unknown[0], TOTALS)}; the totals are {', '.join(TOTALS)}")
    wanted = list(dict.fromkeys(names))
    missing = [name for name in wanted if given.get(name) is None]
    if missing:
        described = "; ".join(f"{name} ({TOTALS[name].symbol}, {TOTALS[name].meaning})" for name in missing)
        raise ValueError(f"mode={mode} needs the step total(s) {described}: pass them to from_totals")
    values = {name: TOTALS[name].given(value, share) for name, value in given.items() if value is not None}
    _consistency(values, share.n_samples_per_prompt)
    order = wanted + [name for name in values if name not in wanted]
    return StepTotals({name: values[name] for name in order}, mode)


def _session_consistency(values: Mapping[str, Any], n_samples_per_prompt: int | None) -> None:
    """Session totals handed to from_totals that contradict each other or the step's other totals
    (docs/modes.md, "Sessions")."""
    n, p, s, t = (values.get(k) for k in ("num_samples", "num_groups", "num_sessions", "total_tokens"))
    k_, k_ne, ts = values.get("session_sizes"), values.get("nonempty_session_sizes"), values.get("session_token_sums")
    sp, sp_ne = values.get("group_sessions"), values.get("nonempty_group_sessions")

    def first_above(x, bound, what: str, bound_name: str) -> None:
        if x is not None and bound is not None and x.numel() and bool((x > bound).any()):
            i = int((x > bound).nonzero()[0, 0])
            raise ValueError(f"{what}[{i}] is {float(x[i]):g}, more than {bound_name} {float(bound):g}: a part of the step cannot exceed the whole")

    first_above(k_, n, "session_sizes (K, the samples of a session)", "num_samples (N)")
    first_above(ts, t, "session_token_sums (Ts, the tokens of a session)", "total_tokens (T)")
    first_above(sp, s, "group_sessions (Sp, the sessions of a prompt group)", "num_sessions (S)")
    if k_ is not None and k_ne is not None and bool((k_ne > k_).any()):
        i = int((k_ne > k_).nonzero()[0, 0])
        raise ValueError(f"nonempty_session_sizes[{i}] (K', {float(k_ne[i]):g}) cannot exceed session_sizes[{i}] (K, {float(k_[i]):g})")
    if sp is not None and sp_ne is not None and bool((sp_ne > sp).any()):
        i = int((sp_ne > sp).nonzero()[0, 0])
        raise ValueError(f"nonempty_group_sessions[{i}] (Sp', {float(sp_ne[i]):g}) cannot exceed group_sessions[{i}] (Sp, {float(sp[i]):g})")
    if k_ is not None and s is not None and k_.numel():
        # each session's local samples weigh 1/K each: at most 1 per session, so the sum cannot exceed S (exact in float64 for K < 2**26)
        represented = float((1.0 / k_.double()).sum())
        if represented > s + 1e-9 * max(s, 1):
            raise ValueError(
                f"session_sizes hold {represented:g} sessions' worth of this rank's samples (the sum of 1/K over them), more than num_sessions "
                f"(S, {s}): a session of K samples has at most K of them here"
            )
    if p is not None and s is not None and p > s:
        raise ValueError(f"num_groups (P, {p}) cannot exceed num_sessions (S, {s}): every prompt group holds at least one session")
    if sp is not None and n_samples_per_prompt is not None and sp.numel() and bool((sp != n_samples_per_prompt).any()):
        i = int((sp != n_samples_per_prompt).nonzero()[0, 0])
        raise ValueError(
            f"group_sessions[{i}] (Sp, {float(sp[i]):g}) must equal n_samples_per_prompt ({n_samples_per_prompt}): under a mode with sessions "
            "in prompt groups it counts each group's sessions"
        )
    if sp is not None and n_samples_per_prompt is not None and p is not None and s is not None and s != n_samples_per_prompt * p:
        raise ValueError(
            f"num_sessions (S, {s}) must equal n_samples_per_prompt ({n_samples_per_prompt}) × num_groups (P, {p}) = "
            f"{n_samples_per_prompt * p}: the config promises whole groups of n_samples_per_prompt sessions"
        )


def _consistency(values: Mapping[str, Any], n_samples_per_prompt: int | None) -> None:
    """Totals handed to from_totals that contradict each other."""
    n, p = values.get("num_samples"), values.get("num_groups")
    if n is not None and p is not None:
        if p > n:
            raise ValueError(f"num_groups (P, {p}) cannot exceed num_samples (N, {n}): every group holds at least one sample")
        sessions = values.get("group_sessions", values.get("nonempty_group_sessions"))  # then n_samples_per_prompt counts sessions
        if n_samples_per_prompt is not None and sessions is None and n != n_samples_per_prompt * p:
            raise ValueError(
                f"num_samples (N, {n}) must equal n_samples_per_prompt ({n_samples_per_prompt}) × num_groups (P, {p}) = "
                f"{n_samples_per_prompt * p}: the config promises whole groups of n_samples_per_prompt samples"
            )
    n_ne, p_ne = values.get("num_nonempty_samples"), values.get("num_nonempty_groups")
    if n_ne is not None and n is not None and n_ne > n:
        raise ValueError(f"num_nonempty_samples (N', {n_ne}) cannot exceed num_samples (N, {n}): the non-empty samples are part of the step's")
    if p_ne is not None and p is not None and p_ne > p:
        raise ValueError(f"num_nonempty_groups (P', {p_ne}) cannot exceed num_groups (P, {p}): the non-empty groups are part of the step's")
    if p_ne is not None and n_ne is not None:
        if p_ne > n_ne:
            raise ValueError(
                f"num_nonempty_groups (P', {p_ne}) cannot exceed num_nonempty_samples (N', {n_ne}): every non-empty group holds a non-empty sample"
            )
        if n_ne > 0 and p_ne == 0:
            raise ValueError(f"num_nonempty_groups (P') is 0 but num_nonempty_samples (N') is {n_ne}: a non-empty sample makes its group non-empty")
    s, s_ne = values.get("num_sessions"), values.get("num_nonempty_sessions")
    for count, name, symbol, of, of_name in (
        (s, "num_sessions", "S", n, "num_samples (N"),
        (s_ne, "num_nonempty_sessions", "S'", n_ne, "num_nonempty_samples (N'"),
    ):
        if count is not None and of is not None and count > of:
            raise ValueError(f"{name} ({symbol}, {count}) cannot exceed {of_name}, {of}): every session holds at least one such sample")
    if s is not None and s_ne is not None and s_ne > s:
        raise ValueError(f"num_nonempty_sessions (S', {s_ne}) cannot exceed num_sessions (S, {s}): the non-empty sessions are part of the step's")
    _session_consistency(values, n_samples_per_prompt)
    t, sg, lmax = values.get("total_tokens"), values.get("group_token_sums"), values.get("max_tokens")
    if t is not None and n_ne is not None and (t > 0) != (n_ne > 0):
        raise ValueError(
            f"num_nonempty_samples (N', {n_ne}) and total_tokens (T, {t:g}) disagree: the step has rollout tokens exactly when it has a "
            "non-empty sample"
        )
    if t is not None and sg is not None and sg.numel() and float(sg.max()) > t:
        raise ValueError(f"group_token_sums holds {float(sg.max()):g}, more than total_tokens (T, {t:g}): a group's tokens are part of the step's")
    if t is not None and lmax is not None and lmax > t:
        raise ValueError(f"max_tokens (L_max, {lmax:g}) cannot exceed total_tokens (T, {t:g})")
