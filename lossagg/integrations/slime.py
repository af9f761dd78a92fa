"""``--loss-aggregation`` for slime (THUDM/slime at commit 624b824, where the seed PR's feature was
proposed), through the hooks slime already has (docs/integration.md, "slime"). Nothing of slime is
patched.

One line in the launcher (slime's ``train.py``)::

    # from slime.utils.arguments import parse_args
    from lossagg.integrations.slime import parse_args

Then ``--loss-aggregation MODE`` (any mode of ``lossagg.MODES``), ``--loss-aggregation-divisor``,
``--loss-aggregation-empty-samples``, ``--loss-aggregation-term NAME:COEF[:MODE[:L]]`` and
``--loss-aggregation-config FILE`` are flags of the seed. :func:`parse_args` runs slime's own
``parse_args`` (with these flags added to the user's ``add_custom_arguments``), then
:func:`configure`, which checks the settings against slime's derived ones and wires three hooks:

* ``--rollout-data-postprocess-path`` -> :func:`rollout_data_postprocess`: on every rank, with the
  rank's whole rollout data (after the log-probs and advantages, after the user's own
  postprocess, which it calls first), plans every step of the rollout: one sum all-reduce over
  the DP group of a table with one row per training sample of the rollout, then one
  :class:`lossagg.StepPlan` per step.
* ``--loss-type custom_loss`` with ``--custom-loss-function-path`` -> :func:`loss_function`: runs
  slime's ``policy_loss_function`` (or the user's custom loss) unchanged, handing it the
  reducer of this micro-batch (:class:`lossagg.integrations.seed.TermReducer`) in place of slime's ``sum_of_sample_mean``.
* ``--custom-pg-loss-reducer-function-path`` -> :func:`pg_loss_reducer`: pg_loss on the mode.

**A sample is a rollout.** slime's unit is the rollout (``rollout_ids``): one execution of one of
the ``n_samples_per_prompt`` rollouts of a prompt, which may emit several training samples
(compact / subagent fan-out). slime's default divides each training sample by its rollout's
mask total and the step by its rollout count. lossagg takes the same unit: its sample ``i`` is a
rollout, ``M[i]`` the loss tokens of all its training samples, ``N`` the step's rollouts
(slime's ``step_global_batch_size``), a prompt group the rollouts of one prompt
(``sample_index // n_samples_per_prompt``, as slime's data source numbers them), ``L_max`` the
step's longest rollout, and an empty sample (``empty_samples: skip``) a rollout with no loss
token in any of its training samples. So ``sample_mean`` is slime's default, bit for bit in
exact arithmetic; the other modes are the table of ``docs/modes.md`` over rollouts.

**Sessions.** Under a mode with sessions (``session_mean``, ``session_token_mean``, their
``prompt_`` forms; docs/modes.md, "Sessions") lossagg's sample is slime's training sample and
its session the training sample's rollout (``rollout_ids``), so ``session_token_mean`` is
slime's default again, now with the training samples in view, and ``session_mean`` weighs
each rollout once and each of its training samples equally. ``n_samples_per_prompt`` then
counts the rollouts (sessions) of a prompt group, and the default reducer (the terms the
config does not name, the metrics) is ``sample_mean`` over training samples.

**Every term.** slime's ``policy_loss_function`` reduces pg_loss, entropy (``-entropy_coef``), KL
(``+kl_loss_coef`` under ``--use-kl-loss``) and its metrics. The config's ``terms`` name them
``entropy`` and ``kl``, each on its own mode; a term the config does not name, and every metric,
is on the default reducer (``docs/terms.md``: ``sample_mean`` over rollouts, ``token_mean`` when
the step is token-level). A term's coefficient must be slime's (``-entropy_coef``,
``kl_loss_coef``): slime applies it.

Scaling. slime's ``loss_function`` multiplies the loss by ``num_microbatches /
step_global_batch_size · dp·cp`` (per-token path: by ``cp``); Megatron's schedule divides by
``num_microbatches`` and DDP averages over DP×CP (per-token path: sums, then divides by the step's
``Σ max(M[j], 1)`` over training samples ``j``). Each reduction returns this micro-batch's share
of its ``J_k`` times ``step_global_batch_size`` (per-token path: times that token total), so the
gradient slime applies is the gradient of ``J``, on any split over micro-batches, DP ranks
(holding unequal sample counts) and CP (zigzag).

TIS/RS (``--use-tis``, ``--get-mismatch-metrics``): a modified mask changes pg_loss's numerator
only; ``d[i]`` stays that of the rollout masks, as slime's own reducer does. slime then rebuilds
``sum_of_sample_mean`` inside ``policy_loss_function`` for entropy, KL and the metrics, so the
config's ``terms`` are refused there (docs/integration.md, "slime").

With no lossagg flag on the command line nothing is wired and slime runs as it does.
"""

