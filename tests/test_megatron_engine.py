"""lossagg.integrations.megatron driven by the real Megatron-Core (0.19.2) on CPU.

Each world (DP x CP in {1, 2}^2, gloo) runs Megatron's own pieces: ``parallel_state``,
a ``TransformerConfig`` with ``calculate_per_token_loss`` off and on, Megatron's
``DistributedDataParallel`` (with and without overlapped gradient reduction),
``get_forward_backward_func()`` (the no-pipelining schedule) over several micro-batches
and ``finalize_model_grads``. The loss function is ``make_loss_func`` on a ``StepPlan``
built by its all-reduce and by ``from_totals``, on packed (THD, zigzag CP shards) and
padded micro-batches, for every registered mode. Each rank's ``param.main_grad`` must
equal the gradient of the reference J (float64) to 1e-10 relative.

Three CUDA calls Megatron makes have CPU stand-ins, each allowed only from the one file
that makes it and failing the test if anything else calls it:
``torch.cuda.current_device`` (grad buffer allocation, param_and_grad_buffer.py),
``torch.cuda.current_stream`` (waits on CUDA-graph events, none on CPU;
param_and_grad_buffer.py) and ``torch.zeros(..., device="cuda")`` for the token total in
schedules.py (replaced by a CPU tensor through that module's own ``torch`` name only).

Skipped, with the reason, when megatron-core cannot be imported (scripts/install_peers.sh
installs it).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from batches import engine_modes, per_prompt, sessions_in
from stand_ins import install_megatron_core_stand_ins
from tiers import full_tier
from worlds import crashed, join, leave, run_world

import lossagg

try:
    import megatron.core  # noqa: F401

    HAVE_MCORE, WHY = True, ""
except Exception as exc:  # pragma: no cover - depends on the environment
    HAVE_MCORE, WHY = False, f"megatron-core not importable ({type(exc).__name__}: {exc}); scripts/install_peers.sh installs it"

# the multi-process engine tests share one xdist worker (scripts/test.sh runs pytest -n 2)
pytestmark = [pytest.mark.skipif(not HAVE_MCORE, reason=WHY), pytest.mark.xdist_group("engines")]

N_PER_PROMPT, PROMPTS, MICRO_BATCHES, FEATURES = 2, 4, 2, 5


# ----------------------------------------------------------------------- stand-ins
def _caller_file(depth: int = 2) -> str:
    return sys._getframe(depth).f_code.co_filename.replace(os.sep, "/")


def install_stand_ins():
    """The three narrow CUDA stand-ins (see the module docstring); returns their use counts."""
    return install_megatron_core_stand_ins()


def run_schedule(mc, forward_step, batches, model, num_micro_batches: int) -> None:
    """Megatron's schedule (``mc`` from :func:`enter_megatron`) over ``batches``, one forward_step per micro-batch."""
    mc.get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=model,
        num_microbatches=num_micro_batches,
        seq_length=1,
        micro_batch_size=1,
        forward_only=False,
    )


def enter_megatron(cp: int):
    """A worker's entry into Megatron-Core: the stand-ins, then the model-parallel state of TP 1 x PP 1 x CP ``cp``.
    Returns (the stand-ins' use counts, a namespace of the modules' names the workers use)."""
    used = install_stand_ins()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=cp)
    return used, SimpleNamespace(
        parallel_state=parallel_state,
        DistributedDataParallel=DistributedDataParallel,
        DistributedDataParallelConfig=DistributedDataParallelConfig,
        finalize_model_grads=finalize_model_grads,
        get_forward_backward_func=get_forward_backward_func,
        TransformerConfig=TransformerConfig,
    )


# ------------------------------------------------------------------------- the step
def make_step(seed=0):
    g = torch.Generator().manual_seed(seed)
    n = PROMPTS * N_PER_PROMPT
    lengths = torch.randint(1, 14, (n,), generator=g)
    lengths[3] = 0  # an empty sample
    cu = lossagg.cu_seqlens_from_lengths(lengths, dtype=torch.int64)
    features = torch.randn(int(cu[-1]), FEATURES, generator=g, dtype=torch.float64)
    mask = torch.rand(int(cu[-1]), generator=g) < 0.8
    mask[cu[5] : cu[6]] = False  # a fully masked sample
    groups = torch.arange(n) // N_PER_PROMPT
    return lengths, cu, features, mask, groups


