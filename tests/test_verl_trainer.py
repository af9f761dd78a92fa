"""verl 0.9.1's trainer losses with lossagg installed (lossagg.integrations.verl: ppo_loss, value_loss,
distillation_ppo_loss, install): every term on its own mode, the step split over DP 2 (gloo processes)
x 2 micro-batches per rank, its gradient against the unsplit float64 reference of docs/terms.md's J; and
every mode, both empty_samples conventions, sessions and weights with the step planned on verl's driver
(``plan_batch``, what ``lossagg_trainer`` runs before verl's ``_update_actor``) and carried to the
micro-batches."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("tensordict")

from worlds import join, report, run_world  # noqa: E402

import lossagg  # noqa: E402
from lossagg.integrations import verl as adapter  # noqa: E402
from lossagg.integrations import verl_trainer  # noqa: E402
from lossagg.testing import reference_loss  # noqa: E402

N, R, P = 8, 6, 2  # samples of the step, padded response width, prompt length
# DP 2 x 2 micro-batches of unequal sizes (verl's engine gives every rank as many micro-batches)
SPLIT = {0: [[0, 1, 2], [3]], 1: [[4], [5, 6, 7]]}
WHOLE = {0: [list(range(N))]}
GROUPS = torch.arange(N) // 4  # verl's uid: two prompts of rollout.n = 4
SESSIONS = torch.tensor([0, 1, 1, 1, 2, 2, 3, 4])  # trajectories of 1 to 3 samples inside the prompts (the batch's "traj")


def make_step(seed: int) -> dict[str, torch.Tensor]:
    """A step of N samples in float64, padded [N, R]: one empty response, holes inside others."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, R + 1, (N,), generator=g)
    lengths[2] = 0
    lengths[5] = R
    width = torch.arange(R)[None, :] < lengths[:, None]
    mask = width & (torch.rand(N, R, generator=g) > 0.2)

    def rand(scale=1.0, shift=0.0):
        return torch.randn(N, R, generator=g, dtype=torch.float64) * scale + shift

    advantages = torch.randn(N, 1, generator=g, dtype=torch.float64).expand(N, R).clone()
    return {
        "lengths": lengths,
        "width": width,
        "response_mask": mask,
        "log_prob": rand(0.3, -1.0),
        "old_log_probs": rand(0.3, -1.0),
        "ref_log_prob": rand(0.3, -1.0),
        "teacher": rand(0.3, -1.0),
        "advantages": advantages,
        "entropy": rand(0.2, 1.0),
        "vpreds": rand(),
        "values": rand(),
        "returns": rand(),
    }


def _flat(step, name, rows, leaf=None):
    """``step[name]`` (or ``leaf``) rows as verl's model output is: flat over prompt + response tokens, each
    response token one position left (verl's no_padding_2_padding reads values[offset - len - 1 : offset - 1])."""
    src = step[name] if leaf is None else leaf
    pieces = []
    for i in rows:
        r = int(step["lengths"][i])
        pieces += [torch.zeros(P - 1, dtype=src.dtype), src[i, :r], torch.zeros(1, dtype=src.dtype)]
    return torch.cat(pieces)


def micro_batch(step, rows, leaves, *, dp_size, carried=None):
    """verl's micro-batch TensorDict and model output for ``rows`` of the step (with the rows of what the
    driver's plan added to the batch, ``carried``)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    b = len(rows)
    idx = torch.tensor(rows)
    lengths = step["lengths"][idx]
    attention = torch.cat([torch.ones(b, P, dtype=torch.int64), step["width"][idx].to(torch.int64)], dim=1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), (lengths + P).cumsum(0)])
    teacher = torch.nested.nested_tensor_from_jagged(_flat(step, "teacher", rows)[:, None], offsets)
    data = TensorDict(
        {
            "prompts": torch.ones(b, P, dtype=torch.int64),
            "responses": torch.ones(b, R, dtype=torch.int64),
            "attention_mask": attention,
            "response_mask": step["response_mask"][idx].to(torch.int64),
            "old_log_probs": step["old_log_probs"][idx],
            "advantages": step["advantages"][idx],
            "ref_log_prob": step["ref_log_prob"][idx],
            "values": step["values"][idx],
            "returns": step["returns"][idx],
            "teacher_logprobs": teacher,
        },
        batch_size=[b],
    )
    # the step's totals, as verl's engine hands every micro-batch: its loss tokens over every rank, its samples
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=int(step["response_mask"].sum()), global_batch_size=N)
    for key, value in (carried or {}).items():
        data[key] = value[idx]
    output = {name: _flat(step, name, rows, leaves[name]) for name in ("log_prob", "entropy", "vpreds")}
    return {"log_probs": output["log_prob"], "entropy": output["entropy"], "values": output["vpreds"]}, data


# ------------------------------------------------------------------ the reference, from docs/terms.md


def vanilla_pg(step, log_prob, clip=0.2, clip_c=3.0):
    """verl's clipped objective per token (dual clip), written out."""
    ratio = torch.exp(torch.clamp(log_prob - step["old_log_probs"], -20.0, 20.0))
    a = step["advantages"]
    clipped = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip, 1 + clip))
    return torch.where(a < 0, torch.minimum(-a * clip_c, clipped), clipped)


