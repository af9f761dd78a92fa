"""lossagg.integrations.slime inside slime's own training step (THUDM/slime at 624b824), on CPU (gloo).

The worlds run slime's ``train()`` (``slime.backends.megatron_utils.model``) over a rollout of two
steps: its ``train_one_step``, its data iterator and ``get_batch`` (zigzag CP shards), its
``loss_function`` and ``policy_loss_function`` (its reducers, TIS and outer scaling), Megatron's
schedule, ``DistributedDataParallel`` and ``finalize_model_grads``. The rollout data of each DP rank is
what slime's rollout side hands it: the schedule from slime's own ``build_dp_schedule`` (static or
dynamic micro-batches, unequal sample counts per rank), fan-out rollouts (one rollout emitting 1-3
training samples under one ``rollout_id``, as slime's compact rollouts do), slime's
``rollout_mask_sums``, tensors as slime's ``tensorize_rollout_data_for_training`` and its actor leave
them; then the postprocess hook and ``train()``, in the actor's order. The launches come from slime's own
``parse_args`` (``--debug-train-only``), through ``lossagg.integrations.slime.parse_args`` or slime's alone.

The model is float32 (slime asserts float32 logits). The optimizer is a recorder: each step's
``main_grad`` must equal the gradient of the float64 reference J of that step's rollouts (unsplit) to
2e-5 of the largest gradient entry: the float32 forward rounds each logit, log-prob and entropy at
~6e-8 relative and the step sums ~100 tokens' gradients in float32, which stays below 1e-6; the
mode errors the test must catch are O(1e-1) (a mutated reference, slime's per-rollout default where
the mode is prompt_mean, is checked to fail by more than 100 times the tolerance).

Stand-ins: slime's device calls go to a CPU accelerator through slime's public
``slime.utils.accelerator.set_accelerator``; Megatron's CUDA calls on the way
(``torch.cuda.current_device`` in the grad buffers, ``torch.zeros(..., device="cuda")`` in the schedule)
are served on the CPU, each only from the file that makes it (tests/stand_ins.py).
"""

from __future__ import annotations

import os
import pickle
import sys

import pytest
import slime_peer
import torch
from seed_train import (
    PROMPT_LEN,
    SEED_REFUSALS,
    VOCAB,
    RecordingOptimizer,
    Scheduler,
    ToyLM,
    check_launches,
    checked_launches,
    launches_file,
    parse_launches,
    rejected,
    toy_ddp_model,
    without,
)
from stand_ins import install_megatron_core_stand_ins
from tiers import full_tier
from worlds import crashed, join, leave, run_world

import lossagg
from lossagg.modes import default_term_mode

pytestmark = pytest.mark.xdist_group("slime")

N_PER_PROMPT, PROMPTS, STEPS = 2, 6, 2
ENTROPY_COEF, KL_COEF = 0.1, 0.05
TOLERANCE = 2e-5

BASE_ARGV = [
    "train.py",
    "--debug-train-only",
    "--rollout-batch-size", str(PROMPTS),
    "--n-samples-per-prompt", str(N_PER_PROMPT),
    "--num-steps-per-rollout", str(STEPS),
    "--num-rollout", "1",
    "--actor-num-nodes", "1",
    "--actor-num-gpus-per-node", "1",
    "--num-layers", "1",
    "--hidden-size", "8",
    "--num-attention-heads", "1",
    "--micro-batch-size", "1",
    "--seq-length", "64",
    "--max-position-embeddings", "64",
    "--eps-clip", "0.2",
]  # fmt: skip
#: entropy and KL on; slime checks that --ref-load exists when KL is on (the reference log-probs here come with the rollout)
TERMS = [
    "--entropy-coef",
    str(ENTROPY_COEF),
    "--use-kl-loss",
    "--kl-loss-coef",
    str(KL_COEF),
    "--kl-loss-type",
    "k2",
    "--ref-load",
    os.path.dirname(__file__),
]
TIS = ["--use-tis", "--tis-clip", "1.3", "--tis-clip-low", "0.8", "--custom-tis-function-path", "seed_train.rejecting_tis_function"]

