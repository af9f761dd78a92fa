"""SkyRL 0.4.0's own driver step with lossagg's trainer subclass (lossagg.integrations.skyrl), no Ray:

* the trainer built by its real ``__init__``, a rollout turned into SkyRL's ``TrainingInputBatch`` by its
  ``convert_to_training_input`` (mini-batch and prompt boundaries, DP padding), advantages by its
  ``compute_advantages_and_returns`` (GRPO; step-wise: broadcast over each trajectory's turns), then ``uids``
  and ``is_last_step`` popped as ``RayPPOTrainer.train`` pops them, then the subclass's ``_normalize_advantages``
  as ``_execute_training_step`` calls it;
* each mini-batch padded and cut into DP 2 contiguous chunks as ``MeshDispatch.stage_chunks`` does, each chunk
  into micro-batches of 2 by SkyRL's ``get_microbatch_iterator``, SkyRL's registered policy loss
  (``regular``, ``dual_clip``) per micro-batch times the DP size (``workers/worker.py``), the DP mean of the ranks'
  gradients: the gradient is that of the float64 reference J (``lossagg.testing.reference_loss``) of every
  mini-batch, for every mode SkyRL's batch holds data for (the session modes in step-wise training), both
  ``empty_samples``;
* with SkyRL's own ``loss_reduction`` (no lossagg config) the advantages are SkyRL's own method's, with and
  without its z-score, step-wise or not;
* what the trainer cannot serve is refused by name when it is built.

Skipped, with the reason, when SkyRL's trainer is not importable (scripts/install_peers.sh installs SkyRL;
``skyrl.train.trainer`` also needs torchdata).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace as NS

import pytest
import torch

import lossagg
from lossagg.integrations.skyrl import TRAJECTORY_KEY, SkyRLConfigError, lossagg_trainer
from lossagg.testing import reference_loss

pytest.importorskip("skyrl", reason="SkyRL is not importable (scripts/install_peers.sh installs it)")

import skyrl_peer  # noqa: E402

DP, MICRO, MAX_SEQ_LEN, PROMPTS, MINI_BATCH_PROMPTS = 2, 2, 16, 4, 2  # 2 mini-batches of 2 prompts
N_PER_PROMPT = {False: 4, True: 2}  # rows per prompt; step-wise, trajectories per prompt, each of 1 to 3 turns
TURNS = [[3, 1], [2, 2], [1, 1], [2, 3]]  # step-wise: the turns of each prompt's trajectories
REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean")
SESSIONLESS = [m for m, spec in lossagg.MODES.items() if not spec.needs_sessions]


@pytest.fixture(scope="module")
def sk():
    """SkyRL's modules the driver step uses (tests/skyrl_peer.py enters the packages Python 3.11 cannot import)."""
    try:
        ppo_utils = skyrl_peer.ppo_utils()
        trainer = skyrl_peer.trainer()
        from skyrl.backends.skyrl_train.training_batch import pad_training_input_batch
        from skyrl.backends.skyrl_train.utils.torch_utils import safe_exp_delta
        from skyrl.backends.skyrl_train.workers.worker_utils import BaseBatchIterator, get_microbatch_iterator
        from skyrl.train.config import AlgorithmConfig
    except ImportError as exc:
        pytest.skip(f"SkyRL's trainer is not importable ({type(exc).__name__}: {exc}); scripts/install_peers.sh installs SkyRL, and torchdata")
    return NS(
        trainer=trainer,
        losses=ppo_utils.PolicyLossRegistry,
        pad=pad_training_input_batch,
        exp=safe_exp_delta,
        micro_batches=get_microbatch_iterator,
        experience=BaseBatchIterator.batch_to_experience,
        AlgorithmConfig=AlgorithmConfig,
    )