def value_per_token(step, vpreds, clip=0.5):
    clipped = torch.clamp(vpreds, step["values"] - clip, step["values"] + clip)
    return torch.maximum((vpreds - step["returns"]) ** 2, (clipped - step["returns"]) ** 2)


def term_j(mode: str, values: torch.Tensor, step, divisor=None, empty_samples="count") -> torch.Tensor:
    """J_k of one term on its own mode over the whole step (float64, lossagg.testing's reference)."""
    cu = torch.arange(N + 1) * R
    config = lossagg.LossAggregationConfig(mode=mode, empty_samples=empty_samples, **({} if divisor is None else {"divisor": divisor}))
    return reference_loss(config, values.reshape(-1), step["response_mask"].reshape(-1), cu, GROUPS, session_index=SESSIONS)


# ------------------------------------------------------------------ cases


def actor(**kw):
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    name = kw.pop("policy", "vanilla")
    policy = PolicyLossConfig(loss_mode=name, **({"dro_beta": 0.1} if name == "dro" else {}))
    return FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=N, ppo_micro_batch_size_per_gpu=2, rollout_n=1, policy_loss=policy, **kw)


def distillation(**kw):
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    # built disabled and then switched on: enabling checks the teacher models' serving setup (pools, replicas),
    # which the losses never read (they read distillation_loss and enabled)
    config = DistillationConfig(enabled=False, distillation_loss=DistillationLossConfig(**kw))
    object.__setattr__(config, "enabled", True)
    return config