#: name -> (extra flags, lossagg config of the reference (None: slime's own reducer), {term: mode} of the reference)
CASES = {
    "slime_default": (TERMS, None, {}),
    "slime_per_token": (["--calculate-per-token-loss"], None, {}),
    "sample_mean": (["--loss-aggregation", "sample_mean"], {"mode": "sample_mean"}, {}),
    "prompt_mean": (["--loss-aggregation", "prompt_mean"], {"mode": "prompt_mean"}, {}),
    "token_mean": (["--loss-aggregation", "token_mean"], {"mode": "token_mean"}, {}),
    "legacy_per_token": (["--loss-aggregation", "token_mean", "--calculate-per-token-loss"], {"mode": "token_mean"}, {}),
    "constant": (["--loss-aggregation", "constant", "--loss-aggregation-divisor", "6"], {"mode": "constant", "divisor": 6.0}, {}),
    "max_length": (["--loss-aggregation", "max_length"], {"mode": "max_length"}, {}),
    "registered_mode": (["--loss-aggregation", "sample_sq"], {"mode": "sample_sq"}, {}),  # tests/test_mode_registry.py's, registered in each process
    "prompt_mean_skip": (
        ["--loss-aggregation", "prompt_mean", "--loss-aggregation-empty-samples", "skip"],
        {"mode": "prompt_mean", "empty_samples": "skip"},
        {},
    ),
    "sample_mean_default_terms": (["--loss-aggregation", "sample_mean", *TERMS], {"mode": "sample_mean"}, {}),
    "token_mean_default_terms": (["--loss-aggregation", "token_mean", *TERMS], {"mode": "token_mean"}, {}),
    "prompt_mean_terms": (
        ["--loss-aggregation", "prompt_mean", *TERMS]
        + ["--loss-aggregation-term", f"entropy:{-ENTROPY_COEF}:token_mean", "--loss-aggregation-term", f"kl:{KL_COEF}:max_length"],
        {"mode": "prompt_mean"},
        {"entropy": "token_mean", "kl": "max_length"},
    ),
    # KL alone at slime's default --entropy-coef 0: slime still calls its reducer for entropy (a schedule that skipped that
    # call would reduce KL on entropy's reducer)
    "prompt_mean_kl_only": (
        ["--loss-aggregation", "prompt_mean", *without(TERMS, "--entropy-coef"), "--loss-aggregation-term", f"kl:{KL_COEF}:token_mean"],
        {"mode": "prompt_mean"},
        {"kl": "token_mean"},
    ),
    "prompt_mean_tis": (["--loss-aggregation", "prompt_mean", "--entropy-coef", str(ENTROPY_COEF), *TIS], {"mode": "prompt_mean"}, {}),
    "user_postprocess": (
        ["--loss-aggregation", "prompt_mean", "--rollout-data-postprocess-path", "test_slime_train.user_postprocess"],
        {"mode": "prompt_mean"},
        {},
    ),
    # sessions (docs/modes.md, "Sessions"): a training sample is a sample, its rollout its session
    "session_token_mean_is_slime": (
        ["--loss-aggregation", "session_token_mean", *TERMS]
        + ["--loss-aggregation-term", f"entropy:{-ENTROPY_COEF}:session_token_mean", "--loss-aggregation-term", f"kl:{KL_COEF}:session_token_mean"],
        {"mode": "session_token_mean"},
        {"entropy": "session_token_mean", "kl": "session_token_mean"},
    ),
    "session_mean": (["--loss-aggregation", "session_mean", *TERMS], {"mode": "session_mean"}, {}),
    "prompt_session_mean_skip": (
        ["--loss-aggregation", "prompt_session_mean", "--loss-aggregation-empty-samples", "skip", *TERMS]
        + ["--loss-aggregation-term", f"kl:{KL_COEF}:prompt_session_token_mean", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "14"],
        {"mode": "prompt_session_mean", "empty_samples": "skip"},
        {"kl": "prompt_session_token_mean"},
    ),
    # --allgather-cp (contiguous CP chunks for the model; slime redistributes log-probs and entropy to zigzag shards)
    "prompt_mean_terms_allgather": (
        ["--loss-aggregation", "prompt_mean", *TERMS]
        + ["--loss-aggregation-term", f"entropy:{-ENTROPY_COEF}:token_mean", "--loss-aggregation-term", f"kl:{KL_COEF}:max_length"],
        {"mode": "prompt_mean"},
        {"entropy": "token_mean", "kl": "max_length"},
    ),
    "token_mean_default_terms_allgather": (["--loss-aggregation", "token_mean", *TERMS], {"mode": "token_mean"}, {}),
    "prompt_mean_dynamic": (
        ["--loss-aggregation", "prompt_mean", *TERMS, "--loss-aggregation-term", f"kl:{KL_COEF}:token_mean"]
        + ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "14"],
        {"mode": "prompt_mean"},
        {"kl": "token_mean"},
    ),
}

