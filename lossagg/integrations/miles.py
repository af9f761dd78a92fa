"""``--loss-aggregation`` for miles (radixark's ``miles-rl`` 0.0.2), through the hooks it already has
(docs/integration.md, "miles"; slime, whose internals differ, has :mod:`lossagg.integrations.slime`).
Nothing of miles is patched.

One line in the launcher (miles' ``train.py``)::

    # from miles.utils.arguments import parse_args
    from lossagg.integrations.miles import parse_args

Then ``--loss-aggregation MODE`` (any mode of ``lossagg.MODES``, the seed's four among them),
``--loss-aggregation-divisor``, ``--loss-aggregation-empty-samples``,
``--loss-aggregation-term NAME:COEF[:MODE[:L]]`` and ``--loss-aggregation-config FILE`` are flags
of the launch. :func:`parse_args` runs miles' own
``parse_args`` (with these flags added to any ``add_custom_arguments`` of the user's), then
:func:`configure`, which checks the settings against miles' derived ones (``global_batch_size``
after ``--num-steps-per-rollout``, ``--calculate-per-token-loss``, ``--n-samples-per-prompt``)
before any rollout and wires three of miles' hooks:

* ``--custom-megatron-before-train-step-hook-path`` -> :func:`before_train_step`: on every rank
  before each step, the step's denominators ``d[i]`` (``StepPlan``) from this rank's samples of
  the step and one sum all-reduce over the DP group (a table with one row per sample of the step:
  its rollout token count, its prompt group, a fingerprint of its prompt). The rank's samples are
  read from the data iterator of miles' ``train_one_step``, the frame that calls the hook: the
  hook's arguments do not carry it. A hook the user had set there is called after it.
* ``--loss-type custom_loss`` with ``--custom-loss-function-path`` -> :func:`loss_function`: runs
  miles' ``policy_loss_function`` (or the user's own custom loss) unchanged, handing it this
  micro-batch's :class:`lossagg.integrations.seed.TermReducer` in place of miles'
  ``sum_of_sample_mean``: entropy and KL (the config's ``terms`` ``entropy`` and ``kl``, each on
  its own mode; a term the config does not name on the default reducer) and the metrics.
* ``--custom-pg-loss-reducer-function-path`` -> :func:`pg_loss_reducer`: pg_loss on the mode.

Scaling. miles' ``loss_function`` multiplies the loss by ``num_microbatches / global_batch_size ·
dp·cp`` (per-token path: by ``cp``); Megatron's schedule divides by ``num_microbatches`` and DDP
averages over DP×CP (per-token path: sums, then divides by the step's reported tokens
``Σ_i max(M[i], 1)``). The reducer returns this micro-batch's share of ``J`` times
``global_batch_size`` (per-token path: times ``Σ_i max(M[i], 1)`` of the step), so the gradient
miles applies is the gradient of the mode's ``J``, on any split over micro-batches, DP and CP.

TIS/RS: a modified mask (``modified_response_masks``) changes pg_loss's numerator only; ``d[i]``
stays that of the rollout mask (``batch["loss_masks"]``), as in the seed PR. miles then rebuilds its
reducer inside ``policy_loss_function`` from the modified masks (numerators and denominators: each
sample's mean over its kept tokens) for entropy, KL and the metrics: that is lossagg's default
reducer, sample_mean, with ``M[i]`` the kept tokens, so entropy and KL are served there as they are;
the config's ``terms``, and entropy or KL on the per-token path or under ``empty_samples: skip``,
are refused at launch (:func:`lossagg.integrations.seed.term_issues`).

With no lossagg flag on the command line nothing is wired and miles runs as it does.
"""

from __future__ import annotations

import argparse
import contextvars
import sys
from collections.abc import Callable
from importlib import import_module

import torch

from lossagg.config import ConfigError, LossAggregationConfig
from lossagg.integrations import seed, session_refusal
from lossagg.modes import mode_spec
from lossagg.step import StepPlan

MILES_VERSION = "0.0.2"  # the miles-rl release this adapter was read against and is tested with