# name: (aggregation, actor settings, distillation settings or None, reference(step, leaves) or None)
# A reference of None: the unsplit step through the same loss (a policy loss with no hand reference here)
CASES = {
    "sample_mean+kl_token_mean": (
        {"mode": "sample_mean", "terms": {"kl": {"mode": "token_mean", "coefficient": 0.05}}},
        {"entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.05, "kl_loss_type": "k1"},
        None,
        lambda s, x, j=term_j: (
            j("sample_mean", vanilla_pg(s, x["log_prob"]), s)
            - 0.01 * j("sample_mean", x["entropy"], s)
            + 0.05 * j("token_mean", x["log_prob"] - s["ref_log_prob"], s)
        ),
    ),
    "token_mean+kl_sample_mean": (
        {"mode": "token_mean", "terms": {"kl": {"mode": "sample_mean", "coefficient": 0.1}}},
        {"entropy_coeff": 0.02, "use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "k1"},
        None,
        lambda s, x, j=term_j: (
            j("token_mean", vanilla_pg(s, x["log_prob"]), s)
            - 0.02 * j("token_mean", x["entropy"], s)
            + 0.1 * j("sample_mean", x["log_prob"] - s["ref_log_prob"], s)
        ),
    ),
    "constant+entropy_token_mean": (
        {"mode": "constant", "divisor": 4.0, "terms": {"entropy": {"mode": "token_mean", "coefficient": -0.01}}},
        {"entropy_coeff": 0.01},
        None,
        lambda s, x, j=term_j: j("constant", vanilla_pg(s, x["log_prob"]), s, divisor=4.0) - 0.01 * j("token_mean", x["entropy"], s),
    ),
    "distillation_k3_token_mean": (
        {"mode": "sample_mean", "terms": {"distillation": {"mode": "token_mean", "coefficient": 0.5}}},
        {"entropy_coeff": 0.0},
        {"loss_mode": "k3", "use_policy_gradient": False, "use_task_rewards": True, "distillation_loss_coef": 0.5},
        lambda s, x, j=term_j: j("sample_mean", vanilla_pg(s, x["log_prob"]), s) + 0.5 * j("token_mean", k3(x["log_prob"], s["teacher"]), s),
    ),
    "distillation_pg_k1": (
        {"mode": "token_mean", "terms": {"distillation": {"mode": "sample_mean", "coefficient": 1.0}}},
        {"entropy_coeff": 0.0},
        {"loss_mode": "k1", "use_policy_gradient": True, "use_task_rewards": False},
        None,
    ),
    **{
        f"policy_{name}": (
            {"mode": "sample_mean", "terms": {"kl": {"mode": "token_mean", "coefficient": 0.05}}},
            {"policy": name, "entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.05, "kl_loss_type": "low_var_kl"},
            None,
            None,
        )
        for name in ("cispo", "gspo", "gpg", "dro", "dppo_tv", "dppo_kl")
    },
}


def k3(log_prob, teacher):
    """verl's k3 estimator of KL(student || teacher) per token, clamped as verl's distillation loss clamps it."""
    kl = teacher - log_prob
    return torch.clamp(torch.exp(kl) - kl - 1, -10.0, 10.0)


def loss_fn(name):
    aggregation, settings, distilling, _ = CASES[name]
    return adapter.actor_loss(actor(**dict(settings)), aggregation, None if distilling is None else distillation(**distilling))


def leaves_of(step):
    return {name: step[name].clone().requires_grad_(True) for name in ("log_prob", "entropy", "vpreds")}


def run_split(fn, step, split, dp_size, rank, carried=None):
    """This rank's micro-batches through the loss ``fn``: its summed loss and the summed gradient of its leaves."""
    leaves = leaves_of(step)
    total = 0.0
    for rows in split[rank]:
        output, data = micro_batch(step, rows, leaves, dp_size=dp_size, carried=carried)
        loss, _ = fn(model_output=output, data=data)
        loss.backward()
        total += float(loss)
    return total, {k: (v.grad if v.grad is not None else torch.zeros_like(v)) for k, v in leaves.items()}


def critic_fn(mode="sample_mean"):
    from verl.workers.config import FSDPCriticConfig

    config = FSDPCriticConfig(strategy="fsdp", ppo_mini_batch_size=N, ppo_micro_batch_size_per_gpu=2, rollout_n=1, cliprange_value=0.5)
    return adapter.critic_loss(config, {"mode": mode})


def reference_grads(step, reference):
    leaves = leaves_of(step)
    j = reference(step, leaves)
    grads = torch.autograd.grad(j, [leaves[k] for k in ("log_prob", "entropy", "vpreds")], allow_unused=True)
    return j, {k: (g if g is not None else torch.zeros_like(leaves[k])) for k, g in zip(("log_prob", "entropy", "vpreds"), grads, strict=True)}


CRITIC_CASES = {
    "value_sample_mean": ("sample_mean", lambda s, x, j=term_j: 0.5 * j("sample_mean", value_per_token(s, x["vpreds"]), s)),
    "value_token_mean": ("token_mean", lambda s, x, j=term_j: 0.5 * j("token_mean", value_per_token(s, x["vpreds"]), s)),
}


def _world(rank, world, seeds, init_file, results_dir):
    import torch.distributed as dist

    failures, ran = join(rank, world, init_file)
    try:
        for seed in seeds:
            step = make_step(seed)
            for name, (_, _, _, reference) in CASES.items():
                fn = loss_fn(name)
                ran += _check(f"{name} seed {seed}", step, fn, rank, reference, failures, dist, mutate="constant" not in name)
            for name, (mode, reference) in CRITIC_CASES.items():
                ran += _check(f"{name} seed {seed}", step, critic_fn(mode), rank, reference, failures, dist, mutate=True)
            for name, (fn, weights, reference) in planned_cases().items():
                carried = driver_plan(step, fn.keywords["aggregation"], weights)
                ran += _check(f"planned {name} seed {seed}", step, fn, rank, reference, failures, dist, mutate=True, carried=carried)
    except Exception as e:  # reported, not lost in the spawn
        import traceback

        failures.append(f"rank {rank}: {e!r}\n{traceback.format_exc()}")
    finally:
        report(results_dir, rank, ran, failures)
        dist.destroy_process_group()


def _check(what, step, fn, rank, reference, failures, dist, *, mutate, carried=None) -> int:
    """DDP's average of the ranks' summed gradients (and the losses' average, verl's logged loss) against the
    reference; a reference of None: the unsplit step through the same loss on one process."""
    loss, grads = run_split(fn, step, SPLIT, dist.get_world_size(), rank, carried)
    flat = torch.cat([grads[k].reshape(-1) for k in ("log_prob", "entropy", "vpreds")])
    both = torch.cat([flat, torch.tensor([loss], dtype=torch.float64)])
    dist.all_reduce(both)
    both /= dist.get_world_size()
    if reference is None:
        want_loss, want = run_split(fn, step, WHOLE, 1, 0)
    else:
        j, want = reference_grads(step, reference)
        want_loss = float(j)
    want_flat = torch.cat([want[k].reshape(-1) for k in ("log_prob", "entropy", "vpreds")])
    scale = max(float(want_flat.abs().max()), 1e-30)
    err = float((both[:-1] - want_flat).abs().max()) / scale
    if err > 1e-10 or abs(float(both[-1]) - want_loss) > 1e-10 * max(1.0, abs(want_loss)):
        failures.append(f"{what}: gradient off by {err:.3g} (relative to its largest entry), loss {float(both[-1])!r} vs {want_loss!r}")
    if reference is not None and mutate:
        # the mutated reference (a term on the other mode) must be told apart
        j_bad, bad = reference_grads(step, lambda s, x: reference(s, x, term_j_swapped))
        bad_flat = torch.cat([bad[k].reshape(-1) for k in ("log_prob", "entropy", "vpreds")])
        if float((both[:-1] - bad_flat).abs().max()) / scale < 1e-6:
            failures.append(f"{what}: the mutated reference passes too")
    return 1


def term_j_swapped(mode, values, step, divisor=None, empty_samples="count"):
    swap = {"sample_mean": "token_mean", "token_mean": "sample_mean", "prompt_mean": "sample_mean", "constant": "sample_mean"}
    swap.update({"max_length": "constant", "session_mean": "sample_mean", "session_token_mean": "token_mean"})
    swap.update({"prompt_session_mean": "session_mean", "prompt_session_token_mean": "session_token_mean"})
    return term_j(swap[mode], values, step, 4.0 if swap[mode] == "constant" else None, empty_samples)


# ------------------------------------------------------------------ every mode, planned on verl's driver


def driver_plan(step, aggregation, weights=None) -> dict[str, torch.Tensor]:
    """verl's batch of the whole step on the driver (its ``uid`` and a trajectory key, ``traj``) through
    ``plan_batch`` as ``lossagg_trainer`` runs it (one mini-batch of N rows over DP 2): what it adds."""
    import numpy as np
    from verl import DataProto

    tensors = {"response_mask": step["response_mask"].to(torch.int64), **({} if weights is None else {"w": weights})}
    non_tensors = {"uid": np.array([f"prompt-{int(g)}" for g in GROUPS], dtype=object), "traj": SESSIONS.numpy()}
    batch = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
    keys = {"weights_key": None if weights is None else "w", "session_key": "traj"}
    verl_trainer.plan_batch(batch, aggregation, mini_batch_size=N, dp_size=2, **keys)
    return {key: batch.batch[key] for key in (verl_trainer.DENOMS_KEY, verl_trainer.WEIGHTS_KEY) if key in batch.batch.keys()}


WEIGHTS = torch.tensor([1.0, 0.5, 2.0, 1.5, 0.25, 1.0, 3.0, 0.75], dtype=torch.float64)


def planned_cases() -> dict:
    """name: (the actor's loss built for a planned step, the samples' weights or None, reference(step, leaves, j)):
    every mode under both empty_samples conventions (pg alone), terms on grouped and session modes, weights."""
    cases = {}
    for mode in lossagg.MODES:
        for empty in ("count", "skip"):
            divisor = 4.0 if mode == "constant" else None
            aggregation = {"mode": mode, "empty_samples": empty, **({} if divisor is None else {"divisor": divisor})}
            cases[f"{mode} {empty}"] = (
                adapter.actor_loss(actor(entropy_coeff=0.0), aggregation, planned=True),
                None,
                lambda s, x, j=term_j, mode=mode, empty=empty, divisor=divisor: j(mode, vanilla_pg(s, x["log_prob"]), s, divisor, empty),
            )
    terms = {"kl": {"mode": "session_mean", "coefficient": 0.05}, "entropy": {"mode": "prompt_mean", "coefficient": -0.01}}
    cases["prompt_session_token_mean+kl session_mean+entropy prompt_mean"] = (
        adapter.actor_loss(
            actor(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="k1"),
            {"mode": "prompt_session_token_mean", "terms": terms},
            planned=True,
        ),
        None,
        lambda s, x, j=term_j: (
            j("prompt_session_token_mean", vanilla_pg(s, x["log_prob"]), s)
            - 0.01 * j("prompt_mean", x["entropy"], s)
            + 0.05 * j("session_mean", x["log_prob"] - s["ref_log_prob"], s)
        ),
    )
    w = WEIGHTS[:, None]
    cases["prompt_mean weighting multiply"] = (
        adapter.actor_loss(actor(entropy_coeff=0.0), {"mode": "prompt_mean", "weighting": "multiply"}, planned=True),
        WEIGHTS,
        lambda s, x, j=term_j: j("prompt_mean", w * vanilla_pg(s, x["log_prob"]), s),
    )
    cases["sample_mean weighting mean"] = (  # N replaced by W = sum of the weights (docs/terms.md)
        adapter.actor_loss(actor(entropy_coeff=0.0), {"mode": "sample_mean", "weighting": "mean"}, planned=True),
        WEIGHTS,
        lambda s, x, j=term_j: j("sample_mean", w * vanilla_pg(s, x["log_prob"]), s) * N / float(WEIGHTS.sum()),
    )
    return cases


@pytest.mark.xdist_group("engines")
def test_every_term_of_verls_losses_over_dp2_x_two_micro_batches(tmp_path):
    """Every case's summed gradient over DP 2 (gloo) x 2 unequal micro-batches per rank equals the unsplit
    float64 reference of its per-term modes (1e-10), and a reference with a term on the other mode does not."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    failures, runs = run_world(_world, 2, ((0, 1),), tmp_path)
    assert not failures, "\n".join(failures)
    assert runs == 2 * 2 * (len(CASES) + len(CRITIC_CASES) + len(planned_cases()))


# ------------------------------------------------------------------ side by side with verl's own ppo_loss


@pytest.mark.parametrize(("ours", "verls"), [("token_mean", "token-mean"), ("sample_mean", "seq-mean-token-mean")])
@pytest.mark.parametrize("seed", range(3))
def test_same_numbers_as_verls_ppo_loss_where_its_mode_is_ours(ours, verls, seed):
    """Per micro-batch (DP 2's rank 0, verl's global-batch arguments), with entropy and KL: lossagg's losses give
    verl 0.9.1's own ppo_loss's value and gradients where verl's mode is exact and lossagg's equal to it."""
    from verl.workers.utils.losses import ppo_loss as verls_ppo_loss

    step = make_step(seed)
    settings = {"entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.05, "kl_loss_type": "low_var_kl"}
    fn = adapter.actor_loss(actor(**settings), {"mode": ours})
    for rows in SPLIT[0]:
        got, want = [], []
        for run, out in (
            (lambda o, d: fn(model_output=o, data=d), got),
            (lambda o, d: verls_ppo_loss(actor(loss_agg_mode=verls, **settings), o, d), want),
        ):
            leaves = leaves_of(step)
            output, data = micro_batch(step, rows, leaves, dp_size=2)
            loss, metrics = run(output, data)
            loss.backward()
            out += [
                float(loss.detach()),
                leaves["log_prob"].grad,
                leaves["entropy"].grad,
                metrics["actor/pg_clipfrac"].values[0],
                float(metrics["kl_loss"].values[0]),
            ]
        assert got[0] == pytest.approx(want[0], rel=1e-12, abs=1e-15)
        for a, b in zip(got[1:3], want[1:3], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
        assert got[3] == want[3]  # verl's metrics, unweighted
        assert got[4] == pytest.approx(want[4], rel=1e-12)


def test_verls_per_micro_batch_mean_moves_with_the_split():
    """The case lossagg fixes: verl's ppo_loss without global-batch arguments reduces each micro-batch alone,
    so its summed gradient moves with the split (printed); lossagg's does not (the world test)."""
    from verl.workers.utils.losses import ppo_loss as verls_ppo_loss

    step = make_step(0)
    settings = {"entropy_coeff": 0.01, "loss_agg_mode": "token-mean"}
    grads = []
    for split in ([list(range(N))], [[0, 1, 2], [3, 4, 5, 6, 7]]):
        leaves = leaves_of(step)
        for rows in split:
            output, data = micro_batch(step, rows, leaves, dp_size=1)
            data["batch_num_tokens"] = None
            data["global_batch_size"] = None
            loss, _ = verls_ppo_loss(actor(**settings), output, data)
            loss.backward()
        grads.append(leaves["log_prob"].grad)
    moved = float((grads[0] - grads[1] / 2).abs().max() / grads[0].abs().max())
    print(f"verl's per-micro-batch token-mean: gradient moves by {moved:.3%} of its largest entry between 1 and 2 micro-batches")
    assert moved > 1e-3


# ------------------------------------------------------------------ refusals and install


def _actor_error(aggregation, distilling=None, **settings):
    with pytest.raises(ValueError) as info:
        adapter.actor_loss(actor(**settings), aggregation, None if distilling is None else distillation(**distilling))
    return str(info.value)


@pytest.mark.parametrize(
    ("aggregation", "settings", "distilling", "named"),
    [
        ({"mode": "prompt_mean", "n_samples_per_prompt": 4}, {}, None, ["mode=prompt_mean", "num_groups"]),
        # a session mode: verl's batch carries no trajectory id, and its engine no session totals (docs/modes.md, "Sessions")
        ({"mode": "session_mean"}, {}, None, ["mode=session_mean", "num_sessions, session_sizes"]),
        ({"mode": "max_length"}, {}, None, ["mode=max_length", "max_tokens"]),
        ({"mode": "sample_mean", "empty_samples": "skip"}, {}, None, ["empty_samples=skip", "num_nonempty_samples"]),
        (
            {"mode": "sample_mean", "terms": {"kl": {"mode": "prompt_mean", "coefficient": 0.05}}, "n_samples_per_prompt": 2},
            {"use_kl_loss": True, "kl_loss_coef": 0.05},
            None,
            ["terms.kl.mode=prompt_mean"],
        ),
        ({"mode": "sample_mean"}, {"policy": "sapo"}, None, ["loss_mode='sapo'", "seq-mean-token-mean"]),
        ({"mode": "sample_mean"}, {"policy": "clip_cov"}, None, ["loss_mode='clip_cov'", "covariance"]),
        ({"mode": "sample_mean"}, {"policy": "geo_mean"}, None, ["loss_mode='geo_mean'"]),
        ({"mode": "sample_mean"}, {"policy": "bypass_mode"}, None, ["loss_mode='bypass_mode'", "rollout_is_weights"]),
        ({"mode": "sample_mean", "terms": {"kl": {"coefficient": 0.05}}}, {}, None, ["terms.kl", "use_kl_loss is off"]),
        (
            {"mode": "sample_mean", "terms": {"kl": {"coefficient": 0.5}}},
            {"use_kl_loss": True, "kl_loss_coef": 0.05},
            None,
            ["terms.kl.coefficient is 0.5", "kl_loss_coef = 0.05"],
        ),
        (
            {"mode": "sample_mean", "terms": {"entropy": {"coefficient": 0.01}}},
            {"entropy_coeff": 0.01},
            None,
            ["terms.entropy.coefficient", "-entropy_coeff = -0.01"],
        ),
        ({"mode": "sample_mean", "terms": {"nll": {"coefficient": 1.0}}}, {}, None, ["terms.nll"]),
        ({"mode": "sample_mean", "weighting": "multiply"}, {}, None, ["weighting=multiply"]),
        ({"mode": "sample_mean"}, {"loss_scale_factor": 512}, None, ["actor.loss_scale_factor=512"]),
        # a coefficient verl's actor holds is named as the actor's setting the user wrote, not as a term of lossagg's
        ({"mode": "sample_mean"}, {"entropy_coeff": float("nan")}, None, ["actor.entropy_coeff=nan", "finite"]),
        ({"mode": "sample_mean"}, {"use_kl_loss": True, "kl_loss_coef": float("inf")}, None, ["actor.kl_loss_coef=inf", "finite"]),
        (
            {"mode": "sample_mean"},
            {},
            {"loss_mode": "k3", "use_policy_gradient": False, "use_task_rewards": True, "distillation_loss_coef": float("nan")},
            ["distillation_loss_coef=nan", "finite"],
        ),
    ],
)
def test_refused_by_name_when_the_loss_is_built(aggregation, settings, distilling, named):
    message = _actor_error(aggregation, distilling, **settings)
    for part in named:
        assert part in message, message


def test_every_problem_named_at_once():
    message = _actor_error({"mode": "prompt_mean", "n_samples_per_prompt": 4, "weighting": "multiply"}, policy="sapo")
    assert "mode=prompt_mean" in message and "weighting=multiply" in message and "sapo" in message


class _Workers:
    def __init__(self):
        self.handed = []

    def set_loss_fn(self, fn):
        self.handed.append(fn)


class _Trainer:
    """What install() reads of verl's RayPPOTrainer after init_workers(): its config and worker groups."""

    def __init__(self, **actor_settings):
        from omegaconf import OmegaConf

        actor_cfg = {
            "_target_": "verl.workers.config.FSDPActorConfig",
            "strategy": "fsdp",
            "ppo_mini_batch_size": N,
            "ppo_micro_batch_size_per_gpu": 2,
            "rollout_n": 1,
            **actor_settings,
        }
        critic_cfg = {
            "_target_": "verl.workers.config.FSDPCriticConfig",
            "strategy": "fsdp",
            "ppo_mini_batch_size": N,
            "ppo_micro_batch_size_per_gpu": 2,
            "rollout_n": 1,
        }
        self.config = OmegaConf.create({"actor_rollout_ref": {"actor": actor_cfg}, "critic": critic_cfg})
        self.actor_rollout_wg, self.critic_wg, self.use_critic = _Workers(), _Workers(), True


def test_install_hands_both_losses_through_set_loss_fn():
    trainer = _Trainer(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05)
    config = {
        "mode": "sample_mean",
        "terms": {"kl": {"mode": "token_mean", "coefficient": 0.05}, "value": {"mode": "token_mean", "coefficient": 0.5}},
    }
    losses = adapter.install(trainer, config)
    assert trainer.actor_rollout_wg.handed == [losses["actor"]] and trainer.critic_wg.handed == [losses["critic"]]
    whole = losses["actor"].keywords["aggregation"]
    assert whole.terms["kl"].mode == "token_mean" and whole.terms["entropy"].coefficient == -0.01 and "value" not in whole.terms
    assert losses["critic"].keywords["aggregation"].terms["value"].mode == "token_mean"
    import pickle

    pickle.loads(pickle.dumps(losses["actor"]))  # Ray pickles what set_loss_fn is handed


def test_install_hands_nothing_when_refused_and_needs_workers():
    trainer = _Trainer(entropy_coeff=0.01)
    with pytest.raises(ValueError, match="terms.value.coefficient"):
        adapter.install(trainer, {"mode": "sample_mean", "terms": {"value": {"coefficient": 1.0}}})
    assert trainer.actor_rollout_wg.handed == [] and trainer.critic_wg.handed == []
    trainer.actor_rollout_wg = None
    with pytest.raises(ValueError, match="after trainer.init_workers"):
        adapter.install(trainer, {"mode": "sample_mean"})


# ------------------------------------------------------------------ lossagg_trainer: verl's driver plans the step


class _Dispatching(_Workers):
    """A worker group as verl's driver sees it: the train mesh's DP rank of each of its 4 workers (TP 2 x DP 2),
    and update_actor / update_critic recording what verl's trainer hands them."""

    def __init__(self):
        super().__init__()
        self._dispatch_info, self.updates = {}, []

    def _query_dispatch_info(self, mesh):
        assert mesh == "train"
        return [0, 0, 1, 1]

    def update_actor(self, data):
        from verl.utils import tensordict_utils as tu

        self.updates.append(data)
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"mfu": 0.0}})

    def train_mini_batch(self, data):  # the critic's, non-blocking (verl's _update_critic waits on it)
        from types import SimpleNamespace

        output = self.update_actor(data)
        return SimpleNamespace(get=lambda: output)