from __future__ import annotations

import argparse
import contextvars
from collections.abc import Callable
from importlib import import_module

import torch

from lossagg.config import ConfigError, LossAggregationConfig
from lossagg.integrations import seed
from lossagg.modes import mode_spec
from lossagg.step import StepPlan

SLIME_COMMIT = "624b824"  # the slime commit this adapter was read against and is tested with (2026-08-21)

#: The hook paths this module sets (slime's ``load_function`` spells a function ``module.name``).
HOOKS = {
    "rollout_data_postprocess_path": f"{__name__}.rollout_data_postprocess",
    "custom_loss_function_path": f"{__name__}.loss_function",
    "custom_pg_loss_reducer_function_path": f"{__name__}.pg_loss_reducer",
}
#: The flags of a slime launch that switch lossagg on.
LOSSAGG_FLAGS = (*seed.SWITCHES, seed.TERM_FLAG)
TERMS = seed.TERMS
METRIC = seed.METRIC
#: What slime's rebuilt reducer (under TIS) divides by, for the refusals.
REBUILT = "each training sample by its rollout's mask total, rollout_mask_sums"


# ----------------------------------------------------------------------- launch
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """lossagg's flags, for slime's ``parse_args(add_custom_arguments=...)``."""
    return seed.add_arguments(parser, "slime", LOSSAGG_FLAGS)


def parse_args(add_custom_arguments: Callable | None = None):
    """slime's ``parse_args`` with lossagg's flags, then :func:`configure`.

    A refused setting ends the launch as argparse does: ``error: ...`` on stderr, exit status 2.
    """
    trainer_parse_args = import_module("slime.utils.arguments").parse_args  # the peer, imported only here
    return seed.parse_launch(trainer_parse_args, add_custom_arguments, add_arguments, configure, LOSSAGG_FLAGS)


def config_of(args) -> LossAggregationConfig | None:
    """The lossagg config of a parsed slime launch, or None when no lossagg flag was given."""
    return seed.config_of(args, "slime", LOSSAGG_FLAGS)