class TinyModel(torch.nn.Module):
    """A per-token loss model: -logsigmoid(w . x + b)."""

    def __init__(self, config):
        super().__init__()
        from megatron.core.enums import ModelType

        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.proj = torch.nn.Linear(FEATURES, 1, dtype=torch.float64)
        with torch.no_grad():
            g = torch.Generator().manual_seed(7)
            self.proj.weight.copy_(torch.randn(1, FEATURES, generator=g, dtype=torch.float64))
            self.proj.bias.fill_(0.1)

    def set_input_tensor(self, input_tensor):
        """Megatron's schedule hands pipeline inputs here; one stage, so nothing comes."""

    def forward(self, x):
        return -torch.nn.functional.logsigmoid(self.proj(x).squeeze(-1))


def reference_grads(config, step):
    from lossagg.testing import reference_loss

    lengths, cu, features, mask, groups = step
    model = TinyModel(None)
    reference_loss(config, model(features), mask, cu, groups, session_index=sessions_in(groups)).backward()
    return [p.grad.clone() for p in model.parameters()]


def micro_batches(step, own, dp_rank, cp_size, cp_rank, layout):
    """This rank's micro-batches: (local sample positions, per-token inputs, mask, cu_seqlens)."""
    from lossagg import zigzag_local_cu_seqlens, zigzag_shard

    lengths, cu, features, mask, groups = step
    out = []
    for local in torch.tensor_split(torch.arange(own.numel()), MICRO_BATCHES):
        samples = own[local]
        idx = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in samples.tolist()] + [torch.zeros(0, dtype=torch.long)])
        mb_cu = lossagg.cu_seqlens_from_lengths(lengths[samples], dtype=torch.int64)
        if layout == "packed":
            x = zigzag_shard(features[idx].T, mb_cu, cp_size, cp_rank).T
            m = zigzag_shard(mask[idx], mb_cu, cp_size, cp_rank, pad_value=False)
            out.append((local, x, m, zigzag_local_cu_seqlens(mb_cu, cp_size)))
        else:
            # padded rows of the micro-batch's longest sample (rounded to 2 cp), each row
            # sharded along its tokens in the same zigzag layout
            width = max(int(lengths[samples].max()), 1) if samples.numel() else 1
            width = -(-width // (2 * cp_size)) * (2 * cp_size)
            rows_x = torch.zeros(samples.numel(), width, FEATURES, dtype=torch.float64)
            rows_m = torch.zeros(samples.numel(), width, dtype=torch.bool)
            for r, i in enumerate(samples.tolist()):
                n = int(lengths[i])
                rows_x[r, :n] = features[cu[i] : cu[i + 1]]
                rows_m[r, :n] = mask[cu[i] : cu[i + 1]]
            row_cu = torch.arange(samples.numel() + 1, dtype=torch.int64) * width
            x = zigzag_shard(rows_x.reshape(-1, FEATURES).T, row_cu, cp_size, cp_rank).T.reshape(samples.numel(), -1, FEATURES)
            m = zigzag_shard(rows_m.reshape(-1), row_cu, cp_size, cp_rank, pad_value=False).reshape(samples.numel(), -1)
            out.append((local, x, m, None))
    return out


# ------------------------------------------------------------------------ the world
def worker(rank, world, dp, cp, init_file, results_dir):
    failures, ran = join(rank, world, init_file)
    try:
        used, mc = enter_megatron(cp)
        from lossagg import LossAggregationConfig, StepPlan
        from lossagg.integrations.megatron import make_loss_func
        from lossagg.testing import rank_totals

        dp_rank = mc.parallel_state.get_data_parallel_rank()
        cp_rank = mc.parallel_state.get_context_parallel_rank()
        dp_group = mc.parallel_state.get_data_parallel_group()  # same samples on the CP ranks: DP only
        step = make_step()
        lengths, cu, features, mask, groups = step
        n = lengths.numel()
        own = torch.tensor_split(torch.arange(n), dp)[dp_rank]
        all_counts = lossagg.token_counts(mask, cu)

        for mode in engine_modes():
            spec = lossagg.MODES[mode]
            config = LossAggregationConfig(
                mode=mode, n_samples_per_prompt=per_prompt(mode, N_PER_PROMPT), global_batch_size=n, **spec.example_settings
            )
            expected = reference_grads(config, step)
            for per_token in (False, True):
                # two variants per (mode, per_token loss) keep the run short and still pair
                # every plan kind, layout and overlap setting with every mode
                for overlap, plan_kind, layout in ((False, "all_reduce", "packed"), (True, "from_totals", "padded")):
                    if True:
                        if True:
                            if plan_kind == "all_reduce":
                                plan = StepPlan(
                                    config,
                                    all_counts[own],
                                    group_index=groups[own],
                                    session_index=sessions_in(groups)[own],
                                    process_group=dp_group,
                                    num_group_labels=PROMPTS,
                                )
                            else:
                                totals = rank_totals(config, all_counts, own, groups, sessions_in(groups))
                                plan = StepPlan.from_totals(config, all_counts[own], **totals)
                            tconfig = mc.TransformerConfig(
                                num_layers=1,
                                hidden_size=8,
                                num_attention_heads=1,
                                context_parallel_size=cp,
                                calculate_per_token_loss=per_token,
                                params_dtype=torch.float64,
                            )
                            ddp_config = mc.DistributedDataParallelConfig(
                                overlap_grad_reduce=overlap, grad_reduce_in_fp32=False, use_distributed_optimizer=False, bucket_size=None
                            )
                            model = mc.DistributedDataParallel(tconfig, ddp_config, TinyModel(tconfig))
                            tconfig.no_sync_func = model.no_sync
                            tconfig.finalize_model_grads_func = mc.finalize_model_grads
                            model.zero_grad_buffer()
                            batches = micro_batches(step, own, dp_rank, cp, cp_rank, layout)

                            def forward_step(data_iterator, model, plan=plan, per_token=per_token):
                                local, x, m, local_cu = next(data_iterator)
                                loss_func = make_loss_func(
                                    plan,
                                    local,
                                    local_cu,
                                    m,
                                    num_micro_batches=MICRO_BATCHES,
                                    dp_size=dp,
                                    cp_size=cp,
                                    calculate_per_token_loss=per_token,
                                )
                                return model(x), loss_func

                            run_schedule(mc, forward_step, batches, model, MICRO_BATCHES)
                            ran += 1
                            got = [p.main_grad for p in model.module.parameters()]
                            for g, e in zip(got, expected, strict=True):
                                err = float((g - e).abs().max() / e.abs().max().clamp(min=1e-300))
                                if not err <= 1e-10:
                                    failures.append(
                                        f"dp={dp} cp={cp} rank={rank} mode={mode} per_token_loss={per_token} overlap={overlap} "
                                        f"plan={plan_kind} layout={layout}: relative error {err:.3g} (ratio {float((g / e).flatten()[0]):.6g})"
                                    )
        if used["current_device"] == 0 or used["zeros"] == 0:
            failures.append(f"rank {rank}: a stand-in was never used ({used}); the test no longer exercises what it says")
        mc.parallel_state.destroy_model_parallel()
    except Exception as exc:  # reported by the parent with the rank
        failures.append(crashed(f"rank {rank}", exc))
    leave(results_dir, rank, ran, failures)


# the default tier runs one rank and DP x CP; the full tier DP and CP each alone too (tests/tiers.py)
@pytest.mark.parametrize("dp,cp", [(1, 1), pytest.param(2, 1, marks=full_tier), pytest.param(1, 2, marks=full_tier), (2, 2)])
def test_megatron_core_schedule_gives_the_gradient_of_j(dp, cp, tmp_path):
    world = dp * cp
    failures, runs = run_world(worker, world, (dp, cp), tmp_path)
    assert not failures, "\n".join(failures)[:6000]
    assert runs == world * len(engine_modes()) * 2 * 2