def ray_trainer():
    """verl's trainer module (it imports more than verl's losses: scripts/install_peers.sh installs it)."""
    return pytest.importorskip("verl.trainer.ppo.ray_trainer", reason="verl's trainer module is not importable (scripts/install_peers.sh)")


def planned_trainer(aggregation, *, rollout_n=2, mini_batch_prompts=2, **keys):
    """lossagg_trainer over verl's own RayPPOTrainer (its _update_actor and _update_critic as they are), with
    only its __init__ replaced by the settings those read (verl's own __init__ starts Ray's resource pools)."""
    from omegaconf import OmegaConf

    RayPPOTrainer = ray_trainer().RayPPOTrainer

    class Settings(RayPPOTrainer):
        def __init__(self, **actor_settings):
            _Trainer.__init__(self, **actor_settings)
            loop = {"ppo_mini_batch_size": mini_batch_prompts, "ppo_epochs": 1, "data_loader_seed": 42, "shuffle": False}
            rollout = {"n": rollout_n, "temperature": 1.0, "multi_turn": {"enable": False}}
            actor = {**loop, "calculate_entropy": False}
            self.config = OmegaConf.merge(self.config, {"actor_rollout_ref": {"rollout": rollout, "actor": actor}, "critic": loop})
            self.actor_rollout_wg, self.critic_wg = _Dispatching(), _Dispatching()

        def init_workers(self):  # verl's own starts the worker groups
            self.workers_started = True

    return verl_trainer.lossagg_trainer(Settings)(loss_aggregation=aggregation, entropy_coeff=0.0, **keys)