def configure(args) -> LossAggregationConfig | None:
    """Check a parsed slime launch and wire lossagg's hooks into it (in place); returns the config,
    or None (nothing wired) when no lossagg flag was given.

    Refused, naming the flags and values: any setting ``LossAggregationConfig`` refuses; a
    ``--loss-type`` without pg_loss; a pg_loss reducer already set to another function; a critic
    (``--advantage-estimator ppo``: its value loss is reduced by slime's ``train_critic``, which
    never calls the postprocess hook); ``--allgather-cp``; a ``weighting`` (slime hands no
    per-sample weights); terms slime's policy loss does not reduce, or whose coefficient is not
    slime's; terms under TIS, and entropy or KL under TIS where slime's rebuilt reducer is not
    lossagg's default. Safe to call again on the same args.
    """
    config = config_of(args)
    if config is None:
        return None
    inner, issues = seed.loss_issues(args, config, HOOKS, f"slime {SLIME_COMMIT}", REBUILT)
    backend = getattr(args, "train_backend", "megatron")
    if backend != "megatron":
        issues.append(
            ("--train-backend", f"--train-backend {backend}: the lossagg adapter serves slime's Megatron actor; use --train-backend megatron")
        )
    if getattr(args, "advantage_estimator", None) == "ppo":
        issues.append(
            (
                "--advantage-estimator",
                "--advantage-estimator ppo trains a critic, whose value loss slime reduces in train_critic without calling "
                "--rollout-data-postprocess-path, through which lossagg plans each step: use a critic-free estimator",
            )
        )
    if getattr(args, "allgather_cp", False):
        issues.append(
            ("--allgather-cp", "--allgather-cp lays a micro-batch out over CP ranks other than the zigzag shards lossagg's reducer reads: drop it")
        )
    if issues:
        raise ConfigError(issues, "command line")
    seed.wire(args, config, HOOKS, inner, "rollout_data_postprocess_path", "lossagg_user_rollout_data_postprocess_path")
    return config


def _runtime_config(args) -> LossAggregationConfig:
    summary = getattr(args, "lossagg_config", None)
    if summary is None:
        raise RuntimeError(
            "lossagg's slime hooks are set but the launch was not configured by lossagg: launch with "
            "lossagg.integrations.slime.parse_args (or call lossagg.integrations.slime.configure(args) after slime's parse_args)"
        )
    # a step's rollout count is checked where it is known, against slime's global_batch_sizes
    data = {k: v for k, v in summary.items() if k not in ("resolution_notes", "global_batch_size") and v is not None}
    return LossAggregationConfig.from_dict(data, source="args.lossagg_config")


# ------------------------------------------------------------------ the rollout
class SlimeRollout:
    """Every step of one rollout on this rank: each local training sample's step and its ``d_k`` of
    every term (its rollout's), found by the sample's loss-mask tensor (the object slime's data
    iterator hands each micro-batch).

    ``denoms[name]`` is float64 ``[n_local]`` for ``"pg"``, each of the config's terms and
    :data:`METRIC` (the default reducer); ``scales[s]`` what step ``s``'s reductions are multiplied
    by (module docstring); ``plans[s]`` the step's :class:`lossagg.StepPlan` over its rollouts.
    """

    def __init__(self, masks, steps, denoms, scales, plans, per_token: bool):
        self._by_mask = {id(m): (m, j) for j, m in enumerate(masks)}
        self.steps = steps
        self.denoms = denoms
        self.scales = scales
        self.plans = plans
        self.per_token = per_token

    def rows_of(self, loss_masks) -> tuple[int, list[int]]:
        """This micro-batch's step and its samples' rows, from its loss-mask tensors."""
        rows = []
        for k, m in enumerate(loss_masks):
            hit = self._by_mask.get(id(m))
            if hit is None or hit[0] is not m:
                raise RuntimeError(
                    f"lossagg: sample {k} of this micro-batch is not one of the samples planned for this rollout (its loss mask is not one "
                    "the rollout data held when --rollout-data-postprocess-path ran): was the rollout data replaced after the hook?"
                )
            rows.append(hit[1])
        steps = {self.steps[j] for j in rows}
        if len(steps) > 1:
            raise RuntimeError(f"lossagg: one micro-batch holds samples of steps {sorted(steps)}")
        return (steps.pop() if steps else -1), rows


_ROLLOUT: SlimeRollout | None = None
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("lossagg_slime_micro_batch", default=None)


def current_rollout() -> SlimeRollout | None:
    """The rollout planned by the last :func:`rollout_data_postprocess` in this process."""
    return _ROLLOUT


def _prompt_fingerprint(tokens, prompt_length: int) -> int:
    return hash(tuple(torch.as_tensor(tokens[:prompt_length]).tolist())) & ((1 << 62) - 1)