#: cases launched through lossagg whose reference is slime's own reducer: the same J, by another name
SAME_AS_SLIME = ("session_token_mean_is_slime",)

#: run before each launch's parsing, in the parsing subprocess
PARSE_PRELUDE = (
    slime_peer.TYPING
    + r"""
import os, sys
sys.path.insert(0, os.environ["LOSSAGG_TESTS_DIR"])
from test_mode_registry import register_throwaway
register_throwaway()  # a registered mode: the registry is per process
"""
)


def need_slime():
    why = slime_peer.unavailable()
    if why:
        # CI installs slime (scripts/install_slime.sh): a missing slime there is a failure, never a skip
        (pytest.fail if os.environ.get("CI") else pytest.skip)(why)


@pytest.fixture(scope="session")  # once per worker: xdist interleaves files, which would redo a module fixture
def parsed_launches(tmp_path_factory):
    """Every launch of this file (the worlds' cases and the launch checks) parsed by slime's parse_args in one
    subprocess (slime's import paid once): name -> what parse_launches gives, the checks' names prefixed "check:"."""
    need_slime()
    train = {name: (config is not None or name in SAME_AS_SLIME, BASE_ARGV + flags) for name, (flags, config, _) in CASES.items()}
    checks = {f"check:{name}": launch for name, launch in check_launches_argv(tmp_path_factory.mktemp("slime-checks")).items()}
    env = {**slime_peer.env(), "LOSSAGG_TESTS_DIR": os.path.dirname(os.path.abspath(__file__))}
    return parse_launches({**train, **checks}, env=env, adapter="lossagg.integrations.slime", own="slime.utils.arguments", prelude=PARSE_PRELUDE)


@pytest.fixture(scope="session")
def launches(parsed_launches, tmp_path_factory):
    return launches_file({name: parsed_launches[name] for name in CASES}, tmp_path_factory, "slime")


# ----------------------------------------------------------------------- stand-ins


def install_stand_ins():
    from slime.utils import accelerator
    from slime.utils.accelerator.base import Accelerator

    used = install_megatron_core_stand_ins()
    used["accelerator"] = 0

    class CPUAccelerator(Accelerator):
        """slime's accelerator contract on the CPU (slime.utils.accelerator.set_accelerator, public for tests)."""

        name, device_type, communication_backend_name = "cpu", "cpu", "gloo"

        def is_available(self):
            return True

        def device(self, index=None):
            used["accelerator"] += 1
            return torch.device("cpu")

        def device_name(self, index=None):
            return "cpu"

        def set_device(self, index):
            pass

        def current_device(self):
            used["accelerator"] += 1
            return "cpu"

        def device_count(self):
            return 1

        def synchronize(self, device=None):
            pass

        def current_stream(self, device=None):
            return None

        def empty_cache(self):
            pass

        def mem_get_info(self, device=None):
            return (1, 1)

        def memory_allocated(self, device=None):
            return 0

        def memory_reserved(self, device=None):
            return 0

    accelerator.set_accelerator(CPUAccelerator())
    return used