def padded_batch(seed=0):
    """verl's batch on the driver as _update_actor takes it: N rows, left-padded prompts, right-padded responses
    with holes, prompt ids in ``uid`` (pairs of rows)."""
    import numpy as np
    from verl import DataProto

    step = make_step(seed)
    attention = torch.cat([torch.ones(N, P, dtype=torch.int64), step["width"].to(torch.int64)], 1)
    tensors = {
        "input_ids": torch.randint(3, 30, (N, P + R)),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
        "response_mask": step["response_mask"].to(torch.int64),
        "responses": torch.randint(3, 30, (N, R)),
    }
    uid = np.array([f"prompt-{i // 2}" for i in range(N)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid}), step


def test_lossagg_trainer_plans_each_mini_batch_before_verls_update_actor():
    """Two mini-batches (2 prompts x rollout.n 2) over DP 2 (the mesh's, not the worker count): each sample's d[i] is
    its mini-batch's plan's (rows 0, 1, 4, 5 make step 0, as verl's dispatch and iterator cut it), and it reaches
    the TensorDict verl hands update_actor; the losses go out through set_loss_fn after init_workers."""
    trainer = planned_trainer({"mode": "prompt_mean"})
    assert type(trainer).__name__ == "LossaggSettings"
    batch, step = padded_batch()
    trainer._update_actor(batch)
    (handed,) = trainer.actor_rollout_wg.updates
    carried = handed[verl_trainer.DENOMS_KEY]
    assert carried.shape == (N, 2)  # pg and entropy (the actor's terms)
    counts = step["response_mask"].to(torch.float64).sum(-1)
    groups = torch.arange(N) // 2
    for rows in ([0, 1, 4, 5], [2, 3, 6, 7]):
        plan = lossagg.StepPlan(trainer._lossagg_losses["actor"].keywords["aggregation"], counts[rows], group_index=groups[rows])
        torch.testing.assert_close(carried[rows, 0], plan.term_denoms["pg"], rtol=0, atol=0)
    whole = lossagg.StepPlan(lossagg.LossAggregationConfig(mode="prompt_mean"), counts, group_index=groups)
    assert not torch.equal(carried[:, 0], whole.sample_denoms)  # planned per mini-batch, not per batch
    assert verl_trainer.step_of_rows(N, 4, 2).tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    trainer._update_critic(padded_batch()[0])
    assert trainer.critic_wg.updates[0][verl_trainer.DENOMS_KEY].shape == (N, 2)  # pg (unused by the critic) and value
    trainer.init_workers()
    assert trainer.workers_started and trainer.actor_rollout_wg.handed == [trainer._lossagg_losses["actor"]]
    assert trainer.critic_wg.handed == [trainer._lossagg_losses["critic"]]


