"""``--loss-aggregation`` for slime (THUDM/slime at commit 624b824, where the seed PR's feature was proposed),
through the hooks slime already has; nothing of slime is patched. One line in the launcher (slime's
``train.py``): ``from lossagg.integrations.slime import parse_args`` in place of slime's. It checks the launch
and wires three hooks: the rollout-data postprocess plans every step of the rollout (:func:`plan_rollout`),
the custom loss runs slime's ``policy_loss_function`` with the micro-batch's
:class:`lossagg.integrations.seed.TermReducer`, and the pg_loss reducer reduces pg_loss on the mode. A lossagg
sample is a rollout (``sample_mean`` is slime's default), or under a mode with sessions a training sample in
its rollout's session. docs/trainers/slime.md is the user's page: the scaling, CP, TIS/RS, what is refused.
"""

from __future__ import annotations

from importlib import import_module

import torch

from lossagg.config import ConfigError, LossAggregationConfig
from lossagg.integrations import seed
from lossagg.step import StepPlan

SLIME_COMMIT = "624b824"  # the slime commit this adapter was read against and is tested with (2026-08-21)

HOOK = "--rollout-data-postprocess-path"  # where every step of a rollout is planned
#: The hook paths this module sets (slime's ``load_function`` spells a function ``module.name``).
HOOKS = {
    "rollout_data_postprocess_path": f"{__name__}.rollout_data_postprocess",
    "custom_loss_function_path": f"{__name__}.loss_function",
    "custom_pg_loss_reducer_function_path": f"{__name__}.pg_loss_reducer",
}
LOSSAGG_FLAGS = seed.LAUNCH_FLAGS
#: slime's settings the adapter refuses beside the seed's shared checks: flag -> (whether a launch sets it, why).
REFUSED = {
    "--advantage-estimator": (
        lambda args: getattr(args, "advantage_estimator", None) == "ppo",
        "--advantage-estimator ppo trains a critic in its own Ray actor group, which never calls "
        f"{HOOK} (slime's train_critic) and whose loss slime forces to value_loss on its own reducer, so lossagg can "
        "neither plan nor reduce the value loss: use a critic-free estimator",
    ),
}
# --allgather-cp is served as it is: slime hands the loss every per-token tensor in the zigzag layout either way
# (get_log_probs_and_entropy redistributes the contiguous CP chunks to zigzag shards before the loss runs)
#: What slime's rebuilt reducer (under TIS) divides by, for the refusals.
REBUILT = "each training sample by its rollout's mask total, rollout_mask_sums"


# ----------------------------------------------------------------------- launch
# parse_args (in place of slime's own), add_arguments (lossagg's flags) and config_of (a parsed launch's config)
parse_args, add_arguments, config_of = seed.Launch("slime", "slime.utils.arguments").functions(lambda args: configure(args))


def configure(args) -> LossAggregationConfig | None:
    """Check a parsed slime launch and wire lossagg's hooks into it (in place; safe to call again); returns the
    config, or None (nothing wired) without a lossagg flag. What is refused, by flag and value, and why:
    docs/trainers/slime.md ("Refused")."""
    config = config_of(args)
    if config is None:
        return None
    inner, issues = seed.loss_issues(args, config, HOOKS, f"slime {SLIME_COMMIT}", REBUILT)
    issues += seed.backend_issues(args, "the lossagg adapter serves slime's Megatron actor")
    issues += [(flag, why) for flag, (sets, why) in REFUSED.items() if sets(args)]
    if issues:
        raise ConfigError(issues, "command line")
    seed.wire(args, config, HOOKS, inner, "rollout_data_postprocess_path", "lossagg_user_rollout_data_postprocess_path")
    return config


_ROLLOUT: seed.PlannedSamples | None = None
# columns of the rollout's table
_PRESENT, _STEP, _COUNT, _ROLLOUT_ID, _GROUP, _PRINT = range(6)


def current_rollout() -> seed.PlannedSamples | None:
    """The rollout planned by the last :func:`rollout_data_postprocess` in this process."""
    return _ROLLOUT


def _check_rollout(rollout_data, n: int) -> None:
    """slime's per-sample lists (seed.check_rollout_lists); micro-batches of this rank's samples; one batch size per step."""
    seed.check_rollout_lists(rollout_data, n, ("partition", "rollout_ids", "sample_indices"))
    steps, sizes = len(rollout_data["num_microbatches"]), len(rollout_data["global_batch_sizes"])
    if steps != sizes:
        raise ValueError(f"lossagg: rollout_data holds global_batch_sizes for {sizes} step(s), its schedule (num_microbatches) runs {steps}")
    bad = next((j for mb in rollout_data["micro_batch_indices"] for j in mb if not 0 <= int(j) < n), None)
    if bad is not None:
        raise ValueError(f"lossagg: rollout_data['micro_batch_indices'] names sample {bad}, this rank holds {n} training samples")


