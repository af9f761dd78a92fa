"""lossagg.integrations.slime's planning and launch checks without slime itself (its train step is
tests/test_slime_train.py): the rollout table of ``plan_rollout`` on one process, with fan-out
rollouts, slime's schedule read for the steps, and the refusals of a malformed rollout; ``configure``
on a Namespace holding the attributes slime's parse_args leaves."""

from __future__ import annotations

import pytest
import torch
from seed_train import launch_args

from lossagg import LossAggregationConfig, StepPlan
from lossagg.config import ConfigError
from lossagg.integrations import slime as adapter


def slime_args(mode="prompt_mean", n=2, gbs=4, **more):
    """What slime's parse_args leaves for these flags (tests/seed_train.py, and slime's own attributes)."""
    return launch_args(
        mode,
        n,
        gbs,
        **{
            **dict(
                rollout_batch_size=4,
                rollout_data_postprocess_path=None,
                entropy_coef=0.0,
                use_kl_loss=False,
                kl_loss_coef=0.0,
                use_tis=False,
                get_mismatch_metrics=False,
                advantage_estimator="grpo",
                allgather_cp=False,
            ),
            **more,
        },
    )


def rollout_data(masks, rollout_ids, indices, schedule, num_microbatches, batch_sizes, prompts=None):
    prompts = prompts or [[1, 2]] * len(masks)
    return {
        "partition": list(range(len(masks))),
        "loss_masks": [torch.tensor(m, dtype=torch.int32) for m in masks],
        "rollout_ids": rollout_ids,
        "sample_indices": indices,
        "tokens": [torch.tensor(p + [5] * len(m)) for p, m in zip(prompts, masks, strict=True)],
        "total_lengths": [len(p) + len(m) for p, m in zip(prompts, masks, strict=True)],
        "response_lengths": [len(m) for m in masks],
        "micro_batch_indices": schedule,
        "num_microbatches": num_microbatches,
        "global_batch_sizes": batch_sizes,
        "rollout_mask_sums": torch.zeros(len(masks)),
    }


# two steps of 4 rollouts each (2 groups of 2); rollouts 1 and 5 emit two training samples, rollout 2 none with a token
MASKS = [[1, 1], [1, 0, 1], [1], [0, 0], [1, 1, 1], [1], [1, 1], [1], [1, 0], [1, 1]]
ROLLOUTS = [0, 1, 1, 2, 3, 4, 5, 5, 6, 7]
INDICES = ROLLOUTS  # sample.index: group r // n
SCHEDULE = [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]