@pytest.mark.parametrize(
    ("aggregation", "settings", "keys", "named"),
    [
        ({"mode": "prompt_mean"}, {"shuffle": True}, {}, "actor.shuffle=True"),
        ({"mode": "sample_mean", "weighting": "mean"}, {}, {}, "needs sample_weights_key"),
        ({"mode": "sample_mean"}, {}, {"sample_weights_key": "w"}, "sample_weights_key='w' is given"),
        ({"mode": "prompt_mean", "n_samples_per_prompt": 4}, {}, {}, "n_samples_per_prompt=4 but verl's rollout.n is 2"),
    ],
)
def test_lossagg_trainer_refuses_by_name_when_built(aggregation, settings, keys, named):
    from omegaconf import OmegaConf

    RayPPOTrainer = ray_trainer().RayPPOTrainer

    class Settings(RayPPOTrainer):
        def __init__(self, **actor_settings):
            _Trainer.__init__(self, **actor_settings)
            self.config = OmegaConf.merge(self.config, {"actor_rollout_ref": {"rollout": {"n": 2}}})

    with pytest.raises(verl_trainer.VerlConfigError, match=named.replace("(", r"\(")):
        verl_trainer.lossagg_trainer(Settings)(loss_aggregation=aggregation, entropy_coeff=0.0, **settings, **keys)