def _local_steps(rollout_data, n_local: int) -> list[int]:
    """Each local sample's step, from slime's schedule (``num_microbatches`` micro-batches per step)."""
    schedule = rollout_data["micro_batch_indices"]
    steps = [-1] * n_local
    offset = 0
    for s, k in enumerate(rollout_data["num_microbatches"]):
        for mb in schedule[offset : offset + int(k)]:
            for j in mb:
                steps[int(j)] = s
        offset += int(k)
    if offset != len(schedule) or -1 in steps:
        raise RuntimeError(
            f"lossagg: slime's schedule holds {len(schedule)} micro-batches for {n_local} samples, the steps run {offset}; some sample is in no step"
        )
    return steps


# columns of the rollout's table
_PRESENT, _STEP, _COUNT, _ROLLOUT_ID, _GROUP, _PRINT = range(6)


def plan_rollout(args, rollout_data, *, dp_group=None) -> SlimeRollout:
    """Every step's denominators of this rank's rollout data, with one sum all-reduce over the DP group
    (``dp_group``; default: Megatron's data-parallel group without CP)."""
    global _ROLLOUT
    config = _runtime_config(args)
    names = ("pg", *config.terms)
    modes = [mode_spec(m) for m in (config.mode, *(t.mode for t in config.terms.values() if t.mode))]
    needs_groups = any(m.needs_groups for m in modes)
    # under a mode with sessions a lossagg sample is one training sample and its session its rollout (module docstring)
    sessions = any(m.needs_sessions for m in modes)
    masks = rollout_data["loss_masks"]
    partition = [int(p) for p in rollout_data["partition"]]
    n_local = len(masks)
    steps = _local_steps(rollout_data, n_local)
    device = masks[0].device if n_local else torch.device("cpu")
    if dp_group is None:
        mpu = import_module("megatron.core.parallel_state")  # the trainer's Megatron, in slime's processes only
        dp_group = mpu.get_data_parallel_group(with_context_parallel=False)
    dp_size = torch.distributed.get_world_size(dp_group) if torch.distributed.is_initialized() else 1
    # one transfer for all the rank's samples (a GPU sync per sample would cost a sync each)
    counts_local = torch.stack([(m != 0).sum() for m in masks]).tolist() if n_local else []
    odd = torch.nonzero(torch.stack([((m != 0) & (m != 1)).any() for m in masks])).flatten().tolist() if n_local else []
    if odd:
        raise ValueError(
            f"lossagg: the loss mask of rollout sample {partition[odd[0]]} is not 0/1: d[i] counts tokens, slime's reducer multiplies by the mask"
        )
    size = torch.tensor([max(partition, default=-1) + 1], dtype=torch.int64, device=device)
    if dp_size > 1:
        torch.distributed.all_reduce(size, op=torch.distributed.ReduceOp.MAX, group=dp_group)
    rollout_ids = rollout_data.get("rollout_ids")
    indices = rollout_data.get("sample_indices")
    if needs_groups and indices is None:
        raise ValueError(f"lossagg: mode={config.mode} needs each rollout's prompt group, read from the rollout's sample_indices, which it has not")
    if sessions and rollout_ids is None:
        raise ValueError(
            f"lossagg: mode={config.mode} needs each training sample's session, its rollout_id, which the rollout data does not hold "
            "(slime's rollout side sets rollout_ids)"
        )
    local_rows = []
    for j, p in enumerate(partition):
        # a sample with no rollout id is a rollout of its own (slime numbers them so on the rollout side)
        row = [1, steps[j] + 1, int(counts_local[j]), int(rollout_ids[j]) if rollout_ids is not None else -1 - p, 0, 0]
        if needs_groups:
            prompt_length = int(rollout_data["total_lengths"][j]) - int(rollout_data["response_lengths"][j])
            row[_GROUP] = int(indices[j]) // config.n_samples_per_prompt
            row[_PRINT] = _prompt_fingerprint(rollout_data["tokens"][j], prompt_length)
        local_rows.append(row)
    table = torch.zeros(int(size), 6, dtype=torch.int64)
    if local_rows:
        table[torch.tensor(partition)] = torch.tensor(local_rows, dtype=torch.int64)
    if dp_size > 1:
        table = table.to(device)
        torch.distributed.all_reduce(table, group=dp_group)
        table = table.cpu()
    if bool((table[:, _PRESENT] > 1).any()):
        p = int(torch.nonzero(table[:, _PRESENT] > 1)[0, 0])
        raise RuntimeError(f"lossagg: rollout sample {p} is in the partition of {int(table[p, _PRESENT])} DP ranks")
    rows_of_table = table.tolist()
    batch_sizes = [int(b) for b in rollout_data["global_batch_sizes"]]
    per_token = bool(args.calculate_per_token_loss)
    local_rollout = [-1] * n_local  # each local sample's row in its step's plan: its rollout's, or its own under sessions
    plans, scales, step_tables = [], [], []
    rollout_tokens_of: dict[tuple[int, int], int] = {}  # (step, rollout_id) -> the rollout's loss tokens
    for s, gbs in enumerate(batch_sizes):
        rows = [p for p, row in enumerate(rows_of_table) if row[_PRESENT] == 1 and row[_STEP] == s + 1]
        order: dict[int, int] = {}
        for p in rows:
            order.setdefault(rows_of_table[p][_ROLLOUT_ID], len(order))
        if len(order) != gbs:
            raise RuntimeError(
                f"lossagg: step {s} holds {len(order)} rollouts over the DP ranks, slime divides it by global_batch_size {gbs} (its rollouts)"
            )
        for p in rows:
            key = (s, rows_of_table[p][_ROLLOUT_ID])
            rollout_tokens_of[key] = rollout_tokens_of.get(key, 0) + rows_of_table[p][_COUNT]
        if sessions:
            plan, of_position = _session_plan(config, rows, rows_of_table, order, needs_groups)
            plans.append(plan)
            scales.append(sum(max(rows_of_table[p][_COUNT], 1) for p in rows) if per_token else gbs)
            step_tables.append({**plan.term_denoms, METRIC: plan.metric_denoms})
            for j, p in enumerate(partition):
                if steps[j] == s:
                    local_rollout[j] = of_position[p]
            continue
        counts = [0] * len(order)
        group = [-1] * len(order)
        prints: dict[int, int] = {}
        of_position = {}
        for p in rows:
            row = rows_of_table[p]
            r = order[row[_ROLLOUT_ID]]
            of_position[p] = r
            counts[r] += row[_COUNT]
            if needs_groups:
                if group[r] not in (-1, row[_GROUP]):
                    raise ValueError(f"lossagg: rollout {row[_ROLLOUT_ID]} has training samples of prompt groups {group[r]} and {row[_GROUP]}")
                group[r] = row[_GROUP]
                prints.setdefault(r, row[_PRINT])  # the rollout's first training sample's prompt
        group_index = _group_index(group, prints) if needs_groups else None
        plan = StepPlan(config, torch.tensor(counts, dtype=torch.int64), group_index=group_index)
        plans.append(plan)
        scales.append(sum(max(rows_of_table[p][_COUNT], 1) for p in rows) if per_token else gbs)
        step_tables.append({**plan.term_denoms, METRIC: plan.metric_denoms})
        for j, p in enumerate(partition):
            if steps[j] == s:
                local_rollout[j] = of_position[p]
    denoms = {name: torch.zeros(n_local, dtype=torch.float64) for name in (*names, METRIC)}
    for s in range(len(batch_sizes)):  # each step's rows of the rank's samples, gathered from its plan's tables
        mine = [j for j in range(n_local) if steps[j] == s]
        if mine:
            at = torch.tensor([local_rollout[j] for j in mine])
            for name in denoms:
                denoms[name][torch.tensor(mine)] = step_tables[s][name][at]
    # slime's own reducer (rebuilt inside policy_loss_function under TIS) divides by rollout_mask_sums: the
    # rollouts' token totals of the masks the steps were planned from (a user's postprocess may have changed them)
    rollout_tokens = [float(rollout_tokens_of[(steps[j], rows_of_table[partition[j]][_ROLLOUT_ID])]) for j in range(n_local)]
    if "rollout_mask_sums" in rollout_data:
        rollout_data["rollout_mask_sums"] = torch.tensor(rollout_tokens, dtype=torch.float32, device=device)
    _ROLLOUT = SlimeRollout(masks, steps, denoms, scales, plans, per_token)
    return _ROLLOUT