def test_a_rollout_is_a_sample_and_every_step_is_planned():
    for mode in ("sample_mean", "prompt_mean", "token_mean", "max_length"):
        args = slime_args(mode, gbs=4)
        adapter.configure(args)
        data = rollout_data(MASKS, ROLLOUTS, INDICES, SCHEDULE, [2, 2], [4, 4])
        planned = adapter.plan_rollout(args, data, dp_group="unused")
        for step, rollouts in enumerate(([0, 1, 2, 3], [4, 5, 6, 7])):
            samples = [j for j, r in enumerate(ROLLOUTS) if r in rollouts]
            counts = torch.tensor([sum(sum(MASKS[j]) for j in samples if ROLLOUTS[j] == r) for r in rollouts])
            groups = torch.tensor([r // 2 for r in rollouts]) - rollouts[0] // 2
            want = StepPlan(LossAggregationConfig(mode=mode, n_samples_per_prompt=2), counts, group_index=groups).sample_denoms
            got = planned.denoms("pg")[samples]
            expected = torch.stack([want[rollouts.index(ROLLOUTS[j])] for j in samples])
            assert torch.equal(got, expected), (mode, step)
            # slime's outer divisor: its rollouts; token_mean takes slime's per-token path, Σ max(M[j], 1) over training samples
            assert planned.scales[step] == ([9, 7][step] if mode == "token_mean" else 4)
        # slime's own reducer (under TIS) reads the rollouts' totals of the planned masks
        assert data["rollout_mask_sums"].tolist() == [2, 3, 3, 0, 3, 1, 3, 3, 1, 2]
        assert planned.find([data["loss_masks"][j] for j in (5, 6)]) == (1, [5, 6])
    legacy = slime_args(None, gbs=4, calculate_per_token_loss=True)  # the legacy flag alone is slime's own: nothing wired
    assert adapter.configure(legacy) is None


def test_a_malformed_rollout_is_refused_by_name():
    args = slime_args("prompt_mean", gbs=4)
    adapter.configure(args)
    with pytest.raises(RuntimeError, match="step 0 holds 4 rollouts over the DP ranks, slime divides it by global_batch_size 3"):
        adapter.plan_rollout(args, rollout_data(MASKS, ROLLOUTS, INDICES, SCHEDULE, [2, 2], [3, 4]), dp_group="unused")
    with pytest.raises(RuntimeError, match="some sample is in no step"):
        adapter.plan_rollout(args, rollout_data(MASKS, ROLLOUTS, INDICES, SCHEDULE[:3], [2, 1], [4, 4]), dp_group="unused")
    bad = list(INDICES)
    bad[2] = 4  # the second training sample of rollout 1 says another prompt group
    with pytest.raises(ValueError, match="rollout 1 has training samples of prompt groups 0 and 2"):
        adapter.plan_rollout(args, rollout_data(MASKS, ROLLOUTS, bad, SCHEDULE, [2, 2], [4, 4]), dp_group="unused")
    prompts = [[1, 2]] * len(MASKS)
    prompts[3] = [9, 9]  # rollout 2's prompt differs from rollout 3's, its group's
    with pytest.raises(ValueError, match="rollouts of prompt group 1 .* have different prompts"):
        adapter.plan_rollout(args, rollout_data(MASKS, ROLLOUTS, INDICES, SCHEDULE, [2, 2], [4, 4], prompts), dp_group="unused")
    weights = [list(m) for m in MASKS]
    weights[4] = [1, 2, 1]
    with pytest.raises(ValueError, match="loss mask of rollout sample 4 is not 0/1"):
        adapter.plan_rollout(args, rollout_data(weights, ROLLOUTS, INDICES, SCHEDULE, [2, 2], [4, 4]), dp_group="unused")
    with pytest.raises(RuntimeError, match="was not configured by lossagg"):
        adapter.plan_rollout(slime_args(), rollout_data(MASKS, ROLLOUTS, INDICES, SCHEDULE, [2, 2], [4, 4]), dp_group="unused")


def test_configure_checks_the_terms_against_slimes_policy_loss():
    args = slime_args("prompt_mean", loss_aggregation_term=["entropy:-0.01:token_mean"], entropy_coef=0.01)
    config = adapter.configure(args)
    assert config.terms["entropy"].mode == "token_mean" and args.loss_type == "custom_loss"
    assert args.custom_pg_loss_reducer_function_path == adapter.HOOKS["custom_pg_loss_reducer_function_path"]
    refusals = {
        "--use-kl-loss": slime_args(loss_aggregation_term=["kl:0.1"]),
        "applies -entropy_coef = -0.02": slime_args(loss_aggregation_term=["entropy:-0.01"], entropy_coef=0.02),
        "'nll'": slime_args(loss_aggregation_term=["nll:1"]),
        "rebuild its reducer": slime_args(loss_aggregation_term=["entropy:-0.01"], entropy_coef=0.01, use_tis=True),
        "--advantage-estimator ppo": slime_args(advantage_estimator="ppo"),
        "--loss-type sft_loss": slime_args(loss_type="sft_loss"),
    }
    for needle, bad in refusals.items():
        with pytest.raises(ConfigError, match=needle):
            adapter.configure(bad)
        assert getattr(bad, "lossagg_config", None) is None  # nothing wired
    # --allgather-cp: slime hands the loss the zigzag layout either way (tests/test_slime_train.py trains under it)
    assert adapter.configure(slime_args("prompt_mean", allgather_cp=True)).mode == "prompt_mean"
    # a custom loss reduces its own terms through reducer.term(name): no names checked
    custom = slime_args(loss_type="custom_loss", custom_loss_function_path="my.loss", loss_aggregation_term=["aux:0.5"])
    assert adapter.configure(custom).terms["aux"].coefficient == 0.5 and custom.lossagg_inner_loss == "my.loss"
    # the user's postprocess is kept and called first
    user = slime_args(rollout_data_postprocess_path="my.post")
    adapter.configure(user)
    assert user.lossagg_user_rollout_data_postprocess_path == "my.post"
    assert user.rollout_data_postprocess_path == adapter.HOOKS["rollout_data_postprocess_path"]
    # no lossagg flag: nothing wired
    plain = slime_args(mode=None)
    assert adapter.configure(plain) is None and plain.loss_type == "policy_loss"


@pytest.mark.parametrize(
    ("case", "change", "message"),
    [
        ("one batch size for two steps", dict(batch_sizes=[4]), r"global_batch_sizes for 1 step\(s\), its schedule \(num_microbatches\) runs 2"),
        ("rollout_ids short", dict(rollout_ids=ROLLOUTS[:-1]), r"rollout_data\['rollout_ids'\] holds 9 entries for this rank's 10 samples"),
        ("sample_indices short", dict(indices=INDICES[:-2]), r"rollout_data\['sample_indices'\] holds 8 entries"),
        ("a micro-batch names sample 99", dict(schedule=[[0, 1], [2, 3, 4], [5, 6, 99], [8, 9]]), r"micro_batch_indices'\] names sample 99"),
        ("string rollout ids", dict(rollout_ids=["r"] * 10), r"rollout_data\['rollout_ids'\] must hold integers .* got 'r'"),
    ],
    ids=lambda c: c if isinstance(c, str) else "",
)
def test_malformed_rollout_data_is_named(case, change, message):
    args = slime_args("prompt_mean", gbs=4)
    adapter.configure(args)
    parts = dict(masks=MASKS, rollout_ids=ROLLOUTS, indices=INDICES, schedule=SCHEDULE, num_microbatches=[2, 2], batch_sizes=[4, 4])
    parts.update(change)
    with pytest.raises(ValueError, match=message):
        adapter.plan_rollout(args, rollout_data(**parts), dp_group="unused")


def test_the_reducer_names_a_scheduled_term_the_loss_reduced_on_its_own():
    """A policy loss that reports kl_loss from a reduction of its own (its reducer called for the metrics only)
    never reduced the config's kl term on its mode: named, not passed."""
    from lossagg.integrations import seed

    config = LossAggregationConfig.from_dict({"mode": "sample_mean", "terms": {"kl": {"coefficient": 0.1, "mode": "token_mean"}}})
    masks = [torch.ones(2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)]
    planned = seed.PlannedSamples(masks, [0, 0], [0, 1], [StepPlan(config, torch.tensor([2, 1]))], [2], False, "--hook")
    reducer = planned.reducer(masks, lambda m: seed.layout_of(masks if m is None else m), seed.POLICY_LOSS_CALLS, "slime")
    x = torch.ones(3)
    reported = {"pg_clipfrac": reducer(x), "ppo_kl": reducer(x), "kl_loss": (x * 0.5).mean()}
    with pytest.raises(RuntimeError, match="reported kl_loss without calling its reducer for kl"):
        reducer.check_reported(reported)
    reducer = planned.reducer(masks, lambda m: seed.layout_of(masks if m is None else m), seed.POLICY_LOSS_CALLS, "slime")
    reported = {"pg_clipfrac": reducer(x), "ppo_kl": reducer(x), "entropy_loss": reducer(x), "kl_loss": reducer(x)}
    reducer.check_reported(reported)  # every scheduled call made, in order
