"""torch DDP and FSDP2 for real: 4 gloo processes (DP 2 x CP 2), gradient accumulation
over 3 micro-batches with the engines' own sync switches (``no_sync`` /
``set_requires_gradient_sync``), ``lossagg.gradient_scale("mean", ...)`` as the docs say;
the gradients each engine leaves equal J's (float64) for every registered mode.

The recipe is examples/torch_engines.py, run here as it is."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from batches import engine_modes, per_prompt, sessions_in
from worlds import crashed, leave, run_world

import lossagg

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import torch_engines  # noqa: E402

DP, CP, MICRO_BATCHES = 2, 2, 3
# the multi-process engine tests share one xdist worker (scripts/test.sh runs pytest -n 2)
pytestmark = pytest.mark.xdist_group("engines")


def worker(rank, world, engine, init_file, results_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    failures, ran = [], 0
    try:
        for mode in engine_modes():
            spec = lossagg.MODES[mode]
            config = lossagg.LossAggregationConfig(mode=mode, n_samples_per_prompt=per_prompt(mode, 4), **spec.example_settings)
            step = torch_engines.make_step(n_per_prompt=4)
            # sessions of two samples in each group of four (docs/modes.md, "Sessions"), read by the session modes
            grads, expected = torch_engines.run_rank(engine, config, DP, CP, MICRO_BATCHES, rank, step, sessions_in(step[4]))
            ran += 1
            for g, e in zip(grads, expected, strict=True):
                err = float((g - e).abs().max() / e.abs().max().clamp(min=1e-300))
                if not err <= 1e-10:
                    failures.append(f"{engine} rank {rank} mode {mode}: relative error {err:.3g}")
    except Exception as exc:
        failures.append(crashed(f"{engine} rank {rank}", exc))
    leave(results_dir, rank, ran, failures)


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_engine_leaves_the_gradient_of_j(engine, tmp_path):
    world = DP * CP
    failures, runs = run_world(worker, world, (engine,), tmp_path)
    assert not failures, "\n".join(failures)[:6000]
    assert runs == world * len(engine_modes())
