"""The two test tiers (DEVELOPING.md, "Tests that stay cheap").

* The default tier (``make test``) covers a grid of three or more axes by pairs: every pair of values of
  any two axes occurs in at least one case (a covering array, built greedily and deterministically, so
  the same cases run on every machine). A bug that needs one value of one axis, or one combination of
  two, is met; the full product is left to the full tier.
* The full tier (``LOSSAGG_TEST_TIER=full``, which ``.ci/run`` sets) runs every grid's full product and the
  tests marked ``full_tier`` (the same checks over more worlds or sizes), deselected by default.

``grid(...)`` takes the axes of a ``pytest.mark.parametrize`` whose argument names are the axes', in
order; a value may be a ``pytest.param`` (its marks are kept, its id used).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

TIER = os.environ.get("LOSSAGG_TEST_TIER", "default")
if TIER not in ("default", "full"):
    raise ValueError(f"LOSSAGG_TEST_TIER must be 'default' or 'full', got {TIER!r}")
FULL = TIER == "full"


def _value(v):
    """(values, marks, id) of one axis value, a plain value or a pytest.param of one value."""
    if isinstance(v, type(pytest.param(None))):
        return v.values, list(v.marks), v.id
    return (v,), [], None


def _id(v, k: int) -> str:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return str(v)
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    return f"{type(v).__name__}{k}"


def covering_pairs(axes: list[list]) -> list[tuple[int, ...]]:
    """Indices of rows of the product of ``axes`` such that every pair of values of two axes occurs in
    some row: greedily, the row covering the most pairs not yet covered (the first such in product
    order), until none is left. Deterministic."""
    sizes = [len(a) for a in axes]
    if len(axes) < 3:
        return list(itertools.product(*(range(n) for n in sizes)))
    uncovered = {((i, a), (j, b)) for i, j in itertools.combinations(range(len(axes)), 2) for a in range(sizes[i]) for b in range(sizes[j])}
    candidates = list(itertools.product(*(range(n) for n in sizes)))
    pairs_of = {row: {((i, row[i]), (j, row[j])) for i, j in itertools.combinations(range(len(row)), 2)} for row in candidates}
    rows = []
    while uncovered:
        best = max(candidates, key=lambda row: len(pairs_of[row] & uncovered))
        rows.append(best)
        uncovered -= pairs_of[best]
    return sorted(rows)


def grid(*axes) -> list:
    """The cases of a parametrised grid: the full product in the full tier, a covering of every pair of
    values in the default tier (the product itself for one or two axes)."""
    axes = [list(a) for a in axes]
    rows = itertools.product(*(range(len(a)) for a in axes)) if FULL else covering_pairs(axes)
    cases = []
    for row in rows:
        values, marks, ids = [], [], []
        for axis, k in zip(axes, row, strict=True):
            v, m, i = _value(axis[k])
            values.extend(v)
            marks.extend(m)
            ids.append(i if i is not None else _id(v[0], k))
        cases.append(pytest.param(*values, marks=marks, id="-".join(ids)))
    return cases


#: a test (or case) run in the full tier only: the same check as a default-tier test over more worlds or sizes
full_tier = pytest.mark.full_tier