def skyrl_cfg(sk, step_wise=False, **algorithm):
    """The settings of SkyRL's config the driver step reads (SkyRLTrainConfig itself imports its inference clients)."""
    settings = {"use_kl_loss": False, "max_seq_len": MAX_SEQ_LEN, **algorithm}
    trainer = NS(
        algorithm=sk.AlgorithmConfig(**settings),
        micro_train_batch_size_per_gpu=MICRO,
        train_batch_size=PROMPTS,
        policy_mini_batch_size=MINI_BATCH_PROMPTS,
        critic=NS(model=NS(path=None)),
        placement=NS(colocate_all=False, policy_num_gpus_per_node=DP, policy_num_nodes=1),
        resume_mode="none",
        enable_ray_gpu_monitor=False,
    )
    generator = NS(
        n_samples_per_prompt=N_PER_PROMPT[step_wise], step_wise_trajectories=step_wise, inference_engine=NS(enable_ray_prometheus_stats=False)
    )
    return NS(trainer=trainer, generator=generator)


def rollout(step_wise, seed=0):
    """A generator output (SkyRL's GeneratorOutput keys), its uids, and each row's prompt and trajectory as the test
    numbers them. Empty rows (no loss token): non-step-wise row 5 and all of prompt 3; step-wise trajectory 1 of
    prompt 2 and one turn of prompt 3's first trajectory. Some tokens inside responses are masked."""
    g = torch.Generator().manual_seed(seed)
    if step_wise:
        rows = [(p, 2 * p + k, turn == n - 1) for p, turns in enumerate(TURNS) for k, n in enumerate(turns) for turn in range(n)]
    else:
        rows = [(p, 4 * p + k, True) for p in range(PROMPTS) for k in range(4)]
    out = {"prompt_token_ids": [], "response_ids": [], "rewards": [], "loss_masks": [], "rollout_logprobs": None}
    reward = torch.randn(len(rows), generator=g).tolist()
    for i, (prompt, trajectory, last) in enumerate(rows):
        n = int(torch.randint(2, 9, (1,), generator=g))
        mask = (torch.rand(n, generator=g) > 0.2).int().tolist()
        if (not step_wise and (i == 5 or prompt == 3)) or (step_wise and (trajectory == 5 or i == 11)):
            mask = [0] * n
        out["prompt_token_ids"].append([1, 2, 3])
        out["response_ids"].append(torch.randint(4, 50, (n,), generator=g).tolist())
        out["rewards"].append([0.0] * (n - 1) + [reward[i] if last else 0.0])
        out["loss_masks"].append(mask)
    if step_wise:
        out["is_last_step"] = [last for _, _, last in rows]
    prompts = torch.tensor([p for p, _, _ in rows])
    sessions = torch.tensor([s for _, s, _ in rows]) if step_wise else torch.arange(len(rows))
    return out, [f"prompt{p}" for p, _, _ in rows], prompts, sessions


def driver_step(sk, monkeypatch, cfg, loss_aggregation=None):
    """SkyRL's driver up to the policy's training step: the subclass built, the rollout converted, the advantages computed,
    ``uids`` and ``is_last_step`` popped as ``RayPPOTrainer.train`` pops them."""
    monkeypatch.setattr(sk.trainer, "configure_ray_worker_logging", lambda: None)  # SkyRL's process-wide logging set-up, not the test's
    trainer = lossagg_trainer(sk.trainer.RayPPOTrainer)(cfg, None, NS(pad_token_id=0), None, None, None, loss_aggregation=loss_aggregation)
    trainer.dispatch = NS(get_lcm_dp_size=lambda: DP)  # convert_to_training_input pads the batch to a multiple of it
    output, uids, prompts, sessions = rollout(cfg.generator.step_wise_trajectories)
    data = trainer.convert_to_training_input(output, uids)
    rows, width = data["loss_mask"].shape
    g = torch.Generator().manual_seed(1)
    data["values"] = None  # no critic
    data["action_log_probs"] = -3 * torch.rand(rows, width, generator=g, dtype=torch.float64)  # what fwd_logprobs_values_reward adds
    data = trainer.compute_advantages_and_returns(data)
    data.pop("rewards")
    data.metadata.pop("uids")
    data.metadata.pop("is_last_step", None)
    data["row"] = torch.arange(rows)  # the test's own: which rows' log-probs a micro-batch holds
    return trainer, data, prompts, sessions