def _group_index(group: list[int], prints: dict[int, int]) -> torch.Tensor:
    """Dense prompt-group labels of the plan's samples, each group checked to hold one prompt."""
    keys, group_index = torch.unique(torch.tensor(group, dtype=torch.int64), return_inverse=True)
    for k in range(keys.numel()):
        seen = {prints[r] for r in torch.nonzero(group_index == k).flatten().tolist()}
        if len(seen) != 1:
            raise ValueError(
                f"lossagg: the rollouts of prompt group {int(keys[k])} (sample_index // n_samples_per_prompt, as slime's data source "
                "numbers them) have different prompts: this rollout's samples are not numbered by group"
            )
    return group_index


def _session_plan(config, rows: list[int], table: list[list[int]], order: dict[int, int], needs_groups: bool):
    """The plan of one step under a mode with sessions: its samples are the step's training samples (in
    the order of the rollout's table), its sessions their rollouts; returns the plan and each table
    row's position in it."""
    of_position = {p: k for k, p in enumerate(rows)}
    counts = torch.tensor([table[p][_COUNT] for p in rows], dtype=torch.int64)
    session_index = torch.tensor([order[table[p][_ROLLOUT_ID]] for p in rows], dtype=torch.int64)
    group_index = None
    if needs_groups:
        for p in rows:  # a rollout answers one prompt
            first = table[rows[int((session_index == order[table[p][_ROLLOUT_ID]]).nonzero()[0, 0])]][_GROUP]
            if table[p][_GROUP] != first:
                raise ValueError(f"lossagg: rollout {table[p][_ROLLOUT_ID]} has training samples of prompt groups {first} and {table[p][_GROUP]}")
        group_index = _group_index([table[p][_GROUP] for p in rows], {k: table[p][_PRINT] for k, p in enumerate(rows)})
    return StepPlan(config, counts, group_index=group_index, session_index=session_index), of_position