# --------------------------------------------------------------------- the rollout
def make_rollout(seed=0):
    """Every training sample of the rollout, in rollout order: rollout r (prompt group r // n) emits
    1 + r % 3 training samples sharing its rollout_id and sample index (slime's compact fan-out)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for r in range(PROMPTS * N_PER_PROMPT):
        group = r // N_PER_PROMPT
        prompt = torch.tensor([(group * 3 + k) % VOCAB for k in range(PROMPT_LEN)], dtype=torch.long)
        for _ in range(1 + r % 3):
            n = int(torch.randint(2, 10, (1,), generator=g))
            response = torch.randint(0, VOCAB, (n,), generator=g)
            mask = (torch.rand(n, generator=g) < 0.8).to(torch.int)
            if r == 4:
                mask.zero_()  # an empty rollout (its two training samples have no loss token)
            samples.append(
                dict(
                    tokens=torch.cat([prompt, response]),
                    response_length=n,
                    loss_mask=mask,
                    old_log_prob=-torch.rand(n, generator=g, dtype=torch.float64) * 2,
                    rollout_log_prob=-torch.rand(n, generator=g, dtype=torch.float64) * 2,
                    ref_log_prob=-torch.rand(n, generator=g, dtype=torch.float64) * 2,
                    advantage=torch.full((n,), float(torch.randn(1, generator=g, dtype=torch.float64)), dtype=torch.float64),
                    index=r,
                    rollout_id=r,
                )
            )
    return samples


def user_postprocess(args, rollout_id, rollout_data):
    """A user's ``--rollout-data-postprocess-path`` that filters tokens: the first response token of every
    training sample leaves the loss mask (in place), before lossagg plans the steps."""
    for m in rollout_data["loss_masks"]:
        m[0] = 0


def postprocessed(samples):
    """The rollout as :func:`user_postprocess` leaves it."""
    out = []
    for s in samples:
        mask = s["loss_mask"].clone()
        mask[0] = 0
        out.append({**s, "loss_mask": mask})
    return out


def step_rollouts(samples, step):
    gbs = PROMPTS * N_PER_PROMPT // STEPS
    return [s for s in samples if step * gbs <= s["rollout_id"] < (step + 1) * gbs]


def reference_j(case, samples, step, args, *, mutated=False):
    """The step's float64 J (unsplit), over rollouts: pg_loss on the mode (or slime's default reducer),
    entropy and KL on their own modes (or the default reducer), from a float64 copy of the model."""
    from lossagg.testing import reference_loss

    _, case_config, term_modes = CASES[case]
    if mutated or case in SAME_AS_SLIME:  # slime's per-rollout default (where the case has its mode: mutated)
        case_config, term_modes = None, {}
    chosen = step_rollouts(postprocessed(samples) if case == "user_postprocess" else samples, step)
    model = ToyLM()
    per_token = bool(args.calculate_per_token_loss)
    tis = bool(args.use_tis)
    values = {"pg": [], "entropy": [], "kl": []}
    masks, kept, lengths, rollout_of = [], [], [], []
    for s in chosen:
        logits = model(s["tokens"])
        n = s["response_length"]
        logp_all = torch.log_softmax(logits[-n - 1 : -1], -1)
        lp = logp_all.gather(-1, s["tokens"][-n:, None]).squeeze(-1)
        ratio = torch.exp(lp - s["old_log_prob"])
        a = s["advantage"]
        pg = torch.maximum(-ratio * a, -ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip_high) * a)
        m = s["loss_mask"].bool()
        if tis:
            pg = pg * torch.clamp(torch.exp(s["old_log_prob"] - s["rollout_log_prob"]), min=args.tis_clip_low, max=args.tis_clip)
            kept.append(m & ~rejected(n))
        values["pg"].append(pg)
        values["entropy"].append(-(logp_all.exp() * logp_all).sum(-1))
        values["kl"].append((lp - s["ref_log_prob"]) ** 2 / 2)  # k2
        masks.append(m)
        lengths.append(n)
        rollout_of.append(s["rollout_id"])
    # a rollout is one lossagg sample: its training samples' tokens side by side
    ids = sorted(set(rollout_of))
    order = [j for r in ids for j in range(len(chosen)) if rollout_of[j] == r]
    cu_rollouts = lossagg.cu_seqlens_from_lengths(
        torch.tensor([sum(lengths[j] for j in order if rollout_of[j] == r) for r in ids]), dtype=torch.int64
    )
    cu = cu_rollouts
    groups = torch.tensor([r // N_PER_PROMPT for r in ids])
    groups = torch.unique(groups, return_inverse=True)[1]
    sessions = None
    if CASES[case][1] is not None and any(lossagg.MODES[m].needs_sessions for m in (CASES[case][1]["mode"], *CASES[case][2].values())):
        # under a mode with sessions a training sample is a sample, its rollout its session (the same tokens, cut finer)
        cu = lossagg.cu_seqlens_from_lengths(torch.tensor([lengths[j] for j in order]), dtype=torch.int64)
        sessions = torch.tensor([rollout_of[j] for j in order])
        groups = torch.unique(sessions // N_PER_PROMPT, return_inverse=True)[1]
    mask = torch.cat([masks[j] for j in order])
    numerator = torch.cat([kept[j] for j in order]) if tis else mask
    cat = {k: torch.cat([v[j] for j in order]) for k, v in values.items()}
    rollout_tokens = torch.tensor([float(mask[cu_rollouts[i] : cu_rollouts[i + 1]].sum()) for i in range(len(ids))], dtype=torch.float64)
    sample_tokens = torch.tensor([float(m.sum()) for m in masks], dtype=torch.float64)

    def slime_default(x, num):
        sums = torch.stack([(x[cu_rollouts[i] : cu_rollouts[i + 1]] * num[cu_rollouts[i] : cu_rollouts[i + 1]]).sum() for i in range(len(ids))])
        if per_token:
            return sums.sum() / sample_tokens.clamp(min=1).sum()  # slime's per-token path: Σ max(M[j], 1) over training samples
        return (sums / rollout_tokens.clamp(min=1)).sum() / len(ids)

    if case_config is None:
        j = slime_default(cat["pg"], numerator)
        reducers = {}
    else:
        config = lossagg.LossAggregationConfig(n_samples_per_prompt=N_PER_PROMPT, **case_config)
        j = reference_loss(config, cat["pg"], numerator, cu, groups, session_index=sessions, **({"rollout_mask": mask} if tis else {}))
        default = default_term_mode(config.mode)
        reducers = {
            k: lossagg.LossAggregationConfig(n_samples_per_prompt=N_PER_PROMPT, mode=term_modes.get(k, default), empty_samples=config.empty_samples)
            for k in ("entropy", "kl")
        }
    for k, coef in (("entropy", -float(args.entropy_coef)), ("kl", float(args.kl_loss_coef) if args.use_kl_loss else 0.0)):
        if coef == 0.0:
            continue
        if k not in reducers or tis:  # slime's own reducer (rebuilt inside policy_loss_function under TIS: modified masks, rollout totals)
            term = slime_default(cat[k], numerator)
        else:
            term = reference_loss(reducers[k], cat[k], mask, cu, groups, session_index=sessions)
        j = j + coef * term
    return j, model, float(sample_tokens.clamp(min=1).sum())


def reference_grads(case, samples, step, args, *, mutated=False):
    j, model, reported = reference_j(case, samples, step, args, mutated=mutated)
    j.backward()
    return [model.embed.grad, model.head.grad]


def rank_rollout(samples, dp_rank, dp, cp, args):
    """This DP rank's rollout data as slime's rollout side and actor hand it to train(): slime's own
    schedule (build_dp_schedule), its per-rank packaging and tensors, CP-local log-probs."""
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp
    from slime.observability.rollout_data_utils import tensorize_rollout_data_for_training
    from slime.utils.dp_schedule import build_dp_schedule

    total_lengths = [int(s["tokens"].numel()) for s in samples]
    parallel = {"dp_size": dp, "cp_size": cp, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    rollout_ids = [s["rollout_id"] for s in samples]
    partitions, schedule, num_microbatches, batch_sizes = build_dp_schedule(
        args, parallel, total_lengths, global_batch_size=args.global_batch_size, rollout_indices=rollout_ids
    )
    totals = {}
    for s in samples:  # slime's rollout_mask_sums: each rollout's mask total, per training sample
        totals[s["rollout_id"]] = totals.get(s["rollout_id"], 0) + int(s["loss_mask"].sum())
    part = partitions[dp_rank]
    mine = [samples[j] for j in part]
    data = {
        "partition": part,
        "tokens": [s["tokens"].tolist() for s in mine],
        "response_lengths": [s["response_length"] for s in mine],
        "loss_masks": [s["loss_mask"].tolist() for s in mine],
        "sample_indices": [s["index"] for s in mine],
        "rollout_ids": [s["rollout_id"] for s in mine],
        "rollout_mask_sums": [totals[s["rollout_id"]] for s in mine],
        "rollout_log_probs": [s["rollout_log_prob"].tolist() for s in mine],
    }
    tensorize_rollout_data_for_training(data)
    data["total_lengths"] = [total_lengths[j] for j in part]
    data["global_batch_sizes"] = batch_sizes
    data["num_microbatches"] = num_microbatches
    data["micro_batch_indices"] = schedule[dp_rank]
    # what the actor's _get_rollout_data and the log-prob / advantage passes leave
    data["tokens"] = [t.to(torch.long) for t in data["tokens"]]
    data["loss_masks"] = [t.to(torch.int) for t in data["loss_masks"]]
    data["rollout_mask_sums"] = data["rollout_mask_sums"].to(torch.float32)
    local = [(s, t, r) for s, t, r in zip(mine, data["total_lengths"], data["response_lengths"], strict=True)]
    for key, field in (
        ("rollout_log_probs", "rollout_log_prob"),
        ("log_probs", "old_log_prob"),
        ("ref_log_probs", "ref_log_prob"),
        ("advantages", "advantage"),
    ):
        data[key] = [slice_log_prob_with_cp(s[field], t, r).to(torch.float32) for s, t, r in local]
    return data


# ------------------------------------------------------------------------ the world
def worker(rank, world, layouts, launches_path, init_file, results_dir):
    slime_peer.enter()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch.distributed as dist

    failures, ran = join(rank, world, init_file)
    try:
        from test_mode_registry import register_throwaway

        register_throwaway()  # the registry is per process: the launch's mode, in every rank
        used = install_stand_ins()
        import slime.backends.megatron_utils.loss as slime_loss
        from megatron.core import parallel_state as mpu
        from megatron.training.global_vars import set_args
        from slime.backends.megatron_utils import model as slime_model
        from slime.backends.megatron_utils.data import get_data_iterator
        from slime.utils.misc import load_function

        redistribute = slime_loss._allgather_cp_redistribute

        def counted_redistribute(*args, **kwargs):  # the allgather-CP layout's own step, counted
            used["allgather"] += 1
            return redistribute(*args, **kwargs)

        used["allgather"] = 0
        slime_loss._allgather_cp_redistribute = counted_redistribute
        launches = pickle.loads(open(launches_path, "rb").read())
        samples = make_rollout()
        for cp in layouts:
            dp = world // cp
            mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=cp)
            dp_rank = mpu.get_data_parallel_rank()
            for name in CASES:
                args = pickle.loads(launches[name])
                args.world_size, args.rank = world, rank
                args.context_parallel_size, args.data_parallel_size = cp, dp
                args.bf16 = False
                # slime's parse_args refuses --allgather-cp with CP > 1 for its non-DSA models; its train step runs it for any
                args.allgather_cp = name.endswith("_allgather")
                set_args(args)
                module, model = toy_ddp_model(args, cp, torch.float32)  # slime asserts float32 logits
                optimizer = RecordingOptimizer(module)
                rollout = rank_rollout(samples, dp_rank, dp, cp, args)
                data_iterator = get_data_iterator(rollout)
                if args.rollout_data_postprocess_path is not None:  # as the actor's train_actor does, before train()
                    load_function(args.rollout_data_postprocess_path)(args, 0, rollout)
                slime_model.train(0, [model], optimizer, Scheduler(), data_iterator, rollout["num_microbatches"], rollout["global_batch_sizes"])
                counts = torch.tensor([len(rollout["partition"])])
                if dp > 1:
                    all_counts = [torch.zeros_like(counts) for _ in range(dp)]
                    dist.all_gather(all_counts, counts, group=mpu.get_data_parallel_group())
                    if name == "prompt_mean_dynamic" and len({int(c) for c in all_counts}) == 1:
                        failures.append(
                            f"dp={dp} cp={cp}: the dynamic case gave every DP rank the same sample count; it no longer tests unequal ones"
                        )
                for step in range(STEPS):
                    expected = reference_grads(name, samples, step, args)
                    ran += 1
                    for g, e, pname in zip(optimizer.grads[step], expected, ("embed", "head"), strict=True):
                        err = float((g.double() - e).abs().max() / e.abs().max().clamp(min=1e-300))
                        if not err <= TOLERANCE:
                            failures.append(f"dp={dp} cp={cp} rank={rank} case={name} step={step} {pname}: relative error {err:.3g}")
                    if name in ("prompt_mean", "session_mean"):  # the mutated reference (slime's per-rollout default) must fail
                        wrong = reference_grads(name, samples, step, args, mutated=True)
                        err = max(float((g.double() - e).abs().max() / e.abs().max()) for g, e in zip(optimizer.grads[step], wrong, strict=True))
                        if not err > 100 * TOLERANCE:
                            failures.append(f"dp={dp} cp={cp} step={step}: slime's default reference matches {name}'s gradient ({err:.3g})")
            mpu.destroy_model_parallel()
        if not used["current_device"] or not used["zeros"] or not used["accelerator"] or (max(layouts) > 1 and not used["allgather"]):
            failures.append(f"rank {rank}: a stand-in was never used ({used}); the test no longer exercises what it says")
    except Exception as exc:  # reported by the parent with the rank
        failures.append(crashed(f"rank {rank}", exc))
    leave(results_dir, rank, ran, failures)


# the default tier runs one rank and DP x CP; the full tier DP and CP each alone too (tests/tiers.py)
@pytest.mark.parametrize(
    "world,layouts",
    [pytest.param(1, (1,), id="dp1cp1"), pytest.param(2, (1, 2), id="dp2cp1+dp1cp2", marks=full_tier), pytest.param(4, (2,), id="dp2cp2")],
)
def test_slime_train_step_gives_the_gradient_of_j(world, layouts, launches, tmp_path):
    failures, runs = run_world(worker, world, (layouts, launches), tmp_path, fresh=True)  # slime's packages first on sys.path
    assert not failures, "\n".join(failures)[:8000]
    assert runs == world * len(layouts) * len(CASES) * STEPS


# ----------------------------------------------------------------- slime's own parse_args


def check_launches_argv(tmp_path) -> dict[str, tuple[bool, list[str]]]:
    """The launches of test_launch_checks_through_slime_parse_args: name -> (through lossagg, argv)."""
    weighted = tmp_path / "weighted.json"
    weighted.write_text('{"mode": "prompt_mean", "weighting": "multiply"}')
    prompt = ["--loss-aggregation", "prompt_mean"]
    entropy = ["--entropy-coef", str(ENTROPY_COEF)]
    bad_batch = without(without(BASE_ARGV, "--n-samples-per-prompt"), "--num-steps-per-rollout")
    bad_batch += ["--n-samples-per-prompt", "4", "--num-steps-per-rollout", "7", *prompt]
    launches = {
        "seed_step_of_3": (True, bad_batch),
        "zero_per_prompt": (True, without(BASE_ARGV, "--n-samples-per-prompt") + ["--n-samples-per-prompt", "0", *prompt]),
        "legacy_flag_contradicted": (True, BASE_ARGV + ["--loss-aggregation", "sample_mean", "--calculate-per-token-loss"]),
        "unknown_mode": (True, BASE_ARGV + ["--loss-aggregation", "seq_meen"]),
        "term_coefficient": (True, BASE_ARGV + [*prompt, *entropy, "--loss-aggregation-term", "entropy:-0.2:token_mean"]),
        "term_unknown": (True, BASE_ARGV + [*prompt, "--loss-aggregation-term", "nll:1.0"]),
        "kl_without_kl_loss": (True, BASE_ARGV + [*prompt, "--loss-aggregation-term", "kl:0.05"]),
        "terms_under_tis": (True, BASE_ARGV + [*prompt, *entropy, *TIS, "--loss-aggregation-term", f"entropy:{-ENTROPY_COEF}:token_mean"]),
        "token_mean_tis_entropy": (True, BASE_ARGV + ["--loss-aggregation", "token_mean", *entropy, *TIS]),
        "skip_tis_entropy": (True, BASE_ARGV + [*prompt, "--loss-aggregation-empty-samples", "skip", *entropy, *TIS]),
        "sft_loss": (True, BASE_ARGV + [*prompt, "--loss-type", "sft_loss"]),
        "two_pg_reducers": (True, BASE_ARGV + [*prompt, "--custom-pg-loss-reducer-function-path", "my.reducer"]),
        "weighting": (True, BASE_ARGV + ["--loss-aggregation-config", str(weighted)]),
        "no_flag_through_lossagg": (True, BASE_ARGV),
        "no_flag_slime": (False, BASE_ARGV),
        "user_postprocess": (True, BASE_ARGV + [*prompt, "--rollout-data-postprocess-path", "test_slime_train.user_postprocess"]),
        "term_flag_alone": (True, BASE_ARGV + [*entropy, "--loss-aggregation-term", f"entropy:{-ENTROPY_COEF}:token_mean"]),
        "tis_entropy_served": (True, BASE_ARGV + [*prompt, *entropy, *TIS]),
    }
    return launches


def test_launch_checks_through_slime_parse_args(parsed_launches):
    """The refusals a launch needs, each naming the flag, on slime's own parse_args (after it derives
    global_batch_size); with no lossagg flag the launch is slime's own, attribute for attribute."""
    got = checked_launches(parsed_launches)
    refused = {
        **SEED_REFUSALS,
        "seed_step_of_3": ["--global-batch-size", "(3)", "--num-steps-per-rollout 7"],
        "term_coefficient": ["--loss-aggregation-term", "'entropy'", "-0.2", "--entropy-coef"],
        "term_unknown": ["--loss-aggregation-term", "'nll'"],
        "kl_without_kl_loss": ["--loss-aggregation-term", "--use-kl-loss"],
        "terms_under_tis": ["--use-tis", "entropy"],
        "skip_tis_entropy": ["--loss-aggregation-empty-samples", "--use-tis"],
        "sft_loss": ["--loss-type", "sft_loss"],
        "two_pg_reducers": ["--custom-pg-loss-reducer-function-path", "my.reducer"],
        "weighting": ["--loss-aggregation-config", "weighting"],
    }
    check_launches(got, refused, "no_flag_slime", "slime")
    user = pickle.loads(got["user_postprocess"][1])
    assert user.rollout_data_postprocess_path == "lossagg.integrations.slime.rollout_data_postprocess"
    assert user.lossagg_user_rollout_data_postprocess_path == "test_slime_train.user_postprocess"
    alone = pickle.loads(got["term_flag_alone"][1])
    assert alone.lossagg_config["mode"] == "sample_mean" and alone.lossagg_config["terms"]["entropy"]["mode"] == "token_mean"
    assert alone.loss_type == "custom_loss" and alone.custom_pg_loss_reducer_function_path == "lossagg.integrations.slime.pg_loss_reducer"
    assert pickle.loads(got["tis_entropy_served"][1]).use_tis