def _local_steps(rollout_data, n_local: int) -> list[int]:
    """Each local sample's step, from slime's schedule (``num_microbatches`` micro-batches per step)."""
    _check_rollout(rollout_data, n_local)
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


def _table(args, config, rollout_data, steps: list[int], dp_group) -> list[list[int]]:
    """One row per training sample of the rollout over every DP rank (one sum all-reduce): present, its step + 1,
    its loss tokens, its rollout id, its prompt group and a fingerprint of its prompt."""
    masks, partition = rollout_data["loss_masks"], [int(p) for p in rollout_data["partition"]]
    device = masks[0].device if masks else torch.device("cpu")
    if dp_group is None:
        dp_group = import_module("megatron.core.parallel_state").get_data_parallel_group(with_context_parallel=False)  # in slime's processes
    dp_size = torch.distributed.get_world_size(dp_group) if torch.distributed.is_initialized() else 1
    seed.check_zero_one(masks, partition, "slime")
    counts = torch.stack([(m != 0).sum() for m in masks]).tolist() if masks else []  # one transfer for all the rank's samples
    size = torch.tensor([max(partition, default=-1) + 1], dtype=torch.int64, device=device)
    if dp_size > 1:
        torch.distributed.all_reduce(size, op=torch.distributed.ReduceOp.MAX, group=dp_group)
    rollout_ids, indices = rollout_data.get("rollout_ids"), rollout_data.get("sample_indices")
    grouped = any(t.spec.needs_groups for t in config.loss_terms)
    if grouped and indices is None:
        raise ValueError(f"lossagg: mode={config.mode} needs each rollout's prompt group, read from the rollout's sample_indices, which it has not")
    rows = []
    for j, p in enumerate(partition):
        # a sample with no rollout id is a rollout of its own (slime numbers them so on the rollout side)
        row = [1, steps[j] + 1, int(counts[j]), int(rollout_ids[j]) if rollout_ids is not None else -1 - p, 0, 0]
        if grouped:
            row[_GROUP] = int(indices[j]) // config.n_samples_per_prompt
            prompt = int(rollout_data["total_lengths"][j]) - int(rollout_data["response_lengths"][j])
            row[_PRINT] = seed.prompt_fingerprint(rollout_data["tokens"][j], prompt)
        rows.append(row)
    table = torch.zeros(int(size), 6, dtype=torch.int64)
    if rows:
        table[torch.tensor(partition)] = torch.tensor(rows, dtype=torch.int64)
    if dp_size > 1:
        table = table.to(device)
        torch.distributed.all_reduce(table, group=dp_group)
        table = table.cpu()
    if bool((table[:, _PRESENT] > 1).any()):
        p = int(torch.nonzero(table[:, _PRESENT] > 1)[0, 0])
        raise RuntimeError(f"lossagg: rollout sample {p} is in the partition of {int(table[p, _PRESENT])} DP ranks")
    return table.tolist()


def _step_plan(config, rows: list[int], table: list[list[int]], order: dict[int, int], sessions: bool) -> tuple[StepPlan, dict[int, int]]:
    """One step's plan and each of its table rows' position in it: its samples are the step's rollouts (in the
    order of ``order``), or, under a mode with sessions, its training samples with their rollouts as sessions."""
    grouped = any(t.spec.needs_groups for t in config.loss_terms)
    keys = [table[p][_ROLLOUT_ID] for p in rows] if sessions else list(order)
    position = {p: k for k, p in enumerate(rows)} if sessions else {p: order[table[p][_ROLLOUT_ID]] for p in rows}
    counts, group, prints = [0] * len(keys), [-1] * len(keys), {}
    for p in rows:
        k = position[p]
        counts[k] += table[p][_COUNT]
        if grouped:  # a rollout answers one prompt: its training samples share one group
            first = group[order[table[p][_ROLLOUT_ID]]] if not sessions else table[rows[keys.index(table[p][_ROLLOUT_ID])]][_GROUP]
            if first not in (-1, table[p][_GROUP]):
                raise ValueError(f"lossagg: rollout {table[p][_ROLLOUT_ID]} has training samples of prompt groups {first} and {table[p][_GROUP]}")
            group[k] = table[p][_GROUP]
            prints.setdefault(k, table[p][_PRINT])  # the first training sample's prompt
    group_index = seed.group_index_of(group, [prints[k] for k in range(len(group))], "slime", "rollouts") if grouped else None
    session_index = torch.tensor([order[key] for key in keys], dtype=torch.int64) if sessions else None
    return StepPlan(config, torch.tensor(counts, dtype=torch.int64), group_index=group_index, session_index=session_index), position


