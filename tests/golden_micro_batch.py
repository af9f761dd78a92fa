"""A fixed corpus of micro-batch reductions whose bits are recorded (tests/golden/micro_batch.json).

It covers every public way a micro-batch's share of J was reduced before the entrances were
made one (issue 44): ``StepPlan`` with one tensor and with a mapping of terms (its parts
included), per-sample weights, terms of one dtype and of several, ``StepPlan.metrics``,
``DeferredPlan`` with one tensor and with terms (a filter inside the loss), its metrics and its
``close()``; packed and padded, float32, float64 and bfloat16, every built-in mode. Each
micro-batch's J, its parts and the gradient of every leaf are recorded as hashes of their
bytes; the step values of a ``DeferredStep`` as ``float.hex``.

The recording was made at af206bf, through the entrances of then (``plan.loss``,
``plan.loss_terms``, ``plan.loss_terms_parts``, ``DeferredPlan.loss``/``loss_terms``);
:func:`_reduce` makes the same calls through the one entrance of now, and tests/test_golden.py
checks that every result is unchanged, bit for bit. Deliberate changes are listed in
``CHANGED``, never re-recorded silently.

    python tests/golden_micro_batch.py --record     # rewrite the recording (only for a deliberate change)
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os

import numpy as np
import torch

GOLDEN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "micro_batch.json")

MODES = {
    "sample_mean": {"mode": "sample_mean"},
    "prompt_mean": {"mode": "prompt_mean", "n_samples_per_prompt": 2},
    "token_mean": {"mode": "token_mean"},
    "constant": {"mode": "constant", "divisor": 64.0},
    "max_length": {"mode": "max_length"},
}
TERM_SETS = {
    "pg": {},
    "pg_weighted": {"weighting": "mean"},
    "pg_entropy": {"terms": {"entropy": {"coefficient": -0.01}}},
    "three": {"terms": {"entropy": {"coefficient": -0.01}, "kl": {"mode": "token_mean", "coefficient": 0.05}}},
    "three_weighted": {
        "weighting": "abs_mean",
        "terms": {"entropy": {"coefficient": -0.01, "weighting": "mean"}, "kl": {"mode": "token_mean", "coefficient": 0.05}},
    },
}
DTYPES = {"float32": (torch.float32,) * 3, "float64": (torch.float64,) * 3, "bfloat16": (torch.bfloat16,) * 3}
MIXED = {"mixed": (torch.float32, torch.float64, torch.bfloat16)}
EMPTY = ("count", "skip")
# Results changed on purpose since the recording, as fnmatch patterns of keys, with the reason.
SERVED: dict[str, str] = {
    f"deferred/{case}/mixed/*": "refused at af206bf (the recorded value is the error), served now: DeferredPlan serves several dtypes (issue 44)"
    for case in (
        "constant/pg_entropy/count",
        "constant/pg_entropy/skip",
        "sample_mean/pg_entropy/count",
        "sample_mean/pg_entropy/skip",
        "token_mean/pg_entropy/count",
        "token_mean/pg_entropy/skip",
        "token_mean/three/count",
        "token_mean/three/skip",
        "token_mean/three_weighted/count",
        "token_mean/three_weighted/skip",
    )
}
#: Float32 accumulations of a weighted term or a coefficient other than 1: the quotients w·S/d,
#: the products c_k·J_k and the gradient's ((g·c_k)/d)·w are computed in float64 and rounded once
#: (issue 45, item 6: a product beyond float32's range made a representable J inf or 0); the new
#: bits are checked against the float64 reference by tests/test_reduce_terms.py and tests/test_terms.py.
PRECISION = "the terms' per-sample numbers in float64, rounded once (issue 45, item 6)"
BITS: dict[str, str] = {
    f"*/*/{terms}/*/{dtype}/*": PRECISION
    for terms in ("pg_weighted", "pg_entropy", "three", "three_weighted")
    for dtype in ("float32", "bfloat16", "mixed")
    # (one term has one dtype; pg_entropy's bfloat16 results round to the same bits either way)
    if (terms, dtype) not in (("pg_weighted", "mixed"), ("pg_entropy", "bfloat16"))
}
CHANGED: dict[str, str] = {**SERVED, **BITS}


def changed(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in CHANGED)


def _hash(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()[:16] + f"/{t.dtype}/{tuple(t.shape)}"


def _inputs(seed: int, padded: bool, dtypes):
    """8 samples (4 prompts x 2), lengths 0..7, values of the given dtypes (one per term)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    lengths = torch.from_numpy(rng.integers(0, 8, size=8)).long()
    lengths[3] = 0  # an empty sample, always
    groups = torch.arange(8) // 2
    weights = torch.from_numpy(rng.uniform(-0.2, 2.0, size=8))
    if padded:
        t_max = int(lengths.max())
        rollout = torch.arange(t_max)[None, :] < lengths[:, None]
        rollout = rollout & torch.from_numpy(rng.uniform(size=(8, t_max)) < 0.85)
        shape, cu = (8, t_max), None
    else:
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        rollout = torch.from_numpy(rng.uniform(size=int(cu[-1])) < 0.85)
        shape = (int(cu[-1]),)
    raw = [torch.from_numpy(rng.standard_normal(size=shape)) for _ in range(3)]
    values = [r.to(dt) for r, dt in zip(raw, dtypes, strict=False)]
    return lengths, cu, rollout, groups, weights, values