#: The hook paths this module sets (``load_function`` spells a function ``module.name``).
HOOKS = {
    "custom_megatron_before_train_step_hook_path": f"{__name__}.before_train_step",
    "custom_loss_function_path": f"{__name__}.loss_function",
    "custom_pg_loss_reducer_function_path": f"{__name__}.pg_loss_reducer",
}
CONFIG_FLAG = seed.CONFIG_FLAG
#: The flags that switch lossagg on (any one of them given).
LOSSAGG_FLAGS = (*seed.SWITCHES, seed.TERM_FLAG)
#: What miles' rebuilt reducer (under TIS) divides by, for the refusals.
REBUILT = "each sample by its kept tokens, the modified mask's sum"


# ----------------------------------------------------------------------- launch
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """lossagg's flags, for ``parse_args(add_custom_arguments=...)`` (:func:`lossagg.integrations.seed.add_arguments`)."""
    return seed.add_arguments(parser, "miles", LOSSAGG_FLAGS)


def parse_args(add_custom_arguments: Callable | None = None):
    """miles' ``parse_args`` with lossagg's flags, then :func:`configure`.

    A refused setting ends the launch as argparse does: ``error: ...`` on stderr, exit status 2.
    """
    trainer_parse_args = import_module("miles.utils.arguments").parse_args  # the peer, imported only here
    return seed.parse_launch(trainer_parse_args, add_custom_arguments, add_arguments, configure, LOSSAGG_FLAGS)


def config_of(args) -> LossAggregationConfig | None:
    """The lossagg config of a parsed miles launch, or None when no lossagg flag was given.

    The checks of :func:`configure` that read only the settings (not the hooks); raises
    :class:`lossagg.ConfigError` naming the flags.
    """
    return seed.config_of(args, "miles", LOSSAGG_FLAGS)


def configure(args) -> LossAggregationConfig | None:
    """Check a parsed miles launch and wire lossagg's hooks into it (in place); returns the config,
    or None (nothing wired) when no lossagg flag was given.

    Refused, naming the flags and values: any setting ``LossAggregationConfig`` refuses (the mode,
    the divisor, ``--n-samples-per-prompt`` < 1, ``--calculate-per-token-loss`` with a mode other than
    token_mean, which it is the legacy spelling of, a divisor-taking mode on the per-token path,
    prompt groups that cannot be whole in a step: ``global_batch_size % n_samples_per_prompt``),
    a ``--loss-type`` that has no pg_loss, a pg_loss reducer already set to another function, a
    ``--train-backend`` other than megatron (miles' FSDP actor never calls the before-train-step
    hook that plans each step), a ``weighting`` (miles hands no per-sample weights), and terms
    :func:`lossagg.integrations.seed.term_issues` refuses (names and coefficients other than miles'
    policy loss's, terms under TIS).
    Safe to call again on the same args.
    """
    config = config_of(args)
    if config is None:
        return None
    inner, issues = seed.loss_issues(args, config, HOOKS, f"miles-rl {MILES_VERSION}", REBUILT)
    refused = session_refusal(
        config,
        f"miles-rl {MILES_VERSION}'s step hook",
        "its training data holds no trajectory id per sample: its rollout_id numbers the rollout, not a sample's trajectory",
    )
    if refused:
        issues.append(("--loss-aggregation", refused))
    backend = getattr(args, "train_backend", "megatron")
    if backend != "megatron":
        issues.append(
            (
                "--train-backend",
                f"--train-backend {backend}: miles-rl {MILES_VERSION}'s {backend} actor never calls --custom-megatron-before-train-step-hook-path, "
                "through which lossagg plans each step's denominators: use --train-backend megatron",
            )
        )
    if issues:
        raise ConfigError(issues, "command line")
    seed.wire(args, config, HOOKS, inner, "custom_megatron_before_train_step_hook_path", "lossagg_user_before_train_step_hook_path")
    return config