def rollout_data_postprocess(args, rollout_id, rollout_data):
    """slime's ``--rollout-data-postprocess-path``: the user's own postprocess (if one was set), then
    :func:`plan_rollout`."""
    user = getattr(args, "lossagg_user_rollout_data_postprocess_path", None)
    if user:
        _load(user)(args, rollout_id, rollout_data)
    if getattr(args, "lossagg_config", None) is not None:
        plan_rollout(args, rollout_data)


def _load(path: str):
    module, _, name = path.rpartition(".")
    return getattr(import_module(module), name)


# ------------------------------------------------------------- the micro-batch
def _local_masks(total_lengths, response_lengths, loss_masks) -> list[torch.Tensor]:
    """This CP rank's part of each sample's loss mask (the zigzag chunks slime's reducer reads), concatenated, and its cu_seqlens."""
    cp_utils = import_module("slime.backends.megatron_utils.cp_utils")  # slime's, in its processes only
    mpu = import_module("megatron.core.parallel_state")
    cp = mpu.get_context_parallel_world_size()
    parts = []
    for total, response, m in zip(total_lengths, response_lengths, loss_masks, strict=True):
        if cp == 1:
            parts.append(m)
            continue
        prompt = int(total) - int(response)
        _, _, _, tokens = cp_utils.get_logits_and_tokens_offset_with_cp(int(total), int(response))
        parts.append(torch.cat([m[tokens[0][0] - prompt : tokens[0][1] - prompt], m[tokens[1][0] - prompt : tokens[1][1] - prompt]]))
    return parts


