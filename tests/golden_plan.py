"""A fixed corpus of planner calls whose results are recorded (tests/golden/step_plan.json).

It covers what the modes registry drives: ``StepPlan`` (one process) and
``StepPlan.from_totals`` for every built-in mode, the denominators of a micro-batch,
``lossagg.testing.reference_loss``, ``check_split_invariance``'s composed loss,
``aggregate`` (loss and gradient), the verl adapter in every verl and lossagg mode, and the
config's resolution of names and legacy flags. Inputs come from NumPy's PCG64 with fixed
seeds. The results were recorded before the modes registry was reshaped (issue 18: the
declared step totals, the registry, StepPlan split by concern), and tests/test_golden.py
checks that every one is unchanged, bit for bit.

Deliberate changes are listed in ``CHANGED``, never re-recorded silently.

    python tests/golden_plan.py --record     # rewrite the recorded results (only for a deliberate change)
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import torch

GOLDEN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "step_plan.json")

CONFIGS = {
    "sample_mean": {"mode": "sample_mean"},
    "prompt_mean": {"mode": "prompt_mean", "n_samples_per_prompt": 4},
    "prompt_mean_any": {"mode": "prompt_mean"},
    "token_mean": {"mode": "token_mean"},
    "constant_64": {"mode": "constant", "divisor": 64.0},
    "constant_frac": {"mode": "constant", "divisor": 0.75},
}
SIZES = [4, 8, 24, 64]
VERL_SCALES = [None, 3, 0.5]

# Inputs to the config whose resolution is recorded (summary(): mode, settings, notes).
RESOLVE = [
    {},
    {"mode": "token-mean"},
    {"mode": "seq-mean-token-mean"},
    {"mode": "seq-mean-token-sum"},
    {"mode": "seq-mean-token-sum", "divisor": 2.0},
    {"mode": "GRPO"},
    {"mode": " dapo "},
    {"mode": "dr_grpo", "divisor": 16.0},
    {"mode": "per_token"},
    {"mode": "seq_mean"},
    {"mode": "sample-mean"},
    {"calculate_per_token_loss": True},
    {"mode": "token_mean", "calculate_per_token_loss": True},
    {"mode": "sample_mean", "calculate_per_token_loss": False},
    {"mode": "prompt_mean", "n_samples_per_prompt": 8, "global_batch_size": 64},
]

# Results changed on purpose since the recording, with the reason.
CHANGED: dict[str, str] = {
    f"n{n}/{name}/plan.totals": "a plan holds only the totals its mode declares (and N, T): P is absent, not 0, "
    "under modes without prompt groups (issue 18); N and T are unchanged"
    for n in SIZES
    for name in ("sample_mean", "token_mean", "constant_64", "constant_frac")
} | {
    f"verl/n{n}/{mode}/scale={scale}/dp=2": "verl adapter, lossagg modes with dp_size=2 and global-batch arguments: N = global_batch_size "
    "and T = batch_num_tokens (they were ignored, giving the micro-batch's own totals); prompt_mean is refused (verl carries no "
    "group totals) (issue 20)"
    for n in SIZES
    for mode in ("sample_mean", "token_mean", "constant", "prompt_mean")
    for scale in VERL_SCALES
}
CHANGED.update(
    {
        f"n{n}/token_mean/plan.metric_denoms": "issue 39: metrics reduce by the default reducer of a term, token_mean when the step "
        "is token-level (c(T)), where they used to reduce by sample_mean"
        for n in SIZES
    }
)
CHANGED.update(
    {
        f"resolve/{i}/{json.dumps(data, sort_keys=True)}": "the config gained the setting empty_samples (issue 30): summary() lists it, "
        "'count' (the default) here; every other entry of the resolved config is unchanged"
        for i, data in enumerate(RESOLVE)
    }
)


def _digest(t) -> str:
    t = torch.as_tensor(t).detach().to("cpu").contiguous()
    return hashlib.sha256(str(t.dtype).encode() + str(tuple(t.shape)).encode() + t.numpy().tobytes()).hexdigest()[:16]


def _batch(seed: int, n: int):
    rng = np.random.Generator(np.random.PCG64(seed))
    counts = rng.integers(0, 40, size=n)
    counts[rng.random(n) < 0.15] = 0
    lengths = counts + rng.integers(0, 5, size=n)
    groups = rng.permutation(np.repeat(np.arange(n // 4), 4))
    total = int(lengths.sum())
    values = torch.from_numpy(rng.standard_normal(total))
    mask = torch.zeros(total, dtype=torch.bool)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(n):
        mask[cu[i] : cu[i] + counts[i]] = True
    return (
        torch.from_numpy(counts),
        torch.from_numpy(groups),
        values.to(torch.float32),
        mask,
        torch.from_numpy(cu).to(torch.int32),
        rng,
    )


def corpus() -> dict[str, str]:
    import lossagg
    from lossagg.integrations.verl import VERL_MODES, agg_loss
    from lossagg.testing import check_split_invariance, reference_loss

    out: dict[str, str] = {}
    for n in SIZES:
        counts, groups, values, mask, cu, rng = _batch(1000 + n, n)
        num_groups = n // 4
        for name, settings in CONFIGS.items():
            key = f"n{n}/{name}"
            cfg = lossagg.LossAggregationConfig.from_dict(settings)
            plan = lossagg.StepPlan(cfg, counts, group_index=groups)
            out[f"{key}/plan.sample_denoms"] = _digest(plan.sample_denoms)
            out[f"{key}/plan.metric_denoms"] = _digest(plan.metric_denoms)
            t = plan.totals
            out[f"{key}/plan.totals"] = f"{t.num_samples} {t.get('num_groups', 'absent')} {t.total_tokens!r}"
            sel = [i for i in range(n) if i % 3 != 1]
            out[f"{key}/plan.sample_denoms_for.f32"] = _digest(plan.sample_denoms_for(sel))
            out[f"{key}/plan.sample_denoms_for.f64"] = _digest(plan.sample_denoms_for(torch.tensor(sel), dtype=torch.float64))
            # from_totals: this rank's samples are a quarter of a step of 4 such ranks
            extra_tokens = float(rng.integers(0, 500))
            labels, dense = torch.unique(torch.as_tensor(groups), return_inverse=True)
            own_sums = lossagg.totals.group_sums(torch.as_tensor(counts).double(), dense, labels.numel())[dense]
            kwargs = {"num_samples": 4 * n, "total_tokens": float(counts.sum()) + extra_tokens}
            if settings["mode"] == "prompt_mean":
                kwargs.update(num_groups=4 * num_groups, group_token_sums=own_sums + torch.from_numpy(rng.integers(0, 100, size=n)))
            ft = lossagg.StepPlan.from_totals(cfg, counts, **kwargs)
            out[f"{key}/from_totals.sample_denoms"] = _digest(ft.sample_denoms)
            ref = reference_loss(cfg, values, mask, cu.long(), groups)
            out[f"{key}/reference_loss"] = _digest(ref)
            for mb, dp, cp in ((2, 2, 1), (3, 2, 2), (1, 1, 2)):
                rep = check_split_invariance(cfg, values, mask, cu, group_index=groups, micro_batches=mb, dp_size=dp, cp_size=cp)
                out[f"{key}/invariance.{mb}x{dp}x{cp}"] = f"{rep.composed!r} {rep.ok}"
            leaf = values.clone().requires_grad_(True)
            j = lossagg.aggregate(cfg, leaf, mask, cu_seqlens=cu, group_index=groups)
            j.backward()
            out[f"{key}/aggregate"] = _digest(j)
            out[f"{key}/aggregate.grad"] = _digest(leaf.grad)
        # verl: padded (bs, width) micro-batch
        width = int((cu[1:] - cu[:-1]).max())
        loss_mat = torch.from_numpy(rng.standard_normal((n, width))).to(torch.float32)
        loss_mask = torch.arange(width)[None, :] < counts[:, None]
        for mode in (*VERL_MODES, "sample_mean", "token_mean", "constant", "prompt_mean"):
            for scale in VERL_SCALES:
                for dp, gbs, bnt in ((1, None, None), (2, 4 * n, int(counts.sum()) + 37)):
                    kw = {"dp_size": dp, "global_batch_size": gbs, "batch_num_tokens": bnt, "loss_scale_factor": scale}
                    if mode == "prompt_mean":
                        kw["group_index"] = groups
                    try:
                        value = _digest(agg_loss(loss_mat, loss_mask, mode, **kw))
                    except ValueError as exc:
                        value = f"ValueError: {str(exc)[:60]}"
                    out[f"verl/n{n}/{mode}/scale={scale}/dp={dp}"] = value
    for i, data in enumerate(RESOLVE):
        cfg = lossagg.LossAggregationConfig.from_dict(data)
        out[f"resolve/{i}/{json.dumps(data, sort_keys=True)}"] = json.dumps(cfg.summary(), sort_keys=True)
    return out


if __name__ == "__main__":
    import golden

    golden.record(GOLDEN_PATH, corpus, "tests/golden_plan.py")