def _runtime_config(args) -> LossAggregationConfig:
    summary = getattr(args, "lossagg_config", None)
    if summary is None:
        raise RuntimeError(
            "lossagg's miles hooks are set but the launch was not configured by lossagg: launch with "
            "lossagg.integrations.miles.parse_args (or call lossagg.integrations.miles.configure(args) after miles' parse_args)"
        )
    # the step's own sample count is checked where it is known (a dynamic global batch size varies by rollout)
    data = {k: v for k, v in summary.items() if k not in ("resolution_notes", "global_batch_size") and v is not None}
    return LossAggregationConfig.from_dict(data, source="args.lossagg_config")


# ------------------------------------------------------------------- the step
class MilesStep:
    """The denominators of one train step on this rank, for the micro-batches miles will hand the loss.

    ``plan`` is the :class:`lossagg.StepPlan` of the whole step (every DP rank's samples, in the
    order of the gathered table); ``local_denoms`` maps ``"pg"``, each term of the config and
    :data:`lossagg.integrations.seed.METRIC` (the default reducer) to ``d_k[i]`` of this rank's
    samples, found by their rollout loss-mask tensors (the objects miles' data iterator hands each
    micro-batch).
    """

    def __init__(
        self,
        plan: StepPlan,
        masks: list[torch.Tensor],
        local_denoms: dict[str, torch.Tensor],
        num_samples: int,
        reported_tokens: int,
        per_token: bool,
        trainer: str,
    ):
        self.plan = plan
        self.trainer = trainer
        self._by_mask = {id(m): (m, i) for i, m in enumerate(masks)}
        self.local_denoms = local_denoms
        self.num_samples = num_samples
        self.reported_tokens = reported_tokens
        self.per_token = per_token

    def denoms_for(self, loss_masks) -> dict[str, torch.Tensor]:
        """Every term's ``d_k`` of a micro-batch's samples, by their loss-mask tensors."""
        rows = []
        for k, m in enumerate(loss_masks):
            hit = self._by_mask.get(id(m))
            if hit is None or hit[0] is not m:
                raise RuntimeError(
                    f"lossagg: sample {k} of this micro-batch is not one of the samples planned for this step (its loss mask is not one the "
                    "data iterator held when --custom-megatron-before-train-step-hook-path ran): was the rollout data replaced after the hook?"
                )
            rows.append(hit[1])
        return {name: table[rows] for name, table in self.local_denoms.items()}


_STEP: MilesStep | None = None
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("lossagg_miles_micro_batch", default=None)


def current_step() -> MilesStep | None:
    """The step planned by the last :func:`before_train_step` in this process."""
    return _STEP


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


def _prompt_fingerprint(tokens: torch.Tensor, prompt_length: int) -> int:
    return hash(tuple(tokens[:prompt_length].tolist())) & ((1 << 62) - 1)


