"""The launch checks of lossagg.integrations.miles (``configure``), on parsed arguments as miles leaves
them (an ``argparse.Namespace`` with miles' derived ``global_batch_size``), over the grid of mode ×
``--calculate-per-token-loss`` × divisor × ``--n-samples-per-prompt`` × ``global_batch_size``; and the
hooks it wires. The expected outcome of each point is written out below from the rules in
docs/trainers/miles.md, independently of lossagg's config code. miles itself is not needed
here; tests/test_miles_train.py runs the same checks through miles' own ``parse_args``.
"""

from __future__ import annotations

import argparse
import copy

import pytest
from seed_train import launch_args
from tiers import grid

from lossagg import ConfigError
from lossagg.integrations import miles as adapter

MODES = (None, "sample_mean", "prompt_mean", "token_mean", "constant", "max_length")
DIVISORS = (None, 4.0, 0.0, -1.0)
N_PER_PROMPT = (0, 1, 4)
BATCH = (10, 16)


def miles_args(mode=None, per_token=False, divisor=None, n=4, gbs=16, **more):
    """What miles' parse_args leaves for these flags (tests/seed_train.py, and miles' own attributes)."""
    hooks = {"custom_megatron_before_train_step_hook_path": None, "rollout_batch_size": 8}
    return launch_args(mode, n, gbs, **{**hooks, "loss_aggregation_divisor": divisor, "calculate_per_token_loss": per_token, **more})


def expected_refusals(mode, per_token, divisor, n, gbs):
    """The flags a launch must be refused for (empty: accepted), read from the rules."""
    if mode is None and divisor is None:
        return None  # no lossagg flag: nothing is checked, nothing wired
    resolved = mode if mode is not None else ("token_mean" if per_token else "sample_mean")
    bad = set()
    if n < 1:
        bad.add("--n-samples-per-prompt")
    if per_token and resolved != "token_mean":
        bad.add("--calculate-per-token-loss")
    if divisor is not None and divisor <= 0:
        bad.add("--loss-aggregation-divisor")
    elif resolved == "constant" and divisor is None:
        bad.add("--loss-aggregation-divisor")
    elif resolved != "constant" and divisor is not None:
        bad.add("--loss-aggregation-divisor")
    if resolved == "prompt_mean" and n >= 1 and gbs % n != 0:
        bad.add("--global-batch-size")
    return bad


# every pair of values in the default tier, the product in the full one (tests/tiers.py)
GRID = grid(MODES, (False, True), DIVISORS, N_PER_PROMPT, BATCH)


@pytest.mark.parametrize("mode,per_token,divisor,n,gbs", GRID)
def test_launch_grid(mode, per_token, divisor, n, gbs):
    args = miles_args(mode, per_token, divisor, n, gbs)
    before = copy.deepcopy(vars(args))
    want = expected_refusals(mode, per_token, divisor, n, gbs)
    if want is None:
        assert adapter.configure(args) is None
        assert vars(args) == before, "a launch without lossagg flags must be left as miles parsed it"
        return
    if want:
        with pytest.raises(ConfigError) as info:
            adapter.configure(args)
        named = {path for path, _ in info.value.issues}
        assert want <= named, f"refusal names {named}, expected at least {want}: {info.value}"
        assert named <= want | {"--loss-aggregation"}, f"refusal names {named} beyond {want}: {info.value}"
        text = str(info.value)
        if "--n-samples-per-prompt" in want:
            assert f"got {n}" in text
        if "--global-batch-size" in want:
            assert f"({gbs})" in text and f"({n})" in text
        if "--loss-aggregation-divisor" in want and divisor is not None and divisor <= 0:
            assert str(divisor) in text or "greater than 0" in text
        assert vars(args) == before, "a refused launch must not be half-configured"
        return
    config = adapter.configure(args)
    resolved = mode if mode is not None else ("token_mean" if per_token else "sample_mean")
    assert config.mode == resolved
    assert args.calculate_per_token_loss is (resolved == "token_mean")
    assert args.loss_type == "custom_loss"
    for name, path in adapter.HOOKS.items():
        assert getattr(args, name) == path
    assert args.lossagg_inner_loss == "policy_loss"
    assert args.lossagg_config["mode"] == resolved
    # a second call (a hook re-checking) changes nothing
    again = copy.deepcopy(vars(args))
    assert adapter.configure(args).mode == resolved
    assert vars(args) == again


def test_seed_pr_cases_refused_after_miles_derives_the_batch():
    # --rollout-batch-size 8 --n-samples-per-prompt 4 --num-steps-per-rollout 3: a step of 10 samples
    args = miles_args("prompt_mean", n=4, gbs=10, num_steps_per_rollout=3)
    with pytest.raises(ConfigError, match=r"--global-batch-size.*\(10\).*--num-steps-per-rollout 3"):
        adapter.configure(args)
    with pytest.raises(ConfigError, match=r"--n-samples-per-prompt.*got 0"):
        adapter.configure(miles_args("prompt_mean", n=0, gbs=0))


