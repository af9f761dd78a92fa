"""lossagg.DeferredPlan in gloo worlds of DP 2 x CP 2 with micro-batches, a filter inside the loss
(tests/filtered_step.py), for every mode the registry says a deferred plan serves:

* ``sum``: the contributions backpropagated as they are, gradients summed over the ranks by hand;
* torch DDP and FSDP2 (their sync switches, ``gradient_scale("mean")``), the rescale applied to the
  module (FSDP2: its sharded DTensor gradients);
* megatron-core's schedule and DDP, through ``make_loss_func(..., keep=...)``, the rescale applied
  to Megatron's gradient buffers.

Each gives the float64 gradient of the filtered unsplit step to 1e-10 relative, with one sum
all-reduce over the DP group at ``close()`` (counted).
"""

from __future__ import annotations

import contextlib
import importlib.util

import filtered_step
import pytest
import torch
import torch.distributed as dist
import torch_engines
import worlds
from batches import engine_modes, per_prompt, sessions_in
from tiers import full_tier
from worlds import crashed, dp_cp_groups, join, leave, run_world

import lossagg
from lossagg.deferred import deferred_factors

DP, CP, MICRO_BATCHES = 2, 2, 2
# the multi-process engine tests share one xdist worker (scripts/test.sh runs pytest -n 2)
pytestmark = pytest.mark.xdist_group("engines")


def _servable():
    out = []
    for mode in engine_modes():
        spec = lossagg.MODES[mode]
        try:
            deferred_factors(spec)
        except ValueError:
            continue
        out.append(mode)
    return out


def _groups(rank):
    """(the DP group of this rank, its CP group)"""
    return dp_cp_groups(rank, DP, CP)[2:]


def deferred_plan(config, own, groups, dp_group, cp_group, **more) -> lossagg.DeferredPlan:
    """The DeferredPlan of a rank holding the samples ``own`` of a step with four prompt groups."""
    return lossagg.DeferredPlan(config, own.numel(), process_group=dp_group, cp_group=cp_group, group_index=groups[own], num_group_labels=4, **more)


def _relative(got, want):
    return max(float((g - e).abs().max() / e.abs().max().clamp(min=1e-300)) for g, e in zip(got, want, strict=True))