def skyrl_policy_step(sk, trainer, data, logp):
    """``_execute_training_step("policy")`` and the workers' ``forward_backward``, on one process: the loss whose gradient
    is the DP mean of the ranks' gradients, summed over the mini-batches (each its own optimizer step, on its own rows)."""
    boundaries = data.metadata["policy_mini_batch_boundaries"]
    data = trainer._normalize_advantages(data, boundaries, data.metadata.get("policy_prompt_boundaries"))
    algorithm = trainer.cfg.trainer.algorithm
    loss_fn = sk.losses.get(algorithm.policy_loss_type)
    total = torch.zeros((), dtype=torch.float64)
    for start, end in boundaries:
        mini = data[start:end]
        if (-len(mini)) % DP:  # MeshDispatch.stage_chunks: padded with loss_mask=0 rows, then DP contiguous chunks
            mini = sk.pad(mini, (-len(mini)) % DP)
        rank_losses = []
        for chunk in mini.chunk(len(mini) // DP):
            rank_loss = torch.zeros((), dtype=torch.float64)
            for mb in sk.micro_batches(chunk, micro_batch_size=MICRO, max_tokens_per_microbatch=0):
                exp = sk.experience(mb)
                policy_loss, _ = loss_fn(logp[mb["row"]], exp.action_log_probs, exp.advantages, config=algorithm, loss_mask=exp.loss_mask)
                rank_loss = rank_loss + policy_loss * DP  # the worker's policy_loss * dp_size (KL and entropy off)
            rank_losses.append(rank_loss)
        total = total + torch.stack(rank_losses).mean()  # FSDP averages the ranks' gradients
    return total


def per_token_loss(sk, logp, old, advantages, algorithm):
    """SkyRL's PPO loss of each token, written out (ppo_policy_loss before reduce_loss), with SkyRL's float32 exponential."""
    ratio = sk.exp(logp - old, clip=20.0, out_dtype=logp.dtype)
    loss = -torch.min(ratio * advantages, ratio.clamp(1 - algorithm.eps_clip_low, 1 + algorithm.eps_clip_high) * advantages)
    if algorithm.policy_loss_type == "dual_clip":
        loss = torch.where(advantages < 0, torch.min(loss, -advantages * algorithm.clip_ratio_c), loss)
    return loss


def served(step_wise):
    return [m for m, spec in lossagg.MODES.items() if step_wise or not spec.needs_sessions]


def mode_config(mode, step_wise, empty_samples):
    settings = {"mode": mode, "empty_samples": empty_samples, **lossagg.MODES[mode].example_settings}
    spec = lossagg.MODES[mode]
    if spec.needs_groups and (not step_wise or spec.needs_sessions):  # step-wise, a prompt holds any number of turns
        settings["n_samples_per_prompt"] = N_PER_PROMPT[step_wise]
    return lossagg.LossAggregationConfig.from_dict(settings)


CASES = [(sw, mode) for sw in (False, True) for mode in served(sw)]


@pytest.mark.parametrize("policy_loss_type", ["regular", "dual_clip"])
@pytest.mark.parametrize("empty_samples", ["count", "skip"])
@pytest.mark.parametrize("step_wise, mode", CASES, ids=[f"{'stepwise' if sw else 'rows'}-{m}" for sw, m in CASES])
def test_skyrls_step_has_the_gradient_of_j(sk, monkeypatch, step_wise, mode, empty_samples, policy_loss_type):
    config = mode_config(mode, step_wise, empty_samples)
    cfg = skyrl_cfg(sk, step_wise, policy_loss_type=policy_loss_type)
    trainer, data, prompts, sessions = driver_step(sk, monkeypatch, cfg, config)
    if step_wise:  # the trajectories survived SkyRL's pops
        assert data.metadata[TRAJECTORY_KEY][: len(sessions)] == sessions.tolist()
    boundaries = data.metadata["policy_mini_batch_boundaries"]
    assert len(boundaries) == 2
    advantages, loss_mask, old = data["advantages"].clone(), data["loss_mask"], data["action_log_probs"]
    g = torch.Generator().manual_seed(2)
    start_logp = old + 0.8 * torch.randn(old.shape, generator=g, dtype=torch.float64)  # some ratios past the clip range

    by_skyrl = start_logp.clone().requires_grad_(True)
    skyrl_j = skyrl_policy_step(sk, trainer, data, by_skyrl)
    skyrl_j.backward()

    by_reference = start_logp.clone().requires_grad_(True)
    j = torch.zeros((), dtype=torch.float64)
    for start, end in boundaries:  # each mini-batch is one step: J of its rows, by the mode's own formula
        rows = slice(start, end)
        values = per_token_loss(sk, by_reference[rows], old[rows], advantages[rows], cfg.trainer.algorithm)
        n, width = values.shape
        cu = torch.arange(n + 1) * width
        j = j + reference_loss(config, values.reshape(-1), loss_mask[rows].reshape(-1), cu, prompts[rows], session_index=sessions[rows])
    j.backward()

    # SkyRL's advantages are float32: the route through them is J to float32 rounding
    torch.testing.assert_close(skyrl_j, j, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(by_skyrl.grad, by_reference.grad, rtol=1e-5, atol=1e-8)
    assert by_reference.grad.abs().max() > 1e-3


@pytest.mark.parametrize("step_wise", [False, True], ids=["rows", "stepwise"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "zscore"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_skyrls_own_loss_reduction_gives_skyrls_advantages(sk, monkeypatch, reduction, normalize, step_wise):
    cfg = skyrl_cfg(sk, step_wise, loss_reduction=reduction, advantage_batch_normalize=normalize)
    trainer, data, _, _ = driver_step(sk, monkeypatch, cfg)  # no lossagg config: SkyRL's loss_reduction, mapped
    args = (data.metadata["policy_mini_batch_boundaries"], data.metadata["policy_prompt_boundaries"])
    theirs = sk.trainer.RayPPOTrainer._normalize_advantages(trainer, copy.deepcopy(data), *args)["advantages"]
    ours = trainer._normalize_advantages(data, *args)["advantages"]
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=4e-7, atol=0.0)  # a·(1/d) against a/d: two float32 roundings


def test_a_trajectory_weighs_once_under_session_mean_where_skyrl_weighs_its_turns(sk, monkeypatch):
    """Step-wise, SkyRL's sequence_mean is a mean over turn rows: the first mini-batch's 3-turn trajectory holds 3/8 of it;
    session_mean gives each of its 4 trajectories 1/4 (the number in docs/trainers/skyrl.md)."""
    shares = {}
    for name, given in (("sequence_mean", None), ("session_mean", {"mode": "session_mean"})):
        cfg = skyrl_cfg(sk, True, loss_reduction="sequence_mean")
        trainer, data, _, sessions = driver_step(sk, monkeypatch, cfg, given)
        raw, mask = data["advantages"].clone(), data["loss_mask"]
        scaled = trainer._normalize_advantages(data, data.metadata["policy_mini_batch_boundaries"], None)["advantages"]
        start, end = data.metadata["policy_mini_batch_boundaries"][0]
        weight = torch.where(mask[start:end] != 0, scaled[start:end] / raw[start:end], 0.0).sum(dim=1)  # M[i] / d[i]: each turn's share
        shares[name] = [round(float(weight[sessions[start:end] == s].sum()), 6) for s in sessions[start:end].unique().tolist()]
    assert shares == {"sequence_mean": [0.375, 0.125, 0.25, 0.25], "session_mean": [0.25, 0.25, 0.25, 0.25]}


REFUSALS = [
    (
        {"loss_reduction": "token_mean_legacy"},
        None,
        "trainer.algorithm.loss_reduction='token_mean_legacy': mode 'token_mean_legacy' is not supported",
    ),
    ({"loss_reduction": "seq_mean_token_sum_norm", "max_seq_len": None}, None, "divides by trainer.algorithm.max_seq_len, which is not set"),
    (
        {},
        {"mode": "token_mean", "terms": {"entropy": {"coefficient": -0.01}}},
        "each micro-batch's token mean, which changes with the micro-batch split",
    ),
    ({}, {"mode": "sample_mean", "weighting": "multiply"}, "weighting=multiply needs per-sample weights, which SkyRL's batch does not carry"),
    (
        {},
        {"mode": "session_mean"},
        "mode=session_mean weighs each session (multi-turn trajectory) once and needs each sample's session, which SkyRL's",
    ),
    ({"policy_loss_type": "clip_cov"}, None, "policy_loss_type='clip_cov' picks the tokens it clips from the micro-batch's covariance"),
    ({"policy_loss_type": "kl_cov"}, None, "policy_loss_type='kl_cov' adds a KL penalty, which holds no advantage"),
    ({"policy_loss_type": "cross_entropy"}, None, "policy_loss_type='cross_entropy' holds no advantage"),
    ({"policy_loss_type": "my_loss"}, None, "policy_loss_type='my_loss' is not one of SkyRL 0.4.0's policy losses whose per-token loss scales"),
]

REFUSAL_IDS = ["token_mean_legacy", "max_seq_len", "terms", "weighting", "session_mean", "clip_cov", "kl_cov", "cross_entropy", "unknown_loss"]


@pytest.mark.parametrize("algorithm, given, message", REFUSALS, ids=REFUSAL_IDS)
def test_refused_by_name_when_the_trainer_is_built(sk, algorithm, given, message):
    cfg = skyrl_cfg(sk, False, **algorithm)
    with pytest.raises(SkyRLConfigError, match="lossagg cannot serve this SkyRL trainer") as err:
        lossagg_trainer(sk.trainer.RayPPOTrainer)(cfg, None, None, None, None, None, loss_aggregation=given)  # before SkyRL builds anything
    assert message in str(err.value)


def test_every_problem_in_one_error_and_a_loss_of_your_own(sk, monkeypatch):
    cfg = skyrl_cfg(sk, False, policy_loss_type="kl_cov")
    with pytest.raises(SkyRLConfigError) as err:
        lossagg_trainer(sk.trainer.RayPPOTrainer)(
            cfg, None, None, None, None, None, loss_aggregation={"mode": "session_mean", "weighting": "multiply"}
        )
    assert [line.split(" ")[1].split("=")[0] for line in str(err.value).splitlines()[1:]] == [
        "trainer.algorithm.policy_loss_type",
        "weighting",
        "mode",
    ]
    # SkyRL's own names of its losses are the registry's: a loss registered under another name is declared by the user
    assert set(sk.losses.list_available()) >= {"regular", "dual_clip", "gspo", "cispo", "sapo", "clip_cov", "kl_cov", "cross_entropy"}
    cfg = skyrl_cfg(sk, False, policy_loss_type="my_loss")
    monkeypatch.setattr(sk.trainer, "configure_ray_worker_logging", lambda: None)
    trainer = lossagg_trainer(sk.trainer.RayPPOTrainer, extra_policy_losses=("my_loss",))(cfg, None, None, None, None, None)
    assert trainer.lossagg_config.mode == "token_mean" and type(trainer).__name__ == "LossaggRayPPOTrainer"
