"""lossagg.integrations.miles inside miles-rl 0.0.2's own training step, on CPU (gloo).

Each world (DP x CP in {1, 2}^2) runs miles' ``train()`` (``miles.backends.megatron_utils.model``)
over a rollout of two steps: its ``train_one_step`` (which calls lossagg's before-train-step
hook), its data iterator and ``get_batch`` (zigzag CP shards), its ``loss_function`` and
``policy_loss_function`` (its reducers and outer scaling), miles' vendored Megatron schedule,
``DistributedDataParallel`` and ``finalize_model_grads``. The launch's arguments come from miles'
own ``parse_args`` (through ``lossagg.integrations.miles.parse_args``, or miles' alone for the
default). The optimizer is a recorder: each step's ``main_grad`` must equal the gradient of the
float64 reference J of that step's samples (the unsplit step) to 1e-10 relative (1e-6 with KL on:
miles computes its KL estimate in float32), for every mode, with per-token loss on (token_mean) and
off, fixed and dynamic micro-batches, entropy and KL through lossagg's reducer (each on its own mode
from the config's terms, or on the default reducer), and TIS weights with rejection (modified masks:
pg_loss's numerator only; entropy and KL on miles' rebuilt reducer, each sample's mean over its kept
tokens, which is lossagg's sample_mean with those counts). With no lossagg flag the same harness
must give miles' own number, entropy and KL included.

Stand-ins for the CUDA calls miles and its Megatron make on the way (each allowed only from the
file that makes it, failing the test otherwise): ``Tensor.cuda`` (get_batch's cu_seqlens),
``torch.cuda.current_device`` (the data iterator and the grad buffers), ``torch.cuda.mem_get_info``
(miles' finalize wrapper) and ``torch.zeros(..., device="cuda")`` (the schedule's token total).
The logits stay float64: ``--true-on-policy-mode`` keeps the model's dtype (miles asserts float32
otherwise) when ``args.bf16`` is off (miles' Megatron defaults set it; the test clears it), and
changes nothing else on this path (p2p CP).

Skipped, with the reason, when miles-rl cannot be imported from build/peers (tests/miles_peer.py).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import miles_peer
import pytest
import torch
from seed_train import (
    PROMPT_LEN,
    SEED_REFUSALS,
    VOCAB,
    RecordingOptimizer,
    Scheduler,
    ToyLM,
    caller,
    check_launches,
    checked_launches,
    launches_file,
    parse_launches,
    rejected,
    toy_ddp_model,
    without,
)
from stand_ins import StandInMisuse, TorchForSchedules
from tiers import full_tier
from worlds import crashed, join, leave, run_world

import lossagg
from lossagg.modes import default_term_mode

pytestmark = pytest.mark.xdist_group("engines")

N_PER_PROMPT, PROMPTS, STEPS, MICRO_BATCH_SIZE = 2, 8, 2, 2
ENTROPY_COEF, KL_COEF = 0.1, 0.05
#: entropy and KL on (miles checks that --ref-load exists when KL is on; the reference log-probs come with the rollout)
TERMS = ["--entropy-coef", str(ENTROPY_COEF), "--use-kl-loss", "--kl-loss-coef", str(KL_COEF), "--kl-loss-type", "k2"]
TERMS += ["--ref-load", os.path.dirname(os.path.abspath(__file__))]
KEPT = ["--loss-aggregation-tis-denominators", "kept"]
TIS_RS = ["--use-tis", "--tis-clip", "1.3", "--tis-clip-low", "0.8", "--custom-tis-function-path", "seed_train.rejecting_tis_function"]

BASE_ARGV = [
    "train.py",
    "--rollout-batch-size", str(PROMPTS),
    "--n-samples-per-prompt", str(N_PER_PROMPT),
    "--num-steps-per-rollout", str(STEPS),
    "--num-rollout", "1",
    "--actor-num-nodes", "1",
    "--actor-num-gpus-per-node", "4",
    "--num-layers", "1",
    "--hidden-size", "8",
    "--num-attention-heads", "1",
    "--micro-batch-size", str(MICRO_BATCH_SIZE),
    "--seq-length", "64",
    "--max-position-embeddings", "64",
    "--true-on-policy-mode",
    "--eps-clip", "0.2",
]  # fmt: skip

#: name -> (extra flags, lossagg config of the reference, or None for miles' own reducer); a config's
#: "terms" hold the modes of the reference's entropy and KL (the default reducer where absent)
CASES = {
    "miles_default": ([], None),
    "miles_default_terms": (TERMS, None),
    "miles_per_token": (["--calculate-per-token-loss"], None),
    "sample_mean": (["--loss-aggregation", "sample_mean"], {"mode": "sample_mean"}),
    "prompt_mean": (["--loss-aggregation", "prompt_mean"], {"mode": "prompt_mean"}),
    "token_mean": (["--loss-aggregation", "token_mean"], {"mode": "token_mean"}),
    "legacy_token_mean": (["--loss-aggregation", "token_mean", "--calculate-per-token-loss"], {"mode": "token_mean"}),
    "constant": (["--loss-aggregation", "constant", "--loss-aggregation-divisor", "6"], {"mode": "constant", "divisor": 6.0}),
    "max_length": (["--loss-aggregation", "max_length"], {"mode": "max_length"}),
    "prompt_mean_skip": (
        ["--loss-aggregation", "prompt_mean", "--loss-aggregation-empty-samples", "skip"],
        {"mode": "prompt_mean", "empty_samples": "skip"},
    ),
    "sample_mean_entropy": (["--loss-aggregation", "sample_mean", "--entropy-coef", str(ENTROPY_COEF)], {"mode": "sample_mean"}),
    "token_mean_entropy": (["--loss-aggregation", "token_mean", "--entropy-coef", str(ENTROPY_COEF)], {"mode": "token_mean"}),
    "prompt_mean_tis_rs": (["--loss-aggregation", "prompt_mean", *TIS_RS], {"mode": "prompt_mean"}),
    "prompt_mean_tis_rs_terms": (["--loss-aggregation", "prompt_mean", *TERMS, *TIS_RS], {"mode": "prompt_mean"}),
    # --loss-aggregation-tis-denominators kept: every term's d[i] of the kept tokens (a DeferredPlan, rescaled after the step)
    "token_mean_tis_kept_terms": (["--loss-aggregation", "token_mean", *TERMS, *TIS_RS, *KEPT], {"mode": "token_mean", "kept": True}),
    "sample_mean_skip_tis_kept_terms": (
        ["--loss-aggregation", "sample_mean", "--loss-aggregation-empty-samples", "skip", *TERMS, *TIS_RS, *KEPT],
        {"mode": "sample_mean", "empty_samples": "skip", "kept": True},
    ),
    "max_length_tis_kept": (["--loss-aggregation", "max_length", *TIS_RS, *KEPT], {"mode": "max_length", "kept": True}),
    "prompt_mean_terms": (
        ["--loss-aggregation", "prompt_mean", *TERMS]
        + ["--loss-aggregation-term", f"entropy:{-ENTROPY_COEF}:token_mean", "--loss-aggregation-term", f"kl:{KL_COEF}:max_length"],
        {"mode": "prompt_mean", "terms": {"entropy": "token_mean", "kl": "max_length"}},
    ),
    "token_mean_terms": (["--loss-aggregation", "token_mean", *TERMS], {"mode": "token_mean"}),
    "prompt_mean_dynamic": (
        ["--loss-aggregation", "prompt_mean", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16"],
        {"mode": "prompt_mean"},
    ),
}


@pytest.fixture(scope="session")  # once per worker: xdist interleaves files, which would redo a module fixture
def parsed_launches():
    """Every launch of this file (the worlds' cases and the launch checks) parsed by miles' parse_args in one
    subprocess (miles' import paid once): name -> what parse_launches gives, the checks' names prefixed "check:"."""
    why = miles_peer.unavailable()
    if why:
        pytest.skip(why)
    train = {name: (config is not None, BASE_ARGV + flags) for name, (flags, config) in CASES.items()}
    checks = {f"check:{name}": launch for name, launch in CHECK_LAUNCHES.items()}
    return parse_launches({**train, **checks}, env=miles_peer.env(), adapter="lossagg.integrations.miles", own="miles.utils.arguments")


@pytest.fixture(scope="session")
def launches(parsed_launches, tmp_path_factory):
    return launches_file({name: parsed_launches[name] for name in CASES}, tmp_path_factory, "miles")


# ----------------------------------------------------------------------- stand-ins


def install_stand_ins():
    import megatron.core.pipeline_parallel.schedules as schedules

    used = {"cuda": 0, "current_device": 0, "mem_get_info": 0, "zeros": 0}
    real_cuda = torch.Tensor.cuda

    def cuda(self, *args, **kwargs):
        if not caller().endswith("miles/backends/training_utils/data.py"):
            return real_cuda(self, *args, **kwargs)
        used["cuda"] += 1
        return self

    def current_device():
        where = caller()
        if not where.endswith(
            ("megatron/core/distributed/param_and_grad_buffer.py", "miles/backends/training_utils/data.py", "miles/backends/megatron_utils/model.py")
        ):
            raise StandInMisuse(f"torch.cuda.current_device stand-in called from {where}")
        used["current_device"] += 1
        return "cpu"

    def mem_get_info(*args):
        if not caller().endswith("miles/backends/megatron_utils/model.py"):
            raise StandInMisuse(f"torch.cuda.mem_get_info stand-in called from {caller()}")
        used["mem_get_info"] += 1
        return (1, 1)

    torch.Tensor.cuda = cuda
    torch.cuda.current_device = current_device
    torch.cuda.mem_get_info = mem_get_info
    schedules.torch = TorchForSchedules(used)
    return used


# --------------------------------------------------------------------- the rollout
def make_rollout(seed=0):
    """Every sample of the rollout: full token sequences, response masks, old log-probs and advantages (float64)."""
    g = torch.Generator().manual_seed(seed)
    g_ref = torch.Generator().manual_seed(seed + 1)
    n = PROMPTS * N_PER_PROMPT
    samples = []
    for i in range(n):
        group = i // N_PER_PROMPT
        prompt = torch.tensor([(group * 3 + k) % VOCAB for k in range(PROMPT_LEN)], dtype=torch.long)
        r = int(torch.randint(2, 10, (1,), generator=g))
        while not _no_single_token_shard(PROMPT_LEN + r, r):
            r = int(torch.randint(2, 10, (1,), generator=g))
        response = torch.randint(0, VOCAB, (r,), generator=g)
        mask = (torch.rand(r, generator=g) < 0.8).to(torch.int)
        if i == 5:
            mask.zero_()  # a fully masked sample (empty)
        samples.append(
            dict(
                tokens=torch.cat([prompt, response]),
                response_length=r,
                loss_mask=mask,
                old_log_prob=-torch.rand(r, generator=g, dtype=torch.float64) * 2,
                rollout_log_prob=-torch.rand(r, generator=g, dtype=torch.float64) * 2,
                advantage=torch.full((r,), float(torch.randn(1, generator=g, dtype=torch.float64)), dtype=torch.float64),
                ref_log_prob=-torch.rand(r, generator=g_ref, dtype=torch.float64) * 2,  # its own generator: the rest as before
                index=i,
            )
        )
    return samples


def _no_single_token_shard(total: int, response: int, cp_sizes=(1, 2)) -> bool:
    """True when no CP rank's zigzag shard holds exactly one response logit. miles 0.0.2's true-on-policy
    log-prob path squeezes twice (ppo_utils.py's gather, then loss.py's ``log_prob.squeeze(-1)``), so a
    one-token shard becomes 0-dim and ``torch.cat`` fails; the rollout avoids it."""
    for cp in cp_sizes:
        chunk = -(-total // (2 * cp))
        held = [0] * cp
        for p in range(total - response - 1, total - 1):  # the logits that score the response tokens
            c = p // chunk
            held[c if c < cp else 2 * cp - 1 - c] += 1
        if 1 in held:
            return False
    return True


def reference_grads(case_config, samples, step, args):
    """Gradient of the step's float64 J (unsplit): pg_loss on the mode (or miles' default reducer), entropy and
    KL on their own modes (lossagg's default reducer where the config names none; miles' own without lossagg, and
    under TIS, where miles rebuilds it from the modified masks: each sample's mean over its kept tokens)."""
    from lossagg.testing import reference_loss

    per_token = bool(args.calculate_per_token_loss)
    tis = (args.tis_clip_low, args.tis_clip) if args.use_tis else None
    gbs = len(samples) // STEPS
    chosen = samples[step * gbs : (step + 1) * gbs]
    model = ToyLM()
    pg, ent, kl, masks, lengths, kept_mod = [], [], [], [], [], []
    for s in chosen:
        logits = model(s["tokens"])
        r = s["response_length"]
        resp_logits = logits[-r - 1 : -1]
        logp_all = torch.log_softmax(resp_logits, -1)
        lp = logp_all.gather(-1, s["tokens"][-r:, None]).squeeze(-1)
        ratio = torch.exp(lp - s["old_log_prob"])
        a = s["advantage"]
        pg_i = torch.maximum(-ratio * a, -ratio.clamp(0.8, 1.2) * a)
        if tis is not None:  # (clip_low, clip): TIS weights on pg_loss, and the rejected tokens out of its numerator
            pg_i = pg_i * torch.clamp(torch.exp(s["old_log_prob"] - s["rollout_log_prob"]), min=tis[0], max=tis[1])
            kept_mod.append(s["loss_mask"].bool() & ~rejected(r))
        pg.append(pg_i)
        ent.append(-(logp_all.exp() * logp_all).sum(-1))
        kl.append((lp - s["ref_log_prob"]) ** 2 / 2)  # k2
        masks.append(s["loss_mask"].bool())
        lengths.append(r)
    values, mask = torch.cat(pg), torch.cat(masks)
    terms = {"entropy": torch.cat(ent), "kl": torch.cat(kl)}
    cu = lossagg.cu_seqlens_from_lengths(torch.tensor(lengths), dtype=torch.int64)
    counts = torch.tensor([int(m.sum()) for m in masks], dtype=torch.float64)

    def miles_default(x, m=mask):  # miles' sum_of_sample_mean / sum_of_token, divided as its loss_function and Megatron divide
        sums = torch.stack([(x[cu[i] : cu[i + 1]] * m[cu[i] : cu[i + 1]]).sum() for i in range(len(chosen))])
        if per_token:
            return sums.sum() / counts.clamp(min=1).sum()
        kept = torch.stack([m[cu[i] : cu[i + 1]].sum() for i in range(len(chosen))]).double()
        return (sums / kept.clamp(min=1)).sum() / gbs

    groups = torch.unique(torch.tensor([s["index"] // N_PER_PROMPT for s in chosen]), return_inverse=True)[1]
    term_modes = {}
    kept = bool(case_config and case_config.get("kept"))
    if case_config is None:
        j = miles_default(values)
    else:
        settings = {k: v for k, v in case_config.items() if k not in ("terms", "kept")}
        config = lossagg.LossAggregationConfig(n_samples_per_prompt=N_PER_PROMPT, **settings)
        term_modes = {k: case_config.get("terms", {}).get(k, default_term_mode(config.mode)) for k in terms}
        if tis is None:
            j = reference_loss(config, values, mask, cu, groups)
        elif kept:  # the kept tokens in the numerator and in every count of d[i]
            j = reference_loss(config, values, torch.cat(kept_mod), cu, groups)
        else:  # the modified mask in the numerator, d[i] from the rollout mask (docs/trainers/miles.md, TIS/RS)
            j = reference_loss(config, values, torch.cat(kept_mod), cu, groups, rollout_mask=mask)
    coefficients = {"entropy": -float(args.entropy_coef), "kl": float(args.kl_loss_coef) if args.use_kl_loss else 0.0}
    for k, coef in coefficients.items():
        if coef == 0.0:
            continue
        if case_config is None:
            j = j + coef * miles_default(terms[k])
        elif kept:  # miles' rebuilt reducer, rescaled with the step: the kept tokens' token_mean (per-token path) or sample_mean
            rebuilt = "token_mean" if per_token else "sample_mean"
            term_config = lossagg.LossAggregationConfig(n_samples_per_prompt=N_PER_PROMPT, mode=rebuilt, empty_samples=config.empty_samples)
            j = j + coef * reference_loss(term_config, terms[k], torch.cat(kept_mod), cu, groups)
        elif tis is not None:  # miles' rebuilt reducer: each sample's mean over its kept tokens, sample_mean with M[i] the kept tokens
            j = j + coef * miles_default(terms[k], torch.cat(kept_mod))
        else:
            term_config = lossagg.LossAggregationConfig(n_samples_per_prompt=N_PER_PROMPT, mode=term_modes[k], empty_samples=config.empty_samples)
            j = j + coef * reference_loss(term_config, terms[k], mask, cu, groups)
    if not per_token:
        j.backward()
        return [model.embed.grad.clone(), model.head.grad.clone()]
    # Megatron's per-token path divides the summed gradients by the step's reported tokens as
    # `1.0 / num_tokens` of an int tensor (finalize_model_grads.py), a float32 scale: applied so here
    reported = counts.clamp(min=1).sum()
    (j * reported).backward()
    scale = float(1.0 / torch.tensor(int(reported), dtype=torch.int))
    return [model.embed.grad * scale, model.head.grad * scale]


def rank_rollout(samples, dp_rank, dp, args):
    """This DP rank's rollout data as miles' get_rollout_data leaves it (strided DP split, CP-local log-probs and advantages)."""
    from miles.backends.training_utils.cp_utils import slice_log_prob_with_cp

    mine = samples[dp_rank::dp]
    total = [int(s["tokens"].numel()) for s in mine]
    resp = [s["response_length"] for s in mine]
    return {
        "tokens": [s["tokens"] for s in mine],
        "loss_masks": [s["loss_mask"] for s in mine],
        "total_lengths": total,
        "response_lengths": resp,
        "sample_indices": [s["index"] for s in mine],
        "log_probs": [slice_log_prob_with_cp(s["old_log_prob"], t, r, args.qkv_format) for s, t, r in zip(mine, total, resp, strict=True)],
        "advantages": [slice_log_prob_with_cp(s["advantage"], t, r, args.qkv_format) for s, t, r in zip(mine, total, resp, strict=True)],
        "ref_log_probs": [slice_log_prob_with_cp(s["ref_log_prob"], t, r, args.qkv_format) for s, t, r in zip(mine, total, resp, strict=True)],
        "rollout_log_probs": [
            slice_log_prob_with_cp(s["rollout_log_prob"], t, r, args.qkv_format) for s, t, r in zip(mine, total, resp, strict=True)
        ],
    }


# ------------------------------------------------------------------------ the world
def worker(rank, world, dp, cp, launches_path, init_file, results_dir):
    miles_peer.enter()
    failures, ran = join(rank, world, init_file)
    try:
        used = install_stand_ins()
        from megatron.core import parallel_state as mpu
        from megatron.training.global_vars import set_args
        from miles.backends.megatron_utils import model as miles_model
        from miles.backends.megatron_utils.parallel import create_megatron_parallel_state
        from miles.backends.training_utils.data import get_data_iterator
        from miles.backends.training_utils.parallel import set_parallel_state

        launches = pickle.loads(open(launches_path, "rb").read())
        mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=cp)
        dp_rank = mpu.get_data_parallel_rank()
        samples = make_rollout()
        for name, (_, case_config) in CASES.items():
            args = pickle.loads(launches[name])
            args.world_size, args.rank = world, rank
            args.context_parallel_size, args.data_parallel_size = cp, dp
            args.debug_disable_optimizer = False
            args.bf16 = False  # miles' set_default_megatron_args sets bf16 = not fp16; true-on-policy mode would cast the logits to it
            set_args(args)
            set_parallel_state(create_megatron_parallel_state())
            module, model = toy_ddp_model(args, cp, torch.float64)
            optimizer = RecordingOptimizer(module)
            rollout = rank_rollout(samples, dp_rank, dp, args)
            data_iterator, num_microbatches = get_data_iterator(args, [model], rollout)
            miles_model.train(0, [model], optimizer, Scheduler(), data_iterator, num_microbatches)
            for step in range(STEPS):
                expected = reference_grads(case_config, samples, step, args)
                ran += 1
                for g, e, pname in zip(optimizer.grads[step], expected, ("embed", "head"), strict=True):
                    err = float((g - e).abs().max() / e.abs().max().clamp(min=1e-300))
                    # miles' compute_approx_kl works in float32 (log_probs.float()) whatever the model's dtype: a case with
                    # KL on is float32-exact in that term (its errors here ~5e-8), every other case float64-exact
                    if not err <= (1e-6 if args.use_kl_loss else 1e-10):
                        failures.append(f"dp={dp} cp={cp} rank={rank} case={name} step={step} {pname}: relative error {err:.3g}")
        if not used["current_device"] or not used["zeros"] or (cp > 1 and not used["cuda"]):
            failures.append(f"rank {rank}: a stand-in was never used ({used}); the test no longer exercises what it says")
        mpu.destroy_model_parallel()
    except Exception as exc:  # reported by the parent with the rank
        failures.append(crashed(f"rank {rank}", exc))
    leave(results_dir, rank, ran, failures)


# the default tier runs DP and CP together; the full tier each alone too (tests/tiers.py)
@pytest.mark.parametrize(
    "dp,cp", [pytest.param(1, 1, marks=full_tier), pytest.param(2, 1, marks=full_tier), pytest.param(1, 2, marks=full_tier), (2, 2)]
)
def test_miles_train_step_gives_the_gradient_of_j(dp, cp, launches, tmp_path):
    failures, runs = run_world(worker, dp * cp, (dp, cp, launches), tmp_path, fresh=True)  # miles' own megatron first on sys.path
    assert not failures, "\n".join(failures)[:8000]
    assert runs == dp * cp * len(CASES) * STEPS


# ----------------------------------------------------------------- miles' own parse_args
LAUNCH = [a for a in BASE_ARGV if a != "--true-on-policy-mode"]


# --rollout-batch-size 8 --n-samples-per-prompt 4 --num-steps-per-rollout 3: a step of 10 samples
_BAD_BATCH = without(without(LAUNCH, "--n-samples-per-prompt"), "--num-steps-per-rollout") + [
    "--n-samples-per-prompt",
    "4",
    "--num-steps-per-rollout",
    "3",
    "--loss-aggregation",
    "prompt_mean",
]
#: the launches of test_launch_checks_through_miles_parse_args: name -> (through lossagg, argv)
CHECK_LAUNCHES = {
    "seed_step_of_10": (True, _BAD_BATCH),
    "zero_per_prompt": (True, without(LAUNCH, "--n-samples-per-prompt") + ["--n-samples-per-prompt", "0", "--loss-aggregation", "prompt_mean"]),
    "legacy_flag_contradicted": (True, LAUNCH + ["--loss-aggregation", "sample_mean", "--calculate-per-token-loss"]),
    "constant_per_token": (True, LAUNCH + ["--loss-aggregation", "constant", "--loss-aggregation-divisor", "8", "--calculate-per-token-loss"]),
    "constant_without_divisor": (True, LAUNCH + ["--loss-aggregation", "constant"]),
    "unknown_mode": (True, LAUNCH + ["--loss-aggregation", "seq_meen"]),
    "no_flag_through_lossagg": (True, LAUNCH),
    "no_flag_miles": (False, LAUNCH),
    "token_mean": (True, LAUNCH + ["--loss-aggregation", "token_mean"]),
    "term_coefficient": (True, LAUNCH + ["--loss-aggregation", "prompt_mean", *TERMS, "--loss-aggregation-term", "kl:0.5:token_mean"]),
    "terms_under_tis": (True, LAUNCH + ["--loss-aggregation", "prompt_mean", *TERMS, *TIS_RS, "--loss-aggregation-term", "kl:0.05"]),
    "token_mean_tis_entropy": (True, LAUNCH + ["--loss-aggregation", "token_mean", "--entropy-coef", "0.1", *TIS_RS]),
    "kept_alone": (True, LAUNCH + KEPT),
    "kept_without_tis": (True, LAUNCH + ["--loss-aggregation", "token_mean", *KEPT]),
    "kept_prompt_mean": (True, LAUNCH + ["--loss-aggregation", "prompt_mean", *TIS_RS, *KEPT]),
    "kept_max_length_entropy": (True, LAUNCH + ["--loss-aggregation", "max_length", "--entropy-coef", "0.1", *TIS_RS, *KEPT]),
    "kept_recompute": (True, LAUNCH + ["--loss-aggregation", "token_mean", *TIS_RS, *KEPT, "--recompute-loss-function"]),
    "kept_token_mean_terms": (True, LAUNCH + ["--loss-aggregation", "token_mean", *TERMS, *TIS_RS, *KEPT]),
}


def test_launch_checks_through_miles_parse_args(parsed_launches):
    """The seed PR's cases and the refusals, on miles' own parse_args (after it derives global_batch_size)."""
    got = checked_launches(parsed_launches)
    refused = {
        **SEED_REFUSALS,
        "seed_step_of_10": ["--global-batch-size", "(10)", "--num-steps-per-rollout 3"],
        "constant_per_token": ["--calculate-per-token-loss", "mode=constant"],
        "constant_without_divisor": ["--loss-aggregation-divisor", "mode=constant"],
        "term_coefficient": ["--loss-aggregation-term", "'kl'", "0.5", "--kl-loss-coef"],
        "terms_under_tis": ["--use-tis", "kl"],
        "kept_alone": ["--loss-aggregation-tis-denominators kept", "without --loss-aggregation"],
        "kept_without_tis": ["--loss-aggregation-tis-denominators kept", "without --use-tis"],
        "kept_prompt_mean": ["--loss-aggregation-tis-denominators kept", "mode=prompt_mean", "prompt group", "DP ranks"],
        "kept_max_length_entropy": ["--loss-aggregation-tis-denominators kept", "--use-tis", "'entropy'", "same step-level factors"],
        "kept_recompute": ["--loss-aggregation-tis-denominators kept", "--recompute-loss-function"],
    }
    check_launches(got, refused, "no_flag_miles", "miles", ("loss_aggregation_tis_denominators",))
    kept = pickle.loads(got["kept_token_mean_terms"][1])  # served: entropy and KL on the per-token path under TIS
    assert kept.loss_aggregation_tis_denominators == "kept" and kept.loss_type == "custom_loss"
    token = pickle.loads(got["token_mean"][1])
    assert token.calculate_per_token_loss is True and token.loss_type == "custom_loss"
    assert token.custom_pg_loss_reducer_function_path == "lossagg.integrations.miles.pg_loss_reducer"


def test_example_launch_script():
    why = miles_peer.unavailable()
    if why:
        pytest.skip(why)
    script = os.path.join(miles_peer.ROOT, "examples", "miles_launch.py")
    done = subprocess.run(
        [sys.executable, script, *LAUNCH[1:], "--loss-aggregation", "prompt_mean"], env=miles_peer.env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"mode": "prompt_mean"' in done.stdout and "lossagg.integrations.miles.before_train_step" in done.stdout
