"""``--loss-aggregation`` for slime (THUDM/slime at commit 624b824, where the seed PR's feature was
proposed), through the hooks slime already has (docs/integration.md, "slime"). Nothing of slime is
patched.

One line in the launcher (slime's ``train.py``)::

    # from slime.utils.arguments import parse_args
    from lossagg.integrations.slime import parse_args

Then ``--loss-aggregation MODE`` (any mode of ``lossagg.MODES``), ``--loss-aggregation-divisor``,
``--loss-aggregation-empty-samples``, ``--loss-aggregation-term NAME:COEF[:MODE[:L]]`` and
``--loss-aggregation-config FILE`` are flags of the launch. :func:`parse_args` runs slime's own
``parse_args`` (with these flags added to the user's ``add_custom_arguments``), then
:func:`configure`, which checks the settings against slime's derived ones and wires three hooks:

* ``--rollout-data-postprocess-path`` -> :func:`rollout_data_postprocess`: on every rank, with the
  rank's whole rollout data (after the log-probs and advantages, after the user's own
  postprocess, which it calls first), plans every step of the rollout: one sum all-reduce over
  the DP group of a table with one row per training sample of the rollout, then one
  :class:`lossagg.StepPlan` per step.
* ``--loss-type custom_loss`` with ``--custom-loss-function-path`` -> :func:`loss_function`: runs
  slime's ``policy_loss_function`` (or the user's custom loss) unchanged, handing it the
  reducer of this micro-batch (:class:`SlimeReducer`) in place of slime's ``sum_of_sample_mean``.
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
import sys
from collections.abc import Callable
from importlib import import_module

import torch

from lossagg.config import ConfigError, LossAggregationConfig
from lossagg.integrations import launch
from lossagg.modes import default_term_mode, mode_spec
from lossagg.ops import reduce
from lossagg.step import StepPlan

SLIME_COMMIT = "624b824"  # the slime commit this adapter was read against and is tested with (2026-08-21)

#: The hook paths this module sets (slime's ``load_function`` spells a function ``module.name``).
HOOKS = {
    "rollout_data_postprocess_path": f"{__name__}.rollout_data_postprocess",
    "custom_loss_function_path": f"{__name__}.loss_function",
    "custom_pg_loss_reducer_function_path": f"{__name__}.pg_loss_reducer",
}
#: The flags of a slime launch that switch lossagg on.
LOSSAGG_FLAGS = (*launch.SWITCHES, launch.TERM_FLAG)
#: slime's terms of ``policy_loss_function`` by lossagg term name: the flags of their coefficient.
TERMS = {"entropy": "--entropy-coef", "kl": "--kl-loss-coef"}
#: The order in which slime's ``policy_loss_function`` (at :data:`SLIME_COMMIT`, without TIS) calls the
#: reducer it is handed: the metrics pg_clipfrac and ppo_kl, entropy, then KL under --use-kl-loss;
#: later calls are metrics. Checked after each call against what the function reports.
POLICY_LOSS_CALLS = ("pg_clipfrac", "ppo_kl", "entropy", "kl")
#: What policy_loss_function reports each of those under.
REPORTED = {"pg_clipfrac": "pg_clipfrac", "ppo_kl": "ppo_kl", "entropy": "entropy_loss", "kl": "kl_loss"}
METRIC = "metric"


# ----------------------------------------------------------------------- launch
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """lossagg's flags, for slime's ``parse_args(add_custom_arguments=...)``."""
    return launch.add_arguments(parser, "slime", LOSSAGG_FLAGS)


def parse_args(add_custom_arguments: Callable | None = None):
    """slime's ``parse_args`` with lossagg's flags, then :func:`configure`.

    A refused setting ends the launch as argparse does: ``error: ...`` on stderr, exit status 2.
    """
    trainer_parse_args = import_module("slime.utils.arguments").parse_args  # the peer, imported only here

    def add(parser):
        if add_custom_arguments is not None:
            parser = add_custom_arguments(parser) or parser
        return add_arguments(parser)

    try:
        launch.check_before_trainer(sys.argv[1:], LOSSAGG_FLAGS)
        args = trainer_parse_args(add_custom_arguments=add)
        configure(args)
    except ConfigError as exc:
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(2) from None
    return args


def config_of(args) -> LossAggregationConfig | None:
    """The lossagg config of a parsed slime launch, or None when no lossagg flag was given."""
    return launch.config_of(args, "slime", LOSSAGG_FLAGS)


def _term_issues(args, config: LossAggregationConfig, inner: str) -> list[tuple[str, str]]:
    """The config's terms against the loss slime runs (policy_loss: entropy and KL, with slime's coefficients)."""
    issues: list[tuple[str, str]] = []
    if inner != "policy_loss":
        return issues  # a custom loss reduces its terms through reducer.term(name): they are its own
    flags = (("--use-tis", "use_tis"), ("--get-mismatch-metrics", "get_mismatch_metrics"))
    tis = next((flag for flag, dest in flags if getattr(args, dest, False)), None)
    if tis and config.terms:
        why = f"{tis} makes slime {SLIME_COMMIT} rebuild its reducer inside policy_loss_function (from the modified masks)"
        issues.append((tis, f"{why}, so entropy and KL no longer reach lossagg's: the config's terms ({', '.join(config.terms)}) cannot be served"))
    elif tis and (getattr(args, "entropy_coef", 0.0) or getattr(args, "use_kl_loss", False)):
        # slime's rebuilt reducer is lossagg's default reducer only over rollouts, with empty rollouts counted, on the per-sample path
        why = f"{tis} with entropy or KL on: slime rebuilds their reducer inside policy_loss_function"
        if config.calculate_per_token_loss or default_term_mode(config.mode) != "sample_mean":
            issues.append((tis, f"{why}, dividing by Σ max(M[j], 1) over training samples, not token_mean's c(T): drop the terms or {tis}"))
        elif config.empty_samples == "skip":
            issues.append(("--loss-aggregation-empty-samples", f"{why}, which counts every rollout in N (empty_samples=count), not skip"))
    for name, term in config.terms.items():
        if name not in TERMS:
            issues.append(
                (
                    launch.TERM_FLAG,
                    f"term {name!r}: slime's policy_loss_function reduces the terms {', '.join(TERMS)} besides pg_loss; name one of them, "
                    "or reduce your own term in a custom loss (--custom-loss-function-path) through reducer.term(name)",
                )
            )
            continue
        if name == "kl" and not getattr(args, "use_kl_loss", False):
            issues.append((launch.TERM_FLAG, "term 'kl': slime adds its KL term under --use-kl-loss only, which this launch has not"))
            continue
        slime_coef = -float(args.entropy_coef) if name == "entropy" else float(args.kl_loss_coef)
        if float(term.coefficient) != slime_coef:
            how = "-entropy_coef" if name == "entropy" else "kl_loss_coef"
            issues.append(
                (
                    launch.TERM_FLAG,
                    f"term {name!r} has coefficient {term.coefficient}, slime applies {how} = {slime_coef} ({TERMS[name]} "
                    f"{getattr(args, TERMS[name].lstrip('-').replace('-', '_'))}): make them agree",
                )
            )
    return issues


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
    issues: list[tuple[str, str]] = []
    if config.weighting != "none":
        issues.append(
            (launch.CONFIG_FLAG, f"weighting={config.weighting} needs per-sample weights, which slime does not hand to its reducer: drop weighting")
        )
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
    loss_type = getattr(args, "loss_type", "policy_loss")
    inner = getattr(args, "lossagg_inner_loss", None)
    if inner is None:  # first call
        if loss_type == "policy_loss":
            inner = "policy_loss"
        elif loss_type == "custom_loss":
            inner = getattr(args, "custom_loss_function_path", None)
        else:
            issues.append(
                ("--loss-type", f"--loss-aggregation reduces pg_loss, which --loss-type {loss_type} has not: use policy_loss or custom_loss")
            )
        reducer = getattr(args, "custom_pg_loss_reducer_function_path", None)
        if reducer not in (None, HOOKS["custom_pg_loss_reducer_function_path"]):
            issues.append(
                (
                    "--custom-pg-loss-reducer-function-path",
                    f"--custom-pg-loss-reducer-function-path {reducer} and --loss-aggregation {config.mode} both reduce pg_loss: drop one",
                )
            )
    if inner is not None:
        issues += _term_issues(args, config, inner)
    if issues:
        raise ConfigError(issues, "command line")
    if getattr(args, "lossagg_inner_loss", None) is None:
        user = getattr(args, "rollout_data_postprocess_path", None)
        args.lossagg_user_rollout_data_postprocess_path = user if user != HOOKS["rollout_data_postprocess_path"] else None
        args.lossagg_inner_loss = inner
        for name, path in HOOKS.items():
            setattr(args, name, path)
        args.loss_type = "custom_loss"
    # slime's per-token path is token_mean's (the config resolves the legacy flag both ways)
    args.calculate_per_token_loss = bool(config.calculate_per_token_loss)
    args.lossagg_config = config.summary()
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
    spec = mode_spec(config.mode)
    needs_groups = spec.needs_groups or any(mode_spec(t.mode).needs_groups for t in config.terms.values())
    masks = rollout_data["loss_masks"]
    partition = [int(p) for p in rollout_data["partition"]]
    n_local = len(masks)
    steps = _local_steps(rollout_data, n_local)
    device = masks[0].device if n_local else torch.device("cpu")
    if dp_group is None:
        mpu = import_module("megatron.core.parallel_state")  # the trainer's Megatron, in slime's processes only
        dp_group = mpu.get_data_parallel_group(with_context_parallel=False)
    dp_size = torch.distributed.get_world_size(dp_group) if torch.distributed.is_initialized() else 1
    odd = [j for j, m in enumerate(masks) if bool(((m != 0) & (m != 1)).any())]
    if odd:
        raise ValueError(
            f"lossagg: the loss mask of rollout sample {partition[odd[0]]} is not 0/1: d[i] counts tokens, slime's reducer multiplies by the mask"
        )
    size = torch.tensor([max(partition, default=-1) + 1], dtype=torch.int64, device=device)
    if dp_size > 1:
        torch.distributed.all_reduce(size, op=torch.distributed.ReduceOp.MAX, group=dp_group)
    table = torch.zeros(int(size), 6, dtype=torch.int64)
    rollout_ids = rollout_data.get("rollout_ids")
    indices = rollout_data.get("sample_indices")
    if needs_groups and indices is None:
        raise ValueError(f"lossagg: mode={config.mode} needs each rollout's prompt group, read from the rollout's sample_indices, which it has not")
    for j, p in enumerate(partition):
        table[p, _PRESENT] = 1
        table[p, _STEP] = steps[j] + 1
        table[p, _COUNT] = int((masks[j] != 0).sum())
        # a sample with no rollout id is a rollout of its own (slime numbers them so on the rollout side)
        table[p, _ROLLOUT_ID] = int(rollout_ids[j]) if rollout_ids is not None else -1 - p
        if needs_groups:
            table[p, _GROUP] = int(indices[j]) // config.n_samples_per_prompt
            prompt_length = int(rollout_data["total_lengths"][j]) - int(rollout_data["response_lengths"][j])
            table[p, _PRINT] = _prompt_fingerprint(rollout_data["tokens"][j], prompt_length)
    if dp_size > 1:
        table = table.to(device)
        torch.distributed.all_reduce(table, group=dp_group)
        table = table.cpu()
    if bool((table[:, _PRESENT] > 1).any()):
        p = int(torch.nonzero(table[:, _PRESENT] > 1)[0, 0])
        raise RuntimeError(f"lossagg: rollout sample {p} is in the partition of {int(table[p, _PRESENT])} DP ranks")
    batch_sizes = [int(b) for b in rollout_data["global_batch_sizes"]]
    per_token = bool(args.calculate_per_token_loss)
    local_rollout = [-1] * n_local  # each local sample's rollout, as a row of its step's plan
    plans, scales, step_tables = [], [], []
    for s, gbs in enumerate(batch_sizes):
        rows = torch.nonzero((table[:, _PRESENT] == 1) & (table[:, _STEP] == s + 1)).flatten().tolist()
        order: dict[int, int] = {}
        for p in rows:
            order.setdefault(int(table[p, _ROLLOUT_ID]), len(order))
        if len(order) != gbs:
            raise RuntimeError(
                f"lossagg: step {s} holds {len(order)} rollouts over the DP ranks, slime divides it by global_batch_size {gbs} (its rollouts)"
            )
        counts = torch.zeros(len(order), dtype=torch.int64)
        group = torch.full((len(order),), -1, dtype=torch.int64)
        prints = {}
        of_position = {}
        for p in rows:
            r = order[int(table[p, _ROLLOUT_ID])]
            of_position[p] = r
            counts[r] += table[p, _COUNT]
            if needs_groups:
                g = int(table[p, _GROUP])
                if int(group[r]) not in (-1, g):
                    raise ValueError(f"lossagg: rollout {int(table[p, _ROLLOUT_ID])} has training samples of prompt groups {int(group[r])} and {g}")
                group[r] = g
                prints.setdefault(r, int(table[p, _PRINT]))  # the rollout's first training sample's prompt
        group_index = None
        if needs_groups:
            keys, group_index = torch.unique(group, return_inverse=True)
            for k in range(keys.numel()):
                seen = {prints[r] for r in torch.nonzero(group_index == k).flatten().tolist()}
                if len(seen) != 1:
                    raise ValueError(
                        f"lossagg: the rollouts of prompt group {int(keys[k])} (sample_index // n_samples_per_prompt, as slime's data source "
                        "numbers them) have different prompts: this rollout's samples are not numbered by group"
                    )
        plan = StepPlan(config, counts, group_index=group_index)
        plans.append(plan)
        step_counts = table[rows, _COUNT]
        scales.append(int(step_counts.clamp(min=1).sum()) if per_token else gbs)
        step_tables.append({**plan.term_denoms, METRIC: plan.metric_denoms})
        for j, p in enumerate(partition):
            if steps[j] == s:
                local_rollout[j] = of_position[p]
    denoms = {name: torch.zeros(n_local, dtype=torch.float64) for name in (*names, METRIC)}
    for j in range(n_local):
        for name in denoms:
            denoms[name][j] = step_tables[steps[j]][name][local_rollout[j]]
    # slime's own reducer (rebuilt inside policy_loss_function under TIS) divides by rollout_mask_sums: the
    # rollouts' token totals of the masks the steps were planned from (a user's postprocess may have changed them)
    rollout_tokens = [float(plans[steps[j]].token_counts[local_rollout[j]]) for j in range(n_local)]
    if "rollout_mask_sums" in rollout_data:
        rollout_data["rollout_mask_sums"] = torch.tensor(rollout_tokens, dtype=torch.float32, device=device)
    _ROLLOUT = SlimeRollout(masks, steps, denoms, scales, plans, per_token)
    return _ROLLOUT


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
class SlimeReducer:
    """The reducer of one micro-batch, handed to slime's loss in place of ``sum_of_sample_mean``.

    ``reducer(x)`` reduces ``x`` (this CP rank's per-token values of the micro-batch's samples,
    concatenated as slime lays them out) by the default reducer; ``reducer.term(name)(x)`` by the
    term's own mode (``"pg"`` or a term of the config). Each returns the micro-batch's share of the
    term's ``J_k`` times slime's outer divisor (module docstring). Under a schedule (slime's
    ``policy_loss_function``), the n-th plain call reduces the n-th term of the schedule.
    """

    def __init__(self, rollout: SlimeRollout, step: int, rows: list[int], total_lengths, response_lengths, loss_masks, schedule=()):
        self.rollout = rollout
        self.step = step
        self.rows = rows
        self.scale = rollout.scales[step] if step >= 0 else 1
        self._layout = _local_layout(total_lengths, response_lengths, loss_masks)
        self.schedule = tuple(schedule)
        self.calls: list[tuple[str, torch.Tensor]] = []

    def term(self, name: str, loss_masks=None) -> Callable[[torch.Tensor], torch.Tensor]:
        if name not in self.rollout.denoms:
            raise KeyError(f"lossagg: no term {name!r} in the config; its terms: {', '.join(n for n in self.rollout.denoms if n != METRIC)}")
        d = self.rollout.denoms[name][self.rows]
        mask, cu_seqlens = self._layout if loss_masks is None else _local_layout(*loss_masks)

        def reduce_term(x: torch.Tensor) -> torch.Tensor:
            if x.dim() != 1 or x.shape[0] != int(cu_seqlens[-1]):
                raise ValueError(
                    f"lossagg: {name} holds {tuple(x.shape)} values, this CP rank's response tokens of the micro-batch are {int(cu_seqlens[-1])}"
                )
            share = reduce(x, mask.to(x.device), cu_seqlens=cu_seqlens.to(x.device), sample_denoms=d.to(x.device))
            return share * self.scale

        return reduce_term

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.calls)
        name = self.schedule[n] if n < len(self.schedule) else METRIC
        out = self.term(name if name in self.rollout.denoms else METRIC)(x)
        self.calls.append((name, out))
        return out

    def check_reported(self, reported) -> None:
        """Each scheduled call's result against what the loss reports under its name: the schedule is the loss's own order."""
        for name, out in self.calls:
            key = REPORTED.get(name)
            if key is None:
                continue
            got = reported.get(key)
            if got is None or not torch.equal(torch.as_tensor(got).detach().to(out.device, out.dtype), out.detach()):
                raise RuntimeError(
                    f"lossagg: slime's policy_loss_function reported {key}={got!r} where lossagg's reducer returned {float(out)!r} for it: "
                    f"this slime does not call its reducer in the order of slime {SLIME_COMMIT} ({', '.join(POLICY_LOSS_CALLS)}), so the "
                    "config's terms cannot be told apart"
                )


def _local_layout(total_lengths, response_lengths, loss_masks) -> tuple[torch.Tensor, torch.Tensor]:
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
    lengths = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu_seqlens[1:])
    mask = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
    return mask, cu_seqlens


def loss_function(args, batch, logits, sum_of_sample_mean):
    """slime's ``--loss-type custom_loss`` function: the launch's own loss (``policy_loss_function``, or
    the user's custom loss), handed this micro-batch's :class:`SlimeReducer`."""
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
    config = rollout.plans[0].config if rollout.plans else None
    tis = getattr(args, "use_tis", False) or getattr(args, "get_mismatch_metrics", False)
    if inner == "policy_loss":
        func = import_module("slime.backends.megatron_utils.loss").policy_loss_function
        # the order matters only where a term's reducer is not the default one; without TIS (which configure checked)
        schedule = POLICY_LOSS_CALLS if (config is not None and config.terms and not tis) else ()
        if not getattr(args, "use_kl_loss", False):
            schedule = tuple(n for n in schedule if n != "kl")
    else:
        func = _load(inner)
        schedule = ()
    reducer = SlimeReducer(rollout, step, rows, batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], schedule)
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
    _, _, reducer = current
    if bool(calculate_per_token_loss) != reducer.rollout.per_token:
        raise RuntimeError(f"lossagg: calculate_per_token_loss={calculate_per_token_loss} at the loss, {reducer.rollout.per_token} when planned")
    return reducer.term("pg", (total_lengths, response_lengths, pg_loss_masks))


__all__ = [
    "HOOKS",
    "LOSSAGG_FLAGS",
    "POLICY_LOSS_CALLS",
    "SLIME_COMMIT",
    "TERMS",
    "SlimeReducer",
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