def loss_function(args, batch, logits, sum_of_sample_mean):
    """slime's ``--loss-type custom_loss`` function: the launch's own loss (``policy_loss_function``, or
    the user's custom loss), handed this micro-batch's :class:`lossagg.integrations.seed.TermReducer`."""
    inner = getattr(args, "lossagg_inner_loss", None)
    if inner is None:
        raise RuntimeError(
            "lossagg.integrations.slime.loss_function: the launch was not configured by lossagg (lossagg.integrations.slime.configure)"
        )
    rollout = _ROLLOUT
    if rollout is None:
        raise RuntimeError(
            "lossagg: no rollout was planned: --rollout-data-postprocess-path must be lossagg.integrations.slime.rollout_data_postprocess"
        )
    if bool(args.calculate_per_token_loss) != rollout.per_token:
        raise RuntimeError(
            f"lossagg: calculate_per_token_loss={args.calculate_per_token_loss} at the loss, {rollout.per_token} when the rollout was planned"
        )
    step, rows = rollout.rows_of(batch["loss_masks"])
    config = _runtime_config(args)
    if inner == "policy_loss":
        func = import_module("slime.backends.megatron_utils.loss").policy_loss_function
    else:
        func = _load(inner)
    # the order of the policy loss's calls matters only for the config's terms (none under TIS, which configure checked)
    schedule = seed.schedule_of(args, config, inner, entropy_always=True)
    total_lengths, response_lengths = batch["total_lengths"], batch["response_lengths"]

    def layout(masks):
        return seed.layout_of(_local_masks(total_lengths, response_lengths, batch["loss_masks"] if masks is None else masks))

    denoms = {name: table[rows] for name, table in rollout.denoms.items()}
    reducer = seed.TermReducer(denoms, rollout.scales[step], layout, schedule, f"slime {SLIME_COMMIT}")
    token = _CURRENT.set((args, batch, reducer))
    try:
        loss, log = func(args, batch, logits, reducer)
    finally:
        _CURRENT.reset(token)
    if schedule:
        reducer.check_reported(log)
    return loss, log


def pg_loss_reducer(total_lengths, response_lengths, pg_loss_masks, calculate_per_token_loss):
    """slime's ``--custom-pg-loss-reducer-function-path``: pg_loss on the mode. ``pg_loss_masks`` give
    the numerator (the rollout masks, or TIS/RS's modified ones); ``d[i]`` comes from the plan."""
    current = _CURRENT.get()
    if current is None:
        raise RuntimeError(
            "lossagg.integrations.slime.pg_loss_reducer runs inside lossagg.integrations.slime.loss_function "
            "(--loss-type custom_loss --custom-loss-function-path lossagg.integrations.slime.loss_function)"
        )
    _, batch, reducer = current
    planned = _ROLLOUT is not None and _ROLLOUT.per_token
    if bool(calculate_per_token_loss) != planned:
        raise RuntimeError(f"lossagg: calculate_per_token_loss={calculate_per_token_loss} at the loss, {planned} when the rollout was planned")
    if list(total_lengths) != list(batch["total_lengths"]) or list(response_lengths) != list(batch["response_lengths"]):
        raise RuntimeError("lossagg: the pg_loss reducer was asked for samples other than the micro-batch's")
    return reducer.term("pg", pg_loss_masks)


__all__ = [
    "HOOKS",
    "LOSSAGG_FLAGS",
    "SLIME_COMMIT",
    "TERMS",
    "SlimeRollout",
    "add_arguments",
    "config_of",
    "configure",
    "current_rollout",
    "loss_function",
    "parse_args",
    "pg_loss_reducer",
    "plan_rollout",
    "rollout_data_postprocess",
]
