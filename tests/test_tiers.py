"""tests/tiers.py: the default tier's grids cover every pair of values of any two axes, deterministically."""

from __future__ import annotations

import itertools

import pytest
from tiers import covering_pairs, grid


@pytest.mark.parametrize("sizes", [(2, 2, 2), (9, 4, 3), (3, 3, 3, 3), (9, 2, 5, 2), (1, 4, 3)])
def test_every_pair_of_values_is_covered(sizes):
    axes = [list(range(n)) for n in sizes]
    rows = covering_pairs(axes)
    for i, j in itertools.combinations(range(len(sizes)), 2):
        seen = {(r[i], r[j]) for r in rows}
        assert seen == set(itertools.product(range(sizes[i]), range(sizes[j]))), (i, j)
    assert len(rows) <= max(a * b for a, b in itertools.combinations(sizes, 2)) + max(sizes)  # far below the product
    assert rows == covering_pairs(axes)  # the same cases on every run


def test_grid_keeps_a_params_marks_and_id():
    marked = pytest.param("cuda", marks=pytest.mark.skip(reason="x"), id="gpu")
    cases = grid(["cpu", marked], ["a", "b"], [1, 2])
    gpu = [c for c in cases if c.values[0] == "cuda"]
    assert gpu and all(c.id.startswith("gpu-") and c.marks for c in gpu)
    assert {(c.values[0], c.values[2]) for c in cases} == {("cpu", 1), ("cpu", 2), ("cuda", 1), ("cuda", 2)}
