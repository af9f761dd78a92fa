"""lossagg: exact, split-invariant aggregation of per-token policy-gradient losses."""

from lossagg._native import built_with_cuda, device_checks_enabled, set_device_checks
from lossagg.aggregate import aggregate, step_denoms, token_counts
from lossagg.config import (
    AggregationMode,
    ConfigError,
    LossAggregationConfig,
    add_loss_aggregation_args,
    config_from_args,
)
from lossagg.denominators import prompt_mask_sums, sample_denoms
from lossagg.ops import reduce, segment_sum
from lossagg.step import (
    StepPlan,
    StepTotals,
    gradient_scale,
    zigzag_local_cu_seqlens,
    zigzag_positions,
    zigzag_shard,
)

__version__ = "0.1.0"

__all__ = [
    "AggregationMode",
    "ConfigError",
    "LossAggregationConfig",
    "StepPlan",
    "StepTotals",
    "add_loss_aggregation_args",
    "aggregate",
    "built_with_cuda",
    "config_from_args",
    "device_checks_enabled",
    "gradient_scale",
    "prompt_mask_sums",
    "reduce",
    "sample_denoms",
    "segment_sum",
    "set_device_checks",
    "step_denoms",
    "token_counts",
    "zigzag_local_cu_seqlens",
    "zigzag_positions",
    "zigzag_shard",
]
