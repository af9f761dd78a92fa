"""``--loss-aggregation`` for miles (radixark's ``miles-rl`` 0.0.2), through the hooks it already has; nothing
of miles is patched. One line in the launcher (miles' ``train.py``): ``from lossagg.integrations.miles import
parse_args`` in place of miles'. It checks the launch and wires three hooks: the before-train-step hook plans
each step (:func:`plan_step`: one sum all-reduce over the DP group), the custom loss runs miles'
``policy_loss_function`` with the micro-batch's :class:`lossagg.integrations.seed.TermReducer`, and the pg_loss
reducer reduces pg_loss on the mode. docs/trainers/miles.md is the user's page: the scaling, TIS/RS, what is
refused and why.
"""

from __future__ import annotations

import sys
from importlib import import_module

import torch

from lossagg.config import ConfigError, LossAggregationConfig
from lossagg.deferred import DeferredPlan, DeferredStep
from lossagg.integrations import seed, session_refusal
from lossagg.modes import MODES
from lossagg.step import StepPlan

MILES_VERSION = "0.0.2"  # the miles-rl release this adapter was read against and is tested with

#: The hook paths this module sets (``load_function`` spells a function ``module.name``).
HOOKS = {
    "custom_megatron_before_train_step_hook_path": f"{__name__}.before_train_step",
    "custom_loss_function_path": f"{__name__}.loss_function",
    "custom_pg_loss_reducer_function_path": f"{__name__}.pg_loss_reducer",
}
HOOK = "--custom-megatron-before-train-step-hook-path"  # where each step is planned
CONFIG_FLAG = seed.CONFIG_FLAG
LOSSAGG_FLAGS = seed.LAUNCH_FLAGS
#: What miles' rebuilt reducer (under TIS) divides by, for the refusals.
REBUILT = "each sample by its kept tokens, the modified mask's sum"


# ----------------------------------------------------------------------- launch
# parse_args (in place of miles's own), add_arguments (lossagg's flags) and config_of (a parsed launch's config)
parse_args, add_arguments, config_of = seed.Launch("miles", "miles.utils.arguments", extra=(seed.DENOMS_FLAG,)).functions(
    lambda args: configure(args)
)
TIS_FLAGS = (("--use-tis", "use_tis"), ("--get-mismatch-metrics", "get_mismatch_metrics"))


def configure(args) -> LossAggregationConfig | None:
    """Check a parsed miles launch and wire lossagg's hooks into it (in place; safe to call again); returns the
    config, or None (nothing wired) without a lossagg flag. What is refused, by flag and value, and why:
    docs/trainers/miles.md ("Refused"), the same table the tests derive from these checks."""
    config = config_of(args)
    denoms = getattr(args, seed.dest(seed.DENOMS_FLAG), None)
    if config is None:
        if denoms is not None:
            raise ConfigError(
                [(seed.DENOMS_FLAG, f"{seed.DENOMS_FLAG} {denoms} without --loss-aggregation: name the mode it is for")], "command line"
            )
        return None
    kept = denoms == "kept"
    inner, issues = seed.loss_issues(args, config, HOOKS, f"miles-rl {MILES_VERSION}", REBUILT, kept=kept)
    if kept:
        issues += kept_issues(args, config)
    refused = session_refusal(
        config,
        f"miles-rl {MILES_VERSION}'s step hook",
        "its training data holds no trajectory id per sample: its rollout_id numbers the rollout, not a sample's trajectory",
    )
    if refused:
        issues.append(("--loss-aggregation", refused))
    issues += seed.backend_issues(args, f"miles-rl {MILES_VERSION}'s {{backend}} actor never calls {HOOK}, through which lossagg plans each step")
    if issues:
        raise ConfigError(issues, "command line")
    seed.wire(args, config, HOOKS, inner, "custom_megatron_before_train_step_hook_path", "lossagg_user_before_train_step_hook_path")
    return config


def tis_flag(args) -> str | None:
    """The flag that makes miles run its TIS function inside the policy loss (``--use-tis``, ``--get-mismatch-metrics``), or None."""
    return next((flag for flag, name in TIS_FLAGS if getattr(args, name, False)), None)


