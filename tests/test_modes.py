"""The mode registry is the one home of the modes: everything else follows it, and the
renamed public names still work (with a DeprecationWarning)."""

from __future__ import annotations

import types

import pytest
import torch

import lossagg
from lossagg.cli import build_parser
from lossagg.modes import MODE_NAMES, MODES, mode_spec
from lossagg.testing import reference_loss


def test_enum_schema_cli_and_demo_follow_the_registry():
    assert [m.value for m in lossagg.AggregationMode] == list(MODE_NAMES)
    schema = lossagg.LossAggregationConfig.model_json_schema()
    assert schema["$defs"]["AggregationMode"]["enum"] == list(MODE_NAMES)
    demo = build_parser().parse_args(["demo"])
    assert demo.modes == list(MODE_NAMES)


@pytest.mark.parametrize("name", MODE_NAMES)
def test_each_entry_is_complete(name):
    spec = MODES[name]
    assert spec.name == name and spec.summary and spec.formula and spec.denom_formula
    config = lossagg.LossAggregationConfig(mode=name, **spec.example_settings)
    assert config.mode.value == name


def test_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="mode must be one of sample_mean, prompt_mean, token_mean, constant, got 'bogus'"):
        mode_spec("bogus")
    fake_config = types.SimpleNamespace(mode="bogus", divisor=None)
    with pytest.raises(ValueError, match="'bogus'"):
        reference_loss(fake_config, torch.ones(3), torch.ones(3, dtype=torch.bool), torch.tensor([0, 3]))


def test_reference_needs_group_index_under_prompt_mean():
    config = lossagg.LossAggregationConfig(mode="prompt_mean")
    with pytest.raises(ValueError, match="needs group_index"):
        reference_loss(config, torch.ones(3), torch.ones(3, dtype=torch.bool), torch.tensor([0, 3]))


def test_cu_seqlens_from_lengths():
    cu = lossagg.cu_seqlens_from_lengths(torch.tensor([3, 0, 2]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 5]
    assert lossagg.cu_seqlens_from_lengths([], dtype=torch.int64).tolist() == [0]
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        lossagg.cu_seqlens_from_lengths([1, -1])
    with pytest.raises(TypeError, match="lengths must hold integers"):
        lossagg.cu_seqlens_from_lengths(torch.tensor([1.5]))


def test_deprecated_names_still_work():
    counts = torch.tensor([2, 0, 6, 4])
    groups = torch.tensor([0, 0, 1, 1])
    config = lossagg.LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=2)
    plan = lossagg.StepPlan(config, counts, group_index=groups)
    with pytest.warns(DeprecationWarning, match="sample_denoms_for"):
        assert torch.equal(plan.denoms([0, 2]), plan.sample_denoms_for([0, 2]))
    with pytest.warns(DeprecationWarning, match="StepPlan"):
        assert torch.equal(lossagg.sample_denoms("prompt_mean", counts, group_index=groups, n_samples_per_prompt=2), plan.sample_denoms)
    mask = torch.arange(12) < torch.tensor([2, 0, 6, 4]).repeat_interleave(3)
    with pytest.warns(DeprecationWarning, match="StepPlan.from_mask"):
        d = lossagg.step_denoms(lossagg.LossAggregationConfig(), mask.reshape(4, 3))
    assert torch.equal(d, lossagg.StepPlan.from_mask(lossagg.LossAggregationConfig(), mask.reshape(4, 3)).sample_denoms)
    with pytest.warns(DeprecationWarning, match="num_group_labels"):
        lossagg.StepPlan(config, counts, group_index=groups, num_groups=2)


def test_reduce_keywords_and_the_deprecated_positional_order():
    values = torch.randn(5)
    mask = torch.ones(5, dtype=torch.bool)
    cu = torch.tensor([0, 2, 5])
    d = torch.tensor([2.0, 3.0])
    j = lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=d)
    assert torch.equal(j, torch.ops.lossagg.reduce(values, mask, cu, d))
    with pytest.warns(DeprecationWarning, match="by keyword"):
        assert torch.equal(lossagg.reduce(values, mask, d, cu), j)
    with pytest.raises(TypeError, match="sample_denoms"):
        lossagg.reduce(values, mask, cu_seqlens=cu)