def plan_rollout(args, rollout_data, *, dp_group=None) -> seed.PlannedSamples:
    """Every step's plan of this rank's rollout data, with one sum all-reduce over the DP group (``dp_group``;
    default: Megatron's data-parallel group without CP); refreshes ``rollout_mask_sums`` (slime's own reducer
    under TIS reads it) to the rollouts' totals of the masks the steps were planned from."""
    global _ROLLOUT
    config = seed.runtime_config(args, "slime", __name__)
    # under a mode with sessions a lossagg sample is one training sample and its session its rollout (docs/trainers/slime.md)
    sessions = any(t.spec.needs_sessions for t in config.loss_terms)
    masks, partition = rollout_data["loss_masks"], [int(p) for p in rollout_data["partition"]]
    steps = _local_steps(rollout_data, len(masks))
    table = _table(args, config, rollout_data, steps, dp_group)
    per_token = bool(args.calculate_per_token_loss)
    plans, scales, positions = [], [], [0] * len(masks)
    tokens_of: dict[tuple[int, int], int] = {}  # (step, rollout id) -> the rollout's loss tokens
    for s, gbs in enumerate(int(b) for b in rollout_data["global_batch_sizes"]):
        rows = [p for p, row in enumerate(table) if row[_PRESENT] == 1 and row[_STEP] == s + 1]
        order: dict[int, int] = {}
        for p in rows:
            order.setdefault(table[p][_ROLLOUT_ID], len(order))
            tokens_of[(s, table[p][_ROLLOUT_ID])] = tokens_of.get((s, table[p][_ROLLOUT_ID]), 0) + table[p][_COUNT]
        if len(order) != gbs:
            raise RuntimeError(
                f"lossagg: step {s} holds {len(order)} rollouts over the DP ranks, slime divides it by global_batch_size {gbs} (its rollouts)"
            )
        plan, position = _step_plan(config, rows, table, order, sessions)
        plans.append(plan)
        # slime's outer divisor: its rollouts, or on the per-token path Σ max(M[j], 1) over the step's training samples
        scales.append(sum(max(table[p][_COUNT], 1) for p in rows) if per_token else gbs)
        for j, p in enumerate(partition):
            if steps[j] == s:
                positions[j] = position[p]
    if "rollout_mask_sums" in rollout_data:
        own = [float(tokens_of[(steps[j], table[p][_ROLLOUT_ID])]) for j, p in enumerate(partition)]
        rollout_data["rollout_mask_sums"] = torch.tensor(own, dtype=torch.float32, device=masks[0].device if masks else None)
    _ROLLOUT = seed.PlannedSamples(masks, steps, positions, plans, scales, per_token, HOOK, "slime")
    return _ROLLOUT


def rollout_data_postprocess(args, rollout_id, rollout_data):
    """slime's ``--rollout-data-postprocess-path``: the user's own postprocess (if one was set), then :func:`plan_rollout`."""
    user = getattr(args, "lossagg_user_rollout_data_postprocess_path", None)
    if user:
        seed.load(user)(args, rollout_id, rollout_data)
    if getattr(args, "lossagg_config", None) is not None:
        plan_rollout(args, rollout_data)


# ------------------------------------------------------------- the micro-batch
def _local_masks(total_lengths, response_lengths, loss_masks) -> list[torch.Tensor]:
    """This CP rank's part of each sample's loss mask (the zigzag chunks slime's reducer reads)."""
    cp_utils = import_module("slime.backends.megatron_utils.cp_utils")  # slime's, in its processes only
    cp = import_module("megatron.core.parallel_state").get_context_parallel_world_size()
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
    """slime's ``--loss-type custom_loss`` function: the launch's own loss (``policy_loss_function``, or the
    user's custom loss), handed this micro-batch's :class:`lossagg.integrations.seed.TermReducer`."""
    rollout = seed.planned_for_loss(args, _ROLLOUT, __name__, HOOK, "rollout_data_postprocess")
    inner = args.lossagg_inner_loss
    func = import_module("slime.backends.megatron_utils.loss").policy_loss_function if inner == "policy_loss" else seed.load(inner)
    total_lengths, response_lengths = batch["total_lengths"], batch["response_lengths"]

    def layout(masks):
        return seed.layout_of(_local_masks(total_lengths, response_lengths, batch["loss_masks"] if masks is None else masks))

    # the order of the policy loss's calls matters only for the config's terms (none under TIS, which configure checked)
    schedule = seed.schedule_of(args, seed.runtime_config(args, "slime", __name__), inner, entropy_always=True)
    reducer = rollout.reducer(batch["loss_masks"], layout, schedule, f"slime {SLIME_COMMIT}")
    return seed.run_loss(func, args, batch, logits, reducer)


def pg_loss_reducer(total_lengths, response_lengths, pg_loss_masks, calculate_per_token_loss):
    """slime's ``--custom-pg-loss-reducer-function-path``: pg_loss on the mode (:func:`lossagg.integrations.seed.pg_reducer`)."""
    planned = _ROLLOUT is not None and _ROLLOUT.per_token
    return seed.pg_reducer(total_lengths, response_lengths, pg_loss_masks, calculate_per_token_loss, planned, __name__)
