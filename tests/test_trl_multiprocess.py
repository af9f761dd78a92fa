"""The TRL adapter across 2 processes (torch.distributed over gloo, as accelerate sets it up
from RANK / WORLD_SIZE / MASTER_ADDR on a CPU machine), with gradient accumulation 2.

Each process runs a real ``GRPOTrainer.train()`` step on its share of the generation
batch; TRL gathers rewards for the advantages, the adapter gathers token counts for the
step's denominators, DDP averages the gradients over the processes and the loss carries
``* num_processes``. Just before the optimizer, the gradient every process holds must be
the gradient of J (docs/modes.md) over the whole generation batch of both processes: computed
here independently, per process for its own completions (ratio 1 at the first step, so
the per-token loss is ``-A * exp(logp - logp.detach())``) and summed over the processes.
This exercises TRL's number-of-items and DP-averaging conventions instead of assuming them.
With ``entropy_coef``, J has TRL's entropy bonus as the term 'entropy' (token_mean over both
processes' tokens); the same reference with sample_mean in its place is off by ~8e-4 relative.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

import pytest
import torch
import worlds

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

trl = pytest.importorskip("trl", reason="TRL is not importable (scripts/install_peers.sh installs it)")
pytest.importorskip("datasets", reason="datasets (TRL's dependency) is not importable")
pytest.importorskip("tokenizers", reason="tokenizers (transformers' dependency) is not importable")

WORLD, ACCUMULATION = 2, 2
# the multi-process engine tests share one xdist worker (scripts/test.sh runs pytest -n 2)
pytestmark = pytest.mark.xdist_group("engines")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (loss_type, entropy_coef, steps_per_generation): every case runs in one 2-process world, one after the other
CASES = [("prompt_mean", 0.0, 2), ("dapo", 0.0, 2), ("grpo", 0.0, 2), ("grpo", 0.1, 2), ("dapo", 0.1, 4), ("cispo", 0.0, 2), ("luspo", 0.0, 2)]


def case_id(case) -> str:
    return "-".join(map(str, case))


def worker(rank, port, out_dir):
    """Every case of :data:`CASES` on this rank, one trainer after the other in the same process group
    (one spawn and one import of TRL for all of them); each case's result in its own file."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import test_trl_trainer as base
    import torch.distributed as dist
    import transformers

    # the process group made here from a file (no port to race for); accelerate finds it
    # initialised and uses it, with the environment above telling it the ranks
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'init')}", rank=rank, world_size=WORLD)
    from lossagg.integrations.trl import GROUP_KEY, GRPOTrainer
    from lossagg.testing import reference_loss

    def one_case(loss_type, entropy_coef, steps_per_generation):
        result = []

        class Check(transformers.TrainerCallback):
            """At the first optimizer step: the gradient held vs J's gradient, summed over processes."""

            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                if result:
                    return
                trainer = self.trainer
                params = [p for p in trainer.accelerator.unwrap_model(model).parameters() if p.requires_grad]
                held = [p.grad.detach().clone() for p in params]
                # the first optimizer step: TRL's first ACCUMULATION micro-batches of the shuffled generation batch
                # (with steps_per_generation > ACCUMULATION, part of it), each completion tagged with its prompt group
                chunks = trainer._buffered_inputs[:ACCUMULATION]
                keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", GROUP_KEY)
                batch = {key: torch.cat([c[key] for c in chunks]) for key in keys}
                mask = trainer._loss_mask(batch)
                width = base.MAX_COMPLETION
                # every process's completion masks (padded to the same width) for the step totals
                local_mask = torch.zeros(mask.shape[0], width, dtype=mask.dtype)
                local_mask[:, : mask.shape[1]] = mask
                all_masks = [torch.zeros_like(local_mask) for _ in range(WORLD)]
                dist.all_gather(all_masks, local_mask)
                full_mask = torch.cat(all_masks)
                # this process's per-token loss on its own rows, zero elsewhere
                input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
                attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
                logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
                    trainer.accelerator.unwrap_model(model), input_ids, attention, batch["completion_ids"].size(1), compute_entropy=bool(entropy_coef)
                )
                loss = -batch["advantages"].to(torch.float64)[:, None] * torch.exp(logps - logps.detach())
                if loss_type == "cispo":  # CISPO: the ratio (1 here) capped at epsilon_high, a constant weight of the log-probability
                    loss = -min(1.0, trainer.epsilon_high) * batch["advantages"].to(torch.float64)[:, None] * logps
                values = torch.zeros(full_mask.shape, dtype=torch.float64)
                n = mask.shape[0]
                rows = torch.zeros_like(values)
                rows[rank * n : (rank + 1) * n, : mask.shape[1]] = loss
                values = values + rows
                cu = torch.arange(0, full_mask.numel() + 1, width)
                all_groups = [torch.zeros_like(batch[GROUP_KEY]) for _ in range(WORLD)]
                dist.all_gather(all_groups, batch[GROUP_KEY])
                groups = torch.cat(all_groups)
                pg_only = trainer.loss_aggregation.model_copy(update={"terms": {}})  # the reference reduces one term at a time
                j_part = reference_loss(pg_only, values.reshape(-1), full_mask.reshape(-1), cu, groups)
                if entropy_coef:  # the entropy bonus: -entropy_coef times the term 'entropy' on its mode, over both processes' tokens
                    term = trainer.loss_aggregation.terms["entropy"]
                    ent = torch.zeros(full_mask.shape, dtype=torch.float64)
                    ent_rows = torch.zeros_like(ent)
                    ent_rows[rank * n : (rank + 1) * n, : mask.shape[1]] = entropies
                    ent = ent + ent_rows
                    config = pg_only.model_copy(update={"mode": term.mode})
                    j_part = j_part + term.coefficient * reference_loss(config, ent.reshape(-1), full_mask.reshape(-1), cu, groups)
                expected = list(torch.autograd.grad(j_part, params, allow_unused=True))
                expected = [torch.zeros_like(p) if e is None else e for p, e in zip(params, expected, strict=True)]
                for e in expected:
                    dist.all_reduce(e)
                scale = max(float(e.abs().max()) for e in expected)
                err = max(float((h - e).abs().max()) for h, e in zip(held, expected, strict=True)) / max(scale, 1e-300)
                result.append((err, scale, dist.get_world_size(), trainer.accelerator.num_processes))

        check = Check()

        class Recorder(GRPOTrainer):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                check.trainer = self

            def _generate_and_score_completions(self, inputs):
                out = super()._generate_and_score_completions(inputs)
                self.generated = getattr(self, "generated", []) + [out]
                return out

        base.run(
            Recorder,
            loss_type,
            ACCUMULATION,
            Path(out_dir) / f"rank{rank}-run",
            base.make_tokenizer(),
            base.make_dataset(),
            processes=WORLD,
            callbacks=[check],
            **({"entropy_coef": entropy_coef} if entropy_coef else {}),
            **({"steps_per_generation": steps_per_generation} if steps_per_generation != ACCUMULATION else {}),
        )
        return result

    def empty_step():
        """Every completion's loss mask empty on both processes: the step is skipped, the weights stay."""
        before = {n: p.detach().clone() for n, p in base.tiny_model().named_parameters()}
        trainer, grads = base.run(
            base.EmptyStep,
            "dapo",
            ACCUMULATION,
            Path(out_dir) / f"empty-rank{rank}",
            base.make_tokenizer(),
            base.make_dataset(),
            processes=WORLD,
            weight_decay=0.5,
        )
        moved = max(float((p.detach().cpu() - before[n]).abs().max()) for n, p in trainer.model.named_parameters())
        return [trainer.lossagg_skipped_steps, max(float(g.abs().max()) for g in grads.values()), moved]

    def router_loss():
        """The router's auxiliary loss over both processes: doubling its coefficient adds c · aux · tokens / T to each
        micro-batch's loss, T the step's loss tokens on both processes, times the process count (DDP averages)."""

        class Uneven(base.AuxRecorder):
            """Half the tokens of the odd prompt groups' completions out of the loss (the groups as the adapter tags
            them), so that TRL's shuffled micro-batches hold unequal loss tokens."""

            def _loss_mask(self, batch):
                mask = super()._loss_mask(batch)
                if GROUP_KEY not in batch:  # the generation batch before it is tagged: only its size is read
                    return mask
                mask = mask.clone()
                mask[batch[GROUP_KEY] % 2 == 1, mask.shape[1] // 2 :] = 0
                return mask

        runs = {}
        base.tiny_model, plain = base.tiny_moe, base.tiny_model
        try:
            for coef in (0.01, 0.02):
                runs[coef], _ = base.run(
                    Uneven,
                    "dapo",
                    ACCUMULATION,
                    Path(out_dir) / f"aux{coef}-rank{rank}",
                    base.make_tokenizer(),
                    base.make_dataset(),
                    processes=WORLD,
                    router_aux_loss_coef=coef,
                )
        finally:
            base.tiny_model = plain
        a, b = runs[0.01], runs[0.02]
        total = torch.tensor(sum(a.tokens), dtype=torch.float64)
        dist.all_reduce(total)
        off = max(abs(float(b.losses[i] - a.losses[i]) - 0.01 * float(a.aux[i]) * a.tokens[i] / float(total) * WORLD) for i in range(len(a.aux)))
        return [off, len(a.aux), float(total), [t / float(total) for t in a.tokens]]

    special = {"empty-step": empty_step, "router-loss": router_loss}
    for name, run_case in [*((case_id(case), functools.partial(one_case, *case)) for case in CASES), *special.items()]:
        try:
            result = run_case()
        except Exception as e:  # reported per case, the others still run
            result = [repr(e)]
        with open(os.path.join(out_dir, f"{name}-rank{rank}.txt"), "w") as f:
            f.write(repr(result))
        dist.barrier()
    dist.destroy_process_group()
    # skip the interpreter's teardown: with accelerate's and gloo's threads still around it
    # sometimes aborts ("terminate called without an active exception") after the work is
    # done and reported
    os._exit(0)


@pytest.fixture(scope="session")  # once per worker: xdist interleaves files, which would redo a module fixture
def world_results(tmp_path_factory):
    """One 2-process world for every case (the spawn and TRL's import once); the folder of their results."""
    out = str(tmp_path_factory.mktemp("trl-world"))
    worlds.start(worker, (free_port(), out), WORLD)
    return out


@pytest.mark.parametrize(("loss_type", "entropy_coef", "steps_per_generation"), CASES, ids=[case_id(c) for c in CASES])
def test_two_processes_give_the_gradient_of_j(loss_type, entropy_coef, steps_per_generation, world_results):
    """With ``entropy_coef``, J has the entropy bonus as the term 'entropy' (token_mean over both processes' tokens);
    with ``steps_per_generation=4`` (twice the accumulation steps), J is the first optimizer step's, over half of
    each process's generation batch (TRL's own dapo divides by the whole generation batch's tokens); ``cispo`` and
    ``luspo``, TRL's objectives on the modes of TRL's own reducers (token_mean; constant with divisor 1)."""
    import ast

    for rank in range(WORLD):
        name = f"{case_id((loss_type, entropy_coef, steps_per_generation))}-rank{rank}.txt"
        result = ast.literal_eval(open(os.path.join(world_results, name)).read())
        assert result, f"rank {rank}: no optimizer step was seen"
        assert not isinstance(result[0], str), f"rank {rank}: the case raised {result[0]}"
        err, scale, world, processes = result[0]
        assert world == WORLD and processes == WORLD, f"not a {WORLD}-process run: world={world}, accelerate processes={processes}"
        assert scale > 0, "the gradient of J is zero: the comparison would prove nothing"
        # 1e-6, not 1e-10: the tiny Llama's RMSNorm computes in float32 inside a float64 model,
        # and the reference forward batches the completions differently from TRL's
        # micro-batches (measured ~7e-8); a wrong convention is off by O(1) (0.5 without
        # the process factor)
        assert err < 1e-6, f"rank {rank} ({loss_type}): relative difference from J's gradient {err:.3g}"


def _read(world_results, name):
    import ast

    results = [ast.literal_eval(open(os.path.join(world_results, f"{name}-rank{rank}.txt")).read()) for rank in range(WORLD)]
    for rank, result in enumerate(results):
        assert not isinstance(result[0], str), f"rank {rank}: the case raised {result[0]}"
    return results


def test_two_processes_skip_an_empty_step(world_results):
    """No loss token on either process: zero gradients, the optimizer step skipped on both (weight decay 0.5 would
    move the weights), counted in lossagg_skipped_steps."""
    for rank, (skipped, largest_grad, moved) in enumerate(_read(world_results, "empty-step")):
        assert skipped == 1 and largest_grad == 0.0 and moved == 0.0, (rank, skipped, largest_grad, moved)


def test_two_processes_weigh_the_router_loss_by_the_steps_tokens(world_results):
    """A tiny Mixtral over both processes: each micro-batch's router auxiliary loss enters with its share of the
    step's loss tokens on both processes (float32 losses: 2e-7)."""
    shares = []
    for rank, (off, micro_batches, total, rank_shares) in enumerate(_read(world_results, "router-loss")):
        assert micro_batches == ACCUMULATION and total > 0, (rank, micro_batches, total)
        assert off < 2e-7, f"rank {rank}: the router loss's share is off by {off:.3g}"
        shares += rank_shares
    print(f"the micro-batches' shares of the step's loss tokens: {[round(x, 3) for x in shares]}; TRL weighs each 1/{ACCUMULATION * WORLD}")
    assert sum(shares) == pytest.approx(1.0)
    assert max(abs(x - 1 / (ACCUMULATION * WORLD)) for x in shares) > 1e-3, "equal shares: TRL's weights would pass too"