class _Counting:
    """Counts the all-reduces made while it is active, by group."""

    def __init__(self):
        self.calls = []
        self._real = dist.all_reduce

    def __enter__(self):
        def counting(tensor, op=dist.ReduceOp.SUM, group=None, **kwargs):
            self.calls.append((str(op), group))
            return self._real(tensor, op=op, group=group, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real


def torch_worker(rank, world, engine, init_file, results_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    failures, ran = [], 0
    try:
        dp_group, cp_group = _groups(rank)
        for mode in _servable():
            spec = lossagg.MODES[mode]
            for empty in ("count", "skip"):
                config = lossagg.LossAggregationConfig(
                    mode=mode, n_samples_per_prompt=per_prompt(mode, 4), empty_samples=empty, **spec.example_settings
                )
                step = torch_engines.make_step(n_per_prompt=4, seed=1)
                features, targets, mask, cu, groups = step
                want, want_j, final = filtered_step.reference(config, step)
                dp_rank, cp_rank, own, batches = filtered_step.rank_share(step, DP, CP, MICRO_BATCHES, rank)
                sessions = {"session_index": sessions_in(groups)[own], "num_session_labels": 8}  # two per group (docs/modes.md, "Sessions")
                # the rollout plan as the estimate: the rescale is then the ratio of the filtered totals to the rollout ones
                rollout = lossagg.StepPlan(
                    config, lossagg.token_counts(mask, cu)[own], group_index=groups[own], process_group=dp_group, num_group_labels=4, **sessions
                )
                plan = deferred_plan(config, own, groups, dp_group, cp_group, estimate=rollout, **sessions)
                model = torch_engines.make_model() if engine == "sum" else torch_engines.wrap(torch_engines.make_model(), engine)
                scale = 1.0 if engine == "sum" else lossagg.gradient_scale("mean", dp_size=DP, cp_size=CP)
                for i, (samples, x, y, m, local_cu) in enumerate(batches):
                    last = i == len(batches) - 1
                    sync = contextlib.nullcontext()
                    if engine == "fsdp2":
                        model.set_requires_gradient_sync(last)
                    elif engine == "ddp" and not last:
                        sync = model.no_sync()
                    with sync:
                        loss = torch_engines.per_token_loss(model, x, y)
                        final_mask = filtered_step.keep(loss, m, local_cu, cp_group)
                        (plan.loss(loss, final_mask, samples, local_cu) * scale).backward()
                with _Counting() as counted:
                    closed = plan.close()
                sums = [c for c in counted.calls if c[0] == str(dist.ReduceOp.SUM) and c[1] is dp_group]
                if len(sums) != 1:
                    failures.append(f"{engine} rank {rank} {mode} {empty}: {len(sums)} sum all-reduces over the DP group at close (want 1)")
                if engine == "sum":
                    grads = [p.grad.clone() for p in model.parameters()]
                    for g in grads:
                        dist.all_reduce(g)
                    grads = [g * closed.scale for g in grads]
                else:
                    closed.apply_(model)
                    grads = torch_engines.full_grads(model, engine)
                ran += 1
                err = _relative(grads, want)
                if not err <= 1e-10:
                    failures.append(f"{engine} rank {rank} mode {mode} {empty}: relative error {err:.3g} (scale {closed.scale})")
                if closed.loss is None or abs(closed.loss - want_j) > 1e-10 * max(abs(want_j), 1e-300):
                    failures.append(f"{engine} rank {rank} mode {mode} {empty}: logged J {closed.loss} vs {want_j}")
                final_counts = lossagg.token_counts(final, cu)[own]
                if not torch.equal(closed.plan.token_counts, final_counts.double()):
                    failures.append(f"{engine} rank {rank} mode {mode} {empty}: final counts {closed.plan.token_counts} vs {final_counts}")
    except Exception as exc:
        failures.append(crashed(f"{engine} rank {rank}", exc))
    leave(results_dir, rank, ran, failures)


# DDP's gradient average is the plain sum's divided by the ranks: the default tier runs the sum and FSDP2 (tests/tiers.py)
@pytest.mark.parametrize("engine", ["sum", pytest.param("ddp", marks=full_tier), "fsdp2"])
def test_a_filter_inside_the_loss_gives_the_filtered_steps_gradient(engine, tmp_path):
    world = DP * CP
    failures, runs = run_world(torch_worker, world, (engine,), tmp_path)
    assert not failures, "\n".join(failures)[:6000]
    assert runs == world * len(_servable()) * 2
    assert len(_servable()) == len(engine_modes())  # every mode it runs is a product of factors known in time
    for spec in lossagg.MODES.values():  # and so is every built-in one
        deferred_factors(spec)


# ----------------------------------------------------------------------- megatron-core
# found, not imported: every spawned rank imports this module, and only the Megatron world needs it
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
WHY = "megatron-core not installed (scripts/install_peers.sh installs it)"


class _MegatronModel(torch.nn.Module):
    """torch_engines' model as a Megatron model (its schedule asks for these attributes)."""

    def __init__(self, config):
        super().__init__()
        from megatron.core.enums import ModelType

        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.net = torch_engines.make_model()

    def set_input_tensor(self, input_tensor):
        """One pipeline stage: nothing comes."""

    def forward(self, x):
        return self.net(x).squeeze(-1)


def megatron_worker(rank, world, init_file, results_dir):
    failures, ran = join(rank, world, init_file)
    try:
        from test_megatron_engine import enter_megatron, run_schedule

        used, mc = enter_megatron(CP)
        from lossagg.integrations.megatron import make_loss_func

        dp_group = mc.parallel_state.get_data_parallel_group()
        cp_group = mc.parallel_state.get_context_parallel_group()
        rank_in_world = mc.parallel_state.get_data_parallel_rank() * CP + mc.parallel_state.get_context_parallel_rank()
        for mode in _servable():
            spec = lossagg.MODES[mode]
            config = lossagg.LossAggregationConfig(mode=mode, n_samples_per_prompt=per_prompt(mode, 4), global_batch_size=16, **spec.example_settings)
            step = torch_engines.make_step(n_per_prompt=4, seed=1)
            features, targets, mask, cu, groups = step
            want, _, _ = filtered_step.reference(config, step)
            _, _, own, batches = filtered_step.rank_share(step, DP, CP, MICRO_BATCHES, rank_in_world)
            plan = deferred_plan(config, own, groups, dp_group, cp_group, session_index=sessions_in(groups)[own])  # labels below global_batch_size
            tconfig = mc.TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, context_parallel_size=CP, params_dtype=torch.float64)
            ddp_config = mc.DistributedDataParallelConfig(overlap_grad_reduce=False, grad_reduce_in_fp32=False, use_distributed_optimizer=False)
            model = mc.DistributedDataParallel(tconfig, ddp_config, _MegatronModel(tconfig))
            tconfig.no_sync_func = model.no_sync
            tconfig.finalize_model_grads_func = mc.finalize_model_grads
            model.zero_grad_buffer()

            def forward_step(data_iterator, model, plan=plan):
                samples, x, y, m, local_cu = next(data_iterator)
                loss_func = make_loss_func(
                    plan,
                    samples,
                    local_cu,
                    m,
                    num_micro_batches=MICRO_BATCHES,
                    dp_size=DP,
                    cp_size=CP,
                    keep=lambda out, rollout, local_cu=local_cu: filtered_step.keep(out, rollout, local_cu, cp_group),
                )
                return (model(x) - y) ** 2, loss_func

            run_schedule(mc, forward_step, batches, model, MICRO_BATCHES)
            plan.close().apply_(model)
            ran += 1
            err = _relative([p.main_grad for p in model.module.parameters()], want)
            if not err <= 1e-10:
                failures.append(f"megatron rank {rank} mode {mode}: relative error {err:.3g}")
        if used["current_device"] == 0:
            failures.append(f"rank {rank}: a stand-in was never used ({used})")
        mc.parallel_state.destroy_model_parallel()
    except Exception as exc:
        failures.append(crashed(f"megatron rank {rank}", exc))
    leave(results_dir, rank, ran, failures)


@pytest.mark.skipif(not HAVE_MCORE, reason=WHY)
def test_megatron_schedule_with_a_filter_inside_the_loss(tmp_path):
    world = DP * CP
    failures, runs = run_world(megatron_worker, world, (), tmp_path)
    assert not failures, "\n".join(failures)[:6000]
    assert runs == world * len(_servable())


# ------------------------------------------------------------- the ranks agree on close()
FAULT_TRIALS = 24
FAULTS = ("none", "missing", "idle", "metric", "estimate", "label", "split", "plan_label")
# what the faulty rank's own error names, and what every other rank's names
FAULT_OWN = {
    "missing": "samples never ran a micro-batch",
    "idle": "never ran loss()",
    "metric": "were reported but not declared",
    "estimate": "the ranks planned different steps",
    "label": "session_index must lie in [0, ",
    "split": "has samples on 2 ranks",
    "plan_label": "session_index must lie in [0, ",
}
FAULT_OTHERS = {"estimate": "the ranks planned different steps", "split": "has samples on 2 ranks"}


def fault_worker(rank, world, init_file, results_dir):
    """Every trial: one rank (or none) commits one fault in a step of a DeferredPlan (or a StepPlan) under a session
    mode with a term; each rank records how close() (or the plan) ended and how long it took."""
    import datetime
    import time

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    out = []
    config = lossagg.LossAggregationConfig.from_dict(
        {"mode": "session_token_mean", "terms": {"kl": {"mode": "session_token_mean", "coefficient": 0.1}}}
    )
    try:
        for trial in range(FAULT_TRIALS):
            g = torch.Generator().manual_seed(trial)
            fault = FAULTS[trial % len(FAULTS)]
            faulty = int(torch.randint(0, world, (1,), generator=g))
            mine = fault != "none" and rank == faulty
            # 4 samples in 2 sessions of 2 on every rank, labels 2·rank, 2·rank + 1 of [0, 2·world)
            sessions = torch.tensor([0, 0, 1, 1]) + 2 * rank
            if mine and fault in ("label", "plan_label"):
                sessions = sessions + 2 * world  # outside [0, 2·world)
            if mine and fault == "split":
                sessions = torch.tensor([0, 0, 1, 1]) + 2 * ((rank + 1) % world)  # another rank's sessions
            lengths = torch.randint(1, 5, (4,), generator=g)
            cu = lossagg.cu_seqlens_from_lengths(lengths).long()
            mask = torch.rand(int(cu[-1]), generator=g) < 0.8
            values = {k: torch.randn(int(cu[-1]), generator=g, dtype=torch.float64) for k in ("pg", "kl")}
            start = time.monotonic()
            try:
                if fault == "plan_label":
                    plan = lossagg.StepPlan(
                        config, lossagg.token_counts(mask, cu), session_index=sessions, process_group=dist.group.WORLD, num_session_labels=2 * world
                    )
                    outcome = f"ok {plan.totals.num_sessions}"
                else:
                    estimate = {"num_sessions": 99, "num_samples": 7} if mine and fault == "estimate" else None
                    plan = lossagg.DeferredPlan(
                        config,
                        4,
                        process_group=dist.group.WORLD,
                        session_index=sessions,
                        num_session_labels=2 * world,
                        metrics=["ent"],
                        estimate=estimate,
                    )
                    for i, samples in enumerate((torch.arange(0, 2), torch.arange(2, 4))):
                        if mine and fault == "missing" and i == 0:
                            continue
                        mb = plan.micro_batch(samples, mask, cu, step_layout=True)
                        if not (mine and fault == "idle" and i == 0):
                            plan.loss({k: v[mb.tokens] for k, v in values.items()}, mb)
                        reported = {"ent": values["pg"][mb.tokens]}
                        if mine and fault == "metric":
                            reported["extra"] = values["kl"][mb.tokens]
                        plan.metrics(reported, mb)
                    step = plan.close()
                    outcome = "ok " + repr((step.scale, step.loss, sorted(step.terms.items()), sorted(step.metrics.items())))
            except ValueError as exc:
                outcome = "error " + str(exc).replace("\n", " ")
            out.append(f"{trial} fault={fault} faulty={faulty} seconds={time.monotonic() - start:.2f} {outcome}")
    except Exception as exc:
        import traceback

        out.append(f"CRASH {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(f"{results_dir}/faults{rank}.txt", "w") as f:
        f.write("\n".join(out))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_one_rank_faults_make_every_rank_raise_by_name_within_seconds(world, tmp_path):
    """One rank's fault at a step's close (a sample that never ran, a micro-batch without its loss, a metric not
    declared, another estimate, a session label out of bounds, a session held by two ranks; a StepPlan's label out of
    bounds): every rank raises, the faulty one naming its fault and the others naming it or the rank, within seconds
    (the group's timeout is 60 s); a trial without a fault gives every rank the same step."""
    import tempfile

    worlds.start(fault_worker, (world, tempfile.mktemp(dir=tmp_path), str(tmp_path)), world)
    lines = [(tmp_path / f"faults{r}.txt").read_text().splitlines() for r in range(world)]
    for r in range(world):
        assert not any(line.startswith("CRASH") for line in lines[r]), "\n".join(lines[r])[:4000]
    for trial in range(FAULT_TRIALS):
        rows = [next(line for line in lines[r] if line.startswith(f"{trial} fault=")) for r in range(world)]
        fault, faulty = rows[0].split()[1].split("=")[1], int(rows[0].split()[2].split("=")[1])
        assert all(float(row.split()[3].split("=")[1]) < 5.0 for row in rows), rows
        outcomes = [row.split(" ", 4)[4] for row in rows]
        if fault == "none":
            assert all(o.startswith("ok ") for o in outcomes) and len(set(outcomes)) == 1, rows
            continue
        for r, outcome in enumerate(outcomes):
            assert outcome.startswith("error "), rows
            expected = FAULT_OWN[fault] if r == faulty else FAULT_OTHERS.get(fault, f"another rank (rank {faulty} of the group)")
            assert expected in outcome, (r, expected, rows)