def _micro_batches(cu, padded):
    """(samples, token selection, local cu_seqlens) of the two micro-batches: samples 0-3 and 4-7 (whole prompt groups)."""
    out = []
    for lo, hi in ((0, 4), (4, 8)):
        samples = torch.arange(lo, hi)
        if padded:
            out.append((samples, slice(lo, hi), None))
        else:
            out.append((samples, slice(int(cu[lo]), int(cu[hi])), (cu[lo : hi + 1] - cu[lo])))
    return out


def _reduce(plan, values: dict, mask, samples, cu, parts: bool):
    """One micro-batch's share through the plan's one entrance (``plan.micro_batch``, then ``plan.loss``).
    At af206bf the same calls were ``plan.loss`` (the PG term alone), ``plan.loss_terms`` and
    ``plan.loss_terms_parts`` (with terms, or with parts), ``DeferredPlan.loss_terms``."""
    mb = plan.micro_batch(samples, mask, cu)
    return plan.loss(values["pg"] if len(values) == 1 else values, mb, parts=parts)


def _record_step(out, key, plan, names, leaves, mask, cu, padded, parts: bool, deferred: bool):
    for k, (samples, sel, mb_cu) in enumerate(_micro_batches(cu, padded)):
        values = {n: leaves[n][sel] for n in names}
        try:
            got = _reduce(plan, values, mask[sel], samples, mb_cu, parts)
        except (TypeError, ValueError) as exc:
            out[f"{key}/mb{k}"] = f"{type(exc).__name__}: {str(exc)[:80]}"
            return
        total, split = got if isinstance(got, tuple) else (got, None)
        out[f"{key}/mb{k}/J"] = _hash(total)
        if split is not None:
            for n, v in split.items():
                out[f"{key}/mb{k}/part/{n}"] = _hash(v)
        total.backward()
        metrics = {"m": leaves[names[0]].detach()[sel].to(torch.float32)}
        for n, v in plan.metrics(metrics, mask[sel], samples, mb_cu).items():
            out[f"{key}/mb{k}/metric/{n}"] = _hash(v)
    for n in names:
        out[f"{key}/grad/{n}"] = _hash(leaves[n].grad)
    if deferred:
        step = plan.close()
        out[f"{key}/close"] = json.dumps(
            {
                "scale": float(step.scale).hex(),
                "metric_scale": float(step.metric_scale).hex(),
                "loss": float(step.loss).hex(),
                "terms": {n: float(v).hex() for n, v in sorted(step.terms.items())},
                "metrics": {n: float(v).hex() for n, v in sorted(step.metrics.items())},
            },
            sort_keys=True,
        )


def _config(settings: dict):
    """The config; a weighted mean (``mean``, ``abs_mean``) of a mode without a sample count ``N``
    (prompt_mean, token_mean) is refused by the config, so those weigh by ``multiply``."""
    import lossagg

    try:
        return lossagg.LossAggregationConfig.from_dict(settings)
    except lossagg.ConfigError:
        text = json.dumps(settings).replace('"abs_mean"', '"multiply"').replace('"mean"', '"multiply"')
        return lossagg.LossAggregationConfig.from_dict(json.loads(text))


def corpus() -> dict[str, str]:
    import lossagg

    out: dict[str, str] = {}
    seed = 0
    for mode, mode_settings in MODES.items():
        for term_set, term_settings in TERM_SETS.items():
            for empty in EMPTY:
                cfg = _config({**mode_settings, **term_settings, "empty_samples": empty})
                names = ("pg", *cfg.terms)
                weighted = cfg.weighting != "none" or any(t.weighting != "none" for t in cfg.terms.values())
                for dtype_name, dtypes in {**DTYPES, **(MIXED if len(names) > 1 else {})}.items():
                    for padded in (False, True):
                        seed += 1
                        lengths, cu, rollout, groups, weights, values = _inputs(seed, padded, dtypes)
                        base = f"{mode}/{term_set}/{empty}/{dtype_name}/{'padded' if padded else 'packed'}"
                        kw = {"group_index": groups, "sample_weights": weights if weighted else None}
                        # StepPlan from the rollout masks; total only, and with its parts
                        for parts in (False, True):
                            leaves = {n: v.clone().requires_grad_(True) for n, v in zip(names, values, strict=False)}
                            plan = lossagg.StepPlan.from_mask(cfg, rollout, cu, **kw)
                            _record_step(out, f"step/{base}/parts={parts}", plan, names, leaves, rollout, cu, padded, parts, False)
                        # DeferredPlan: a filter inside the loss (the values' sign), estimate from the rollout plan
                        final = rollout & (values[0].float() < 1.0)
                        leaves = {n: v.clone().requires_grad_(True) for n, v in zip(names, values, strict=False)}
                        try:
                            plan = lossagg.DeferredPlan(cfg, 8, estimate=lossagg.StepPlan.from_mask(cfg, rollout, cu, **kw), **kw)
                        except (TypeError, ValueError) as exc:
                            out[f"deferred/{base}"] = f"{type(exc).__name__}: {str(exc)[:80]}"
                            continue
                        _record_step(out, f"deferred/{base}", plan, names, leaves, final, cu, padded, False, True)
    return out


if __name__ == "__main__":
    import golden

    golden.record(GOLDEN_PATH, corpus, "tests/golden_micro_batch.py")