def test_hooks_chained_or_refused():
    # the user's own before-train-step hook runs after lossagg's
    args = miles_args("sample_mean", custom_megatron_before_train_step_hook_path="my.hooks.before_step")
    adapter.configure(args)
    assert args.custom_megatron_before_train_step_hook_path == adapter.HOOKS["custom_megatron_before_train_step_hook_path"]
    assert args.lossagg_user_before_train_step_hook_path == "my.hooks.before_step"
    # a custom loss is wrapped, not replaced
    args = miles_args("token_mean", loss_type="custom_loss", custom_loss_function_path="my.losses.loss")
    adapter.configure(args)
    assert args.lossagg_inner_loss == "my.losses.loss" and args.custom_loss_function_path == adapter.HOOKS["custom_loss_function_path"]
    # two reducers of pg_loss, or a loss without one, are refused by name
    with pytest.raises(ConfigError, match="--custom-pg-loss-reducer-function-path my.reducer"):
        adapter.configure(miles_args("sample_mean", custom_pg_loss_reducer_function_path="my.reducer"))
    with pytest.raises(ConfigError, match="--loss-type sft_loss"):
        adapter.configure(miles_args("sample_mean", loss_type="sft_loss"))


def test_config_file(tmp_path):
    path = tmp_path / "agg.yaml"
    path.write_text("loss_aggregation:\n  mode: prompt_mean\n  empty_samples: skip\n")
    args = miles_args(loss_aggregation_config=str(path))
    config = adapter.configure(args)
    assert (config.mode, config.empty_samples, config.n_samples_per_prompt, config.global_batch_size) == ("prompt_mean", "skip", 4, 16)
    with pytest.raises(ConfigError, match="--loss-aggregation-config .* and --loss-aggregation both given"):
        adapter.configure(miles_args("sample_mean", loss_aggregation_config=str(path)))
    # a file's terms are miles' entropy and KL, with miles' coefficients; anything else is refused, nothing wired
    path.write_text("mode: sample_mean\nterms:\n  entropy: {coefficient: -0.01, mode: token_mean}\n")
    config = adapter.configure(miles_args(loss_aggregation_config=str(path), entropy_coef=0.01))
    assert (config.terms["entropy"].mode, config.terms["entropy"].coefficient) == ("token_mean", -0.01)
    args = miles_args(loss_aggregation_config=str(path), entropy_coef=0.02)
    with pytest.raises(
        ConfigError, match=r"--loss-aggregation-config: term 'entropy' has coefficient -0.01, miles-rl 0.0.2 applies -entropy_coef = -0.02"
    ):
        adapter.configure(args)
    assert getattr(args, "lossagg_config", None) is None
    # refused by name (a file's kl term on a launch without --use-kl-loss blamed on the file, the flag the launch used)
    for text, named in (
        ("mode: prompt_mean\nglobal_batch_size: 12\n", "--global-batch-size.*sets global_batch_size: 12.*16"),
        ("mode: constant\n", "divisor"),
        (
            "mode: sample_mean\nterms:\n  kl: {coefficient: 0.1}\n",
            "--loss-aggregation-config: term 'kl': miles-rl 0.0.2 adds its KL term under --use-kl-loss",
        ),
        ("mode: sample_mean\nterms:\n  nll: {coefficient: 1.0}\n", "term 'nll': miles-rl 0.0.2's policy_loss_function reduces the terms entropy, kl"),
        ("mode: sample_mean\nweighting: multiply\n", "weighting=multiply needs per-sample weights"),
    ):
        path.write_text(text)
        with pytest.raises(ConfigError, match=named):
            adapter.configure(miles_args(loss_aggregation_config=str(path)))


def test_flags_added_to_a_parser_without_miles_own():
    parser = adapter.add_arguments(argparse.ArgumentParser())
    ns = parser.parse_args(["--loss-aggregation", "constant", "--loss-aggregation-divisor", "8", "--loss-aggregation-empty-samples", "skip"])
    assert (ns.loss_aggregation, ns.loss_aggregation_divisor, ns.loss_aggregation_empty_samples) == ("constant", 8.0, "skip")
    for flag in ("--calculate-per-token-loss", "--n-samples-per-prompt", "--global-batch-size"):
        assert flag not in parser._option_string_actions, f"{flag} is miles' own flag"
    assert "--loss-aggregation-term" in parser._option_string_actions  # entropy and KL are the config's terms (docs/terms.md)


def test_hooks_refuse_a_launch_lossagg_did_not_configure():
    with pytest.raises(RuntimeError, match="configure"):
        adapter.loss_function(miles_args("sample_mean"), {}, None, None)
    with pytest.raises(RuntimeError, match="inside lossagg.integrations.miles.loss_function"):
        adapter.pg_loss_reducer([], [], [], False)


# ------------------------------------------------------------- the step's plan, without miles
class FakeIterator:
    """The fields of miles' DataIterator that plan_step reads."""

    def __init__(self, rollout, micro_batch_size=None, micro_batch_indices=None, offset=0):
        self.rollout_data = rollout
        self.micro_batch_size = micro_batch_size
        self.micro_batch_indices = micro_batch_indices
        self.offset = offset