def plan_step(args, data_iterator, num_microbatches: int, *, parallel_state=None) -> MilesStep:
    """The step's denominators from this rank's data iterator, with one sum all-reduce over the DP group.

    ``data_iterator`` is miles' ``DataIterator`` (or the list of them, one per virtual pipeline
    stage) positioned at the step's first micro-batch; ``parallel_state`` is miles'
    ``ParallelState`` (default: miles' ``get_parallel_state()``).
    """
    global _STEP
    config = _runtime_config(args)
    # prompt groups where the PG mode or a term's mode has them
    needs_groups = any(mode_spec(m).needs_groups for m in (config.mode, *(t.mode for t in config.terms.values())))
    iterators = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    iterator = iterators[0]
    trainer = type(iterator).__module__.split(".")[0]
    if parallel_state is None:
        parallel_state = import_module(f"{trainer}.backends.training_utils.parallel").get_parallel_state()
    rollout = iterator.rollout_data
    positions = _step_positions(iterator, num_microbatches)
    masks = [rollout["loss_masks"][j] for j in positions]
    n_local = len(masks)
    dp = parallel_state.intra_dp
    gbs = rollout.get("dynamic_global_batch_size", args.global_batch_size)
    if n_local * dp.size != gbs:
        raise RuntimeError(f"lossagg: this rank's step holds {n_local} samples, times {dp.size} DP ranks is not global_batch_size {gbs}")
    device = masks[0].device if masks else torch.device("cpu")
    counts = torch.stack([(m != 0).sum() for m in masks]).to(torch.int64) if masks else torch.zeros(0, dtype=torch.int64)
    odd = torch.stack([((m != 0) & (m != 1)).any() for m in masks]).cpu() if masks else torch.zeros(0, dtype=torch.bool)
    if bool(odd.any()):
        bad = int(torch.nonzero(odd)[0, 0])
        raise ValueError(
            f"lossagg: the loss mask of rollout sample {positions[bad]} is not 0/1: d[i] counts tokens, while miles' per-token path "
            "divides by the mask's sum"
        )
    table = torch.zeros(dp.size * n_local, 3, dtype=torch.int64, device=device)
    rows = slice(dp.rank * n_local, (dp.rank + 1) * n_local)
    table[rows, 0] = counts.to(device)
    if needs_groups:
        indices = rollout.get("sample_indices")
        if indices is None:
            raise ValueError(
                f"lossagg: mode={config.mode} needs each sample's prompt group, read from the rollout's sample_indices, which this rollout has not"
            )
        n = config.n_samples_per_prompt
        keys = torch.tensor([int(indices[j]) // n for j in positions], dtype=torch.int64)
        prints = torch.tensor(
            [_prompt_fingerprint(rollout["tokens"][j], int(rollout["total_lengths"][j]) - int(rollout["response_lengths"][j])) for j in positions],
            dtype=torch.int64,
        )
        table[rows, 1] = keys.to(device)
        table[rows, 2] = prints.to(device)
    if dp.size > 1:
        torch.distributed.all_reduce(table, group=dp.group)
    table = table.cpu()
    all_counts = table[:, 0]
    group_index = None
    if needs_groups:
        keys, group_index = torch.unique(table[:, 1], return_inverse=True)
        for g in range(keys.numel()):
            prints = torch.unique(table[group_index == g, 2])
            if prints.numel() != 1:
                raise ValueError(
                    f"lossagg: the samples of prompt group {int(keys[g])} (sample.index // n_samples_per_prompt, as miles' data source numbers "
                    "them) have different prompts: this rollout's samples are not numbered by group"
                )
    plan = StepPlan(config, all_counts, group_index=group_index)
    local = {name: d[rows].clone() for name, d in plan.term_denoms.items()}
    local[seed.METRIC] = plan.metric_denoms[rows].clone()
    reported = int(all_counts.clamp(min=1).sum())
    _STEP = MilesStep(plan, masks, local, gbs, reported, bool(args.calculate_per_token_loss), trainer)
    return _STEP


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    """miles' ``--custom-megatron-before-train-step-hook-path``: plans the step (see :func:`plan_step`), then
    calls the hook the user had set there, if any."""
    if getattr(args, "lossagg_config", None) is not None and getattr(args, "loss_type", None) == "custom_loss":
        frame = _trainer_frame()
        local = frame.f_locals
        if local.get("step_id") != step_id:
            raise RuntimeError(f"lossagg: train_one_step runs step {local.get('step_id')!r}, the hook was called for step {step_id!r}")
        plan_step(args, local["data_iterator"], int(local["num_microbatches"]))
    user = getattr(args, "lossagg_user_before_train_step_hook_path", None)
    if user:
        _load(user)(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)


def _load(path: str):
    module, _, name = path.rpartition(".")
    return getattr(import_module(module), name)


# ------------------------------------------------------------------- the loss
def loss_function(args, batch, logits, sum_of_sample_mean):
    """miles' ``--loss-type custom_loss`` function: the launch's own loss (``policy_loss_function``, or the
    user's custom loss), handed this micro-batch's :class:`lossagg.integrations.seed.TermReducer` in place
    of miles' ``sum_of_sample_mean``."""
    inner = getattr(args, "lossagg_inner_loss", None)
    if inner is None:
        raise RuntimeError(
            "lossagg.integrations.miles.loss_function: the launch was not configured by lossagg (lossagg.integrations.miles.configure)"
        )
    step = _STEP
    if step is None:
        raise RuntimeError(
            "lossagg: no step was planned: --custom-megatron-before-train-step-hook-path must be lossagg.integrations.miles.before_train_step"
        )
    if bool(args.calculate_per_token_loss) != step.per_token:
        raise RuntimeError(
            f"lossagg: calculate_per_token_loss={args.calculate_per_token_loss} at the loss, {step.per_token} when the step was planned"
        )
    if inner == "policy_loss":
        func = _trainer_module_by_name(args, "backends.training_utils.loss").policy_loss_function
    else:
        func = _load(inner)
    if step.per_token:
        scale = step.reported_tokens
    else:
        scale = batch.get("dynamic_global_batch_size", args.global_batch_size)
        if scale != step.num_samples:
            raise RuntimeError(f"lossagg: miles divides this micro-batch by global_batch_size {scale}, the step was planned for {step.num_samples}")
    cp_utils = _trainer_module_by_name(args, "backends.training_utils.cp_utils")
    total_lengths, response_lengths = batch["total_lengths"], batch["response_lengths"]

    def layout(masks):
        masks = batch["loss_masks"] if masks is None else masks
        return seed.layout_of(
            cp_utils.get_local_response_loss_masks(total_lengths, response_lengths, masks, args.qkv_format, batch.get("max_seq_lens"))
        )

    # the order of the policy loss's calls matters only for the config's terms (none under TIS, which configure checked);
    # miles-rl 0.0.2 reduces entropy only when its coefficient is not 0
    schedule = seed.schedule_of(args, _runtime_config(args), inner, entropy_always=False)
    reducer = seed.TermReducer(step.denoms_for(batch["loss_masks"]), scale, layout, schedule, f"miles-rl {MILES_VERSION}")
    token = _CURRENT.set((args, batch, reducer))
    try:
        loss, log = func(args, batch, logits, reducer)
    finally:
        _CURRENT.reset(token)
    if schedule:
        reducer.check_reported(log)
    return loss, log


def _trainer_module_by_name(args, name: str):
    """``miles.<name>`` (miles is imported already: the hooks run inside it)."""
    root = _STEP.trainer if _STEP is not None else "miles"
    return import_module(f"{root}.{name}")


def pg_loss_reducer(total_lengths, response_lengths, pg_loss_masks, calculate_per_token_loss):
    """miles' ``--custom-pg-loss-reducer-function-path``: the reducer of pg_loss for this micro-batch.

    The returned function takes this CP rank's per-token pg_loss (the micro-batch's samples
    concatenated, as miles' own reducer takes it) and returns its share of the mode's J times
    miles' outer divisor (module docstring). ``pg_loss_masks`` give the numerator (the rollout
    masks, or TIS/RS's modified ones); ``d[i]`` comes from the step's plan.
    """
    current = _CURRENT.get()
    if current is None:
        raise RuntimeError(
            "lossagg.integrations.miles.pg_loss_reducer runs inside lossagg.integrations.miles.loss_function "
            "(--loss-type custom_loss --custom-loss-function-path lossagg.integrations.miles.loss_function)"
        )
    _, batch, reducer = current
    step = _STEP
    if bool(calculate_per_token_loss) != step.per_token:
        raise RuntimeError(f"lossagg: calculate_per_token_loss={calculate_per_token_loss} at the loss, {step.per_token} when the step was planned")
    if list(total_lengths) != list(batch["total_lengths"]) or list(response_lengths) != list(batch["response_lengths"]):
        raise RuntimeError("lossagg: the pg_loss reducer was asked for samples other than the micro-batch's")
    return reducer.term("pg", pg_loss_masks)


__all__ = [
    "MILES_VERSION",
    "HOOKS",
    "MilesStep",
    "add_arguments",
    "before_train_step",
    "config_of",
    "configure",
    "current_step",
    "loss_function",
    "parse_args",
    "pg_loss_reducer",
    "plan_step",
]
