"""The native ops, in one place: the tests that walk every op read these lists, and
tests/test_ops.py checks them against the schemas the library registers (csrc/ops.cpp)."""

from __future__ import annotations

#: Every op of torch.ops.lossagg.
OPS = (
    "segment_sum",
    "segment_sum_and_count",
    "aggregate",
    "aggregate_planned",
    "reduce",
    "reduce_terms",
    "token_counts",
    "segment_sum_backward",
    "reduce_backward",
    "reduce_terms_backward",
    "plan_totals",
    "plan_layout",
)
#: The ops a gradient is not asked of through opcheck: the backward ops (their own backward is
#: the forward op, checked by gradgradcheck) and the ones that are not differentiable.
NOT_GRADCHECKED = (
    "segment_sum_backward",
    "reduce_backward",
    "reduce_terms_backward",
    "segment_sum_and_count",
    "token_counts",
    "plan_totals",
    "plan_layout",
)