def test_a_planned_loss_without_the_drivers_plan_and_a_batch_that_cannot_split_are_named():
    fn = adapter.actor_loss(actor(entropy_coeff=0.0), {"mode": "prompt_mean"}, planned=True)
    leaves = leaves_of(make_step(0))
    output, data = micro_batch(make_step(0), [0, 1], leaves, dp_size=2)
    with pytest.raises(ValueError, match="lossagg_trainer"):
        fn(model_output=output, data=data)
    with pytest.raises(ValueError, match="must split into 2 equal DP chunks"):
        verl_trainer.step_of_rows(N, 3, 2)
    with pytest.raises(ValueError, match="needs the step total"):
        adapter.actor_loss(actor(entropy_coeff=0.0), {"mode": "prompt_mean"})  # install's way: verl's totals only


def test_plan_batch_names_a_key_the_batch_lacks():
    import numpy as np
    from verl import DataProto

    step = make_step(0)
    batch = DataProto.from_dict(tensors={"response_mask": step["response_mask"].to(torch.int64)}, non_tensors={"x": np.arange(N)})
    whole = lossagg.LossAggregationConfig(mode="prompt_mean")
    with pytest.raises(ValueError, match="verl's batch has no 'uid'"):
        verl_trainer.plan_batch(batch, whole, mini_batch_size=N, dp_size=2)
    with pytest.raises(ValueError, match="no 'traj' or 'w'"):
        verl_trainer.plan_batch(
            batch, lossagg.LossAggregationConfig(mode="sample_mean"), mini_batch_size=N, dp_size=2, session_key="traj", weights_key="w"
        )