def one_rank():
    from types import SimpleNamespace

    return SimpleNamespace(intra_dp=SimpleNamespace(rank=0, size=1, group=None))


def rollout_of(masks, prompts=None, indices=None):
    import torch

    prompts = prompts or [[1, 2]] * len(masks)
    return {
        "loss_masks": [torch.tensor(m, dtype=torch.int) for m in masks],
        "tokens": [torch.tensor(p + [5] * len(m)) for p, m in zip(prompts, masks, strict=True)],
        "total_lengths": [len(p) + len(m) for p, m in zip(prompts, masks, strict=True)],
        "response_lengths": [len(m) for m in masks],
        "sample_indices": list(range(len(masks))) if indices is None else indices,
    }


def configured(mode, n=2, gbs=4, **more):
    args = miles_args(mode, n=n, gbs=gbs, **more)
    adapter.configure(args)
    return args


def test_plan_step_denominators_and_refusals():
    import torch

    from lossagg import LossAggregationConfig, StepPlan

    masks = [[1, 1, 0], [0, 0], [1], [1, 1, 1, 1]]
    for mode in ("sample_mean", "prompt_mean", "token_mean", "max_length"):
        args = configured(mode)
        step = adapter.plan_step(args, FakeIterator(rollout_of(masks), micro_batch_size=2), 2, parallel_state=one_rank())
        counts = torch.tensor([2, 0, 1, 4])
        want = StepPlan(LossAggregationConfig(mode=mode, n_samples_per_prompt=2), counts, group_index=torch.tensor([0, 0, 1, 1])).sample_denoms
        assert torch.equal(step.denoms("pg"), want), mode
        # miles' outer divisor: global_batch_size, or on the per-token path (token_mean) the sum of max(M[i], 1)
        assert step.scales == [2 + 1 + 1 + 4 if mode == "token_mean" else 4], mode
    # the dynamic schedule: the micro-batches of this step, whatever their order
    args = configured("sample_mean")
    it = FakeIterator(rollout_of(masks * 2), micro_batch_indices=[[3, 0], [1, 2], [7, 4], [5, 6]], offset=2)
    step = adapter.plan_step(args, it, 2, parallel_state=one_rank())
    _, rows = step.find([it.rollout_data["loss_masks"][j] for j in (6, 7)])
    assert step.denoms("pg")[rows].tolist() == [4 * 1, 4 * 4] and step.denoms("metric")[rows].tolist() == [4 * 1, 4 * 4]  # the default reducer's too
    with pytest.raises(RuntimeError, match="sample 0 of this micro-batch is not one of the samples planned"):
        step.find([it.rollout_data["loss_masks"][0]])
    with pytest.raises(ValueError, match="loss mask of rollout sample 1 is not 0/1"):
        adapter.plan_step(args, FakeIterator(rollout_of([[1], [3, -1], [1], [1]]), micro_batch_size=4), 1, parallel_state=one_rank())
    with pytest.raises(RuntimeError, match="4 samples, times 1 DP ranks is not global_batch_size 8"):
        adapter.plan_step(configured("sample_mean", gbs=8), FakeIterator(rollout_of(masks), micro_batch_size=4), 1, parallel_state=one_rank())
    args = configured("prompt_mean")
    with pytest.raises(ValueError, match="sample_indices"):
        adapter.plan_step(args, FakeIterator({**rollout_of(masks), "sample_indices": None}, micro_batch_size=4), 1, parallel_state=one_rank())
    with pytest.raises(ValueError, match="prompt group 1 .* different prompts"):
        adapter.plan_step(args, FakeIterator(rollout_of(masks, prompts=[[1], [1], [2], [3]]), micro_batch_size=4), 1, parallel_state=one_rank())
    with pytest.raises(ValueError, match="n_samples_per_prompt|group"):
        adapter.plan_step(args, FakeIterator(rollout_of(masks, indices=[0, 1, 2, 4]), micro_batch_size=4), 1, parallel_state=one_rank())


def test_before_train_step_outside_miles_train_one_step():
    with pytest.raises(RuntimeError, match="plan_step"):
        adapter.before_train_step(configured("sample_mean"), 0, 0, None, None, None)


def test_a_session_mode_is_refused_naming_it():
    # miles-rl 0.0.2's training data holds no per-sample trajectory id (docs/modes.md, "Sessions")
    with pytest.raises(
        ConfigError, match=r"--loss-aggregation: mode=session_token_mean weighs each session .* which miles-rl 0.0.2's step hook does not carry"
    ):
        adapter.configure(miles_args("session_token_mean"))


def test_the_fsdp_backend_is_refused_naming_the_flag():
    # miles-rl 0.0.2's FSDP actor never calls the before-train-step hook that plans each step
    with pytest.raises(
        ConfigError, match=r"--train-backend fsdp: miles-rl 0.0.2's fsdp actor never calls --custom-megatron-before-train-step-hook-path"
    ):
        adapter.configure(miles_args("sample_mean", train_backend="fsdp"))
    assert adapter.configure(miles_args("sample_mean", train_backend="megatron")).mode == "sample_mean"