def rebuilt_terms(args, config: LossAggregationConfig) -> dict[str, dict]:
    """Under TIS, the terms miles' rebuilt reducer reduces (entropy when its coefficient is not 0, KL under
    ``--use-kl-loss``) as lossagg terms: each sample's mean over its kept tokens (sample_mean), or on the
    per-token path their sum, which Megatron divides by the step's reported tokens (token_mean once the step is
    rescaled to the kept tokens' count)."""
    mode = "token_mean" if config.calculate_per_token_loss else "sample_mean"
    terms = {}
    if getattr(args, "entropy_coef", 0.0):
        terms["entropy"] = {"mode": mode, "coefficient": -float(args.entropy_coef)}
    if getattr(args, "use_kl_loss", False):
        terms["kl"] = {"mode": mode, "coefficient": float(getattr(args, "kl_loss_coef", 0.0))}
    return terms


def kept_issues(args, config: LossAggregationConfig) -> list[tuple[str, str]]:
    """``--loss-aggregation-tis-denominators kept``: every term's d[i] of the kept tokens (TIS/RS's modified masks),
    served by a :class:`lossagg.DeferredPlan` of pg_loss whose rescale after the step also makes miles' rebuilt reducer
    (entropy, KL) the kept tokens' sample_mean or token_mean: the refusals, each with its reason."""
    flag = seed.DENOMS_FLAG
    tis = tis_flag(args)
    if tis is None:
        return [
            (
                flag,
                f"{flag} kept: without --use-tis or --get-mismatch-metrics no filter runs inside miles' loss, so the kept tokens are the rollout's",
            )
        ]
    if getattr(args, "recompute_loss_function", False):
        return [
            (
                flag,
                f"{flag} kept with --recompute-loss-function: miles then runs the loss twice per micro-batch (its forward again in the "
                "backward), while the step's DeferredPlan records each micro-batch's kept tokens once: drop --recompute-loss-function",
            )
        ]
    spec = MODES[config.mode]
    if spec.needs_groups or spec.needs_sessions:
        what = "prompt group" if spec.needs_groups else "session"
        return [
            (
                flag,
                f"{flag} kept with mode={config.mode}: a DeferredPlan reads each {what}'s kept tokens when its micro-batch runs, while miles "
                f"deals a step's samples to the DP ranks one by one (a {what} spans ranks): use {flag} rollout",
            )
        ]
    terms = rebuilt_terms(args, config)
    if not terms:
        return []
    settings = {**config.model_dump(exclude_unset=True, mode="json"), "terms": terms}
    try:
        DeferredPlan(LossAggregationConfig.from_dict(settings), 1)
    except ValueError as exc:  # the terms' step-level factors differ from pg_loss's: one rescale cannot serve both
        return [(flag, f"{flag} kept with {tis} and entropy or KL on, which miles reduces on its rebuilt reducer ({REBUILT}): {exc}")]
    return []


def _trainer_frame():
    """The frame of miles' ``train_one_step`` that called the hook."""
    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            break
        module = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name == "train_one_step" and module.endswith(".backends.megatron_utils.model"):
            return frame
        frame = frame.f_back
    raise RuntimeError(
        "lossagg.integrations.miles.before_train_step reads the step's data iterator from miles' train_one_step "
        f"(miles.backends.megatron_utils.model, miles-rl {MILES_VERSION}), which is not among its callers: call plan_step(args, "
        "data_iterator, num_microbatches) yourself"
    )


def _step_positions(iterator, num_microbatches: int) -> list[int]:
    """This rank's sample positions (in its rollout data) of the next ``num_microbatches`` micro-batches."""
    offset = iterator.offset
    if iterator.micro_batch_indices is not None:
        chosen = iterator.micro_batch_indices[offset : offset + num_microbatches]
        if len(chosen) != num_microbatches:
            raise RuntimeError(f"lossagg: the data iterator holds {len(chosen)} micro-batches from offset {offset}, the step runs {num_microbatches}")
        return [int(j) for mb in chosen for j in mb]
    size = iterator.micro_batch_size
    return list(range(offset, offset + num_microbatches * size))


_STEP: seed.PlannedSamples | None = None


def current_step() -> seed.PlannedSamples | None:
    """The step planned by the last :func:`before_train_step` in this process."""
    return _STEP


