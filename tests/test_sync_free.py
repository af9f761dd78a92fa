"""The CPU half of benchmarks/sync_check.py (its GPU half runs under torch.cuda.set_sync_debug_mode("error") in
benchmarks/gpu_check.sh): once a StepPlan is built, a micro-batch's ``plan.micro_batch``, ``plan.loss`` and
backward issue no read of a tensor's value by the host and no op whose output size depends on the data, in
every mode, packed and padded, with a second term; the recorder itself sees such reads."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import sync_check  # noqa: E402

import lossagg  # noqa: E402


def test_the_recorder_sees_host_reads_and_data_sized_ops():
    reads = sync_check.HostReads()
    with reads:
        x = torch.arange(6.0)
        float(x.sum())
        torch.nonzero(x > 2)
        bool((x > 1).any())
    found = " ".join(reads.found)
    assert "_local_scalar_dense" in found and "nonzero" in found and sum(reads.found.values()) == 3


@pytest.mark.parametrize("mode", list(lossagg.MODES))
def test_a_micro_batch_reads_nothing_back_once_the_plan_is_built(mode):
    found = sync_check.check_modes("cpu", [mode])
    assert found == {(mode, "packed"): [], (mode, "padded"): []}, found


def test_the_plan_reads_its_tables_when_it_is_built():
    """The kernels' tables of every term are made (and checked) when the plan is built, not at its first micro-batch."""
    counts = torch.tensor([3.0, 0.0, 5.0])
    reads = sync_check.HostReads()
    with reads:
        plan = lossagg.StepPlan(lossagg.LossAggregationConfig(mode="sample_mean", terms={"kl": {"coefficient": 0.1, "mode": "token_mean"}}), counts)
    assert reads.found  # the checks of d[i] read their extremes here
    assert set(plan.term_denoms) == {"pg", "kl"} and torch.float32 in plan._kernel_tables