def plan_step(args, data_iterator, num_microbatches: int, *, parallel_state=None) -> seed.PlannedSamples:
    """The step's plan from this rank's data iterator, with one sum all-reduce over the DP group of a table with
    one row per sample of the step (its rollout token count, its prompt group, a fingerprint of its prompt).

    ``data_iterator`` is miles' ``DataIterator`` (or the list of them, one per virtual pipeline
    stage) positioned at the step's first micro-batch; ``parallel_state`` is miles'
    ``ParallelState`` (default: miles' ``get_parallel_state()``).
    """
    global _STEP
    config = seed.runtime_config(args, "miles", __name__)
    needs_groups = any(t.spec.needs_groups for t in config.loss_terms)
    iterator = data_iterator[0] if isinstance(data_iterator, (list, tuple)) else data_iterator
    trainer = type(iterator).__module__.split(".")[0]
    if parallel_state is None:
        parallel_state = import_module(f"{trainer}.backends.training_utils.parallel").get_parallel_state()
    rollout = iterator.rollout_data
    seed.check_rollout_lists(rollout, len(rollout["loss_masks"]))
    positions = _step_positions(iterator, num_microbatches)
    masks = [rollout["loss_masks"][j] for j in positions]
    n_local, dp = len(masks), parallel_state.intra_dp
    gbs = rollout.get("dynamic_global_batch_size", args.global_batch_size)
    if n_local * dp.size != gbs:
        raise RuntimeError(f"lossagg: this rank's step holds {n_local} samples, times {dp.size} DP ranks is not global_batch_size {gbs}")
    device = masks[0].device if masks else torch.device("cpu")
    seed.check_zero_one(masks, positions, "miles")
    table = torch.zeros(dp.size * n_local, 3, dtype=torch.int64, device=device)
    rows = slice(dp.rank * n_local, (dp.rank + 1) * n_local)
    if masks:
        table[rows, 0] = torch.stack([(m != 0).sum() for m in masks]).to(device)
    if needs_groups:
        indices = rollout.get("sample_indices")
        if indices is None:
            raise ValueError(
                f"lossagg: mode={config.mode} needs each sample's prompt group, read from the rollout's sample_indices, which this rollout has not"
            )
        prompts = [int(rollout["total_lengths"][j]) - int(rollout["response_lengths"][j]) for j in positions]
        table[rows, 1] = torch.tensor([int(indices[j]) // config.n_samples_per_prompt for j in positions], dtype=torch.int64).to(device)
        table[rows, 2] = torch.tensor([seed.prompt_fingerprint(rollout["tokens"][j], p) for j, p in zip(positions, prompts, strict=True)]).to(device)
    if dp.size > 1:
        torch.distributed.all_reduce(table, group=dp.group)
    table = table.cpu()
    group_index = seed.group_index_of(table[:, 1].tolist(), table[:, 2].tolist(), "miles") if needs_groups else None
    counts = table[:, 0]
    plan = StepPlan(config, counts, group_index=group_index)
    per_token = bool(args.calculate_per_token_loss)
    # miles' outer divisor (module docstring): the step's reported tokens Σ max(M[i], 1) on the per-token path, else its samples
    scale = int(counts.clamp(min=1).sum()) if per_token else gbs
    deferred = None
    if getattr(args, seed.dest(seed.DENOMS_FLAG), None) == "kept" and tis_flag(args):
        deferred = _deferred_plan(config, plan, n_local, scale, per_token, parallel_state)
    _STEP = seed.PlannedSamples(
        masks, [0] * n_local, list(range(rows.start, rows.stop)), [plan], [scale], per_token, HOOK, trainer, deferred=[deferred]
    )
    return _STEP


def _deferred_plan(config: LossAggregationConfig, rollout: StepPlan, n_local: int, scale: int, per_token: bool, parallel_state) -> DeferredPlan:
    """The step's :class:`lossagg.DeferredPlan` of pg_loss over the kept tokens. Until the final counts are known its
    step-level totals are the rollout's, except the one miles itself divides by (``scale``): the reported tokens
    Σ max(M[i], 1) on the per-token path, else the step's samples. With those, the rescale after the step
    (:func:`finish_step`) turns miles' rebuilt reducer (entropy, KL) into the kept tokens' token_mean or sample_mean."""
    estimate = dict(rollout.totals)
    if per_token:
        estimate["total_tokens"] = scale
    else:
        for name in ("num_samples", "num_nonempty_samples"):
            estimate[name] = scale
    dp, cp = parallel_state.intra_dp, parallel_state.cp
    return DeferredPlan(
        config,
        n_local,
        process_group=dp.group if dp.size > 1 else None,
        cp_group=cp.group if cp.size > 1 else None,
        estimate=estimate,
    )


_FINISHED: DeferredStep | None = None


def finished_step() -> DeferredStep | None:
    """What the last step whose d[i] came from the kept tokens found when it closed (its rescale, totals and J), or None."""
    return _FINISHED


def finish_step(model) -> DeferredStep | None:
    """Close the current step's DeferredPlan (one all-reduce of its kept tokens' totals over the DP group, after one over
    the CP group) and rescale the model chunks' gradients (Megatron's ``scale_gradients``) by ``G_used / G``; None
    when the step has none or it is closed already. lossagg's step hook makes the model config's
    ``finalize_model_grads_func`` call it after miles' own: after the DP reduction and the per-token division,
    before clipping and the optimizer's step."""
    global _FINISHED
    plan = None if _STEP is None else _STEP.deferred[0]
    if plan is None or plan.closed:
        return None
    done = plan.close()
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        done.apply_(chunk)
    _FINISHED = done
    return done


def _rescaling(finalize):
    """``finalize`` (the model config's ``finalize_model_grads_func``, miles' own), then :func:`finish_step`."""

    def finalize_then_rescale(model, *args, **kwargs):
        out = None if finalize is None else finalize(model, *args, **kwargs)
        finish_step(model)
        return out

    finalize_then_rescale.lossagg_wraps = finalize
    return finalize_then_rescale


def _wire_rescale(model) -> None:
    """Make the model config's ``finalize_model_grads_func`` close the step's DeferredPlan (miles' train() sets the
    function each rollout; it is wrapped once per setting)."""
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    config = import_module("megatron.core.utils").get_model_config(chunk)
    if not hasattr(config.finalize_model_grads_func, "lossagg_wraps"):
        config.finalize_model_grads_func = _rescaling(config.finalize_model_grads_func)


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    """miles' ``--custom-megatron-before-train-step-hook-path``: plans the step (see :func:`plan_step`), then
    calls the hook the user had set there, if any."""
    if getattr(args, "lossagg_config", None) is not None and getattr(args, "loss_type", None) == "custom_loss":
        local = _trainer_frame().f_locals
        if local.get("step_id") != step_id:
            raise RuntimeError(f"lossagg: train_one_step runs step {local.get('step_id')!r}, the hook was called for step {step_id!r}")
        step = plan_step(args, local["data_iterator"], int(local["num_microbatches"]))
        if step.deferred[0] is not None:
            _wire_rescale(model)
    user = getattr(args, "lossagg_user_before_train_step_hook_path", None)
    if user:
        seed.load(user)(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)


# ------------------------------------------------------------------- the loss
def loss_function(args, batch, logits, sum_of_sample_mean):
    """miles' ``--loss-type custom_loss`` function: the launch's own loss (``policy_loss_function``, or the
    user's custom loss), handed this micro-batch's :class:`lossagg.integrations.seed.TermReducer` in place
    of miles' ``sum_of_sample_mean``."""
    step = seed.planned_for_loss(args, _STEP, __name__, HOOK, "before_train_step")
    divides = batch.get("dynamic_global_batch_size", args.global_batch_size)
    if not step.per_token and divides != step.scales[0]:
        raise RuntimeError(f"lossagg: miles divides this micro-batch by global_batch_size {divides}, the step was planned for {step.scales[0]}")
    inner, trainer = args.lossagg_inner_loss, step.trainer
    func = import_module(f"{trainer}.backends.training_utils.loss").policy_loss_function if inner == "policy_loss" else seed.load(inner)
    cp_utils = import_module(f"{trainer}.backends.training_utils.cp_utils")
    total_lengths, response_lengths = batch["total_lengths"], batch["response_lengths"]

    def layout(masks):
        masks = batch["loss_masks"] if masks is None else masks
        return seed.layout_of(
            cp_utils.get_local_response_loss_masks(total_lengths, response_lengths, masks, args.qkv_format, batch.get("max_seq_lens"))
        )

    # the order of the policy loss's calls matters only for the config's terms (none under TIS, which configure checked);
    # miles-rl 0.0.2 reduces entropy only when its coefficient is not 0
    schedule = seed.schedule_of(args, seed.runtime_config(args, "miles", __name__), inner, entropy_always=False)
    reducer = step.reducer(batch["loss_masks"], layout, schedule, f"miles-rl {MILES_VERSION}")
    return seed.run_loss(func, args, batch, logits, reducer)


def pg_loss_reducer(total_lengths, response_lengths, pg_loss_masks, calculate_per_token_loss):
    """miles' ``--custom-pg-loss-reducer-function-path``: the reducer of pg_loss for this micro-batch
    (:func:`lossagg.integrations.seed.pg_reducer`)."""
    planned = _STEP is not None and _STEP.per_token
    return seed.pg_reducer(total_lengths, response_lengths, pg_loss_masks, calculate_per_token_loss, planned, __name__)
