"""A fixed corpus of the denominator program's routes, recorded (tests/golden/denom_program.json)
before the program got one home per language (issue 38: ``lossagg/denom_program.py`` beside
``csrc/denom_program.h``, the one-pass route beside ``aggregate``, the planning in one place).

For every built-in mode under both ``empty_samples`` conventions, both layouts and three value
dtypes it records the bits of: the plan (``sample_denoms``, ``metric_denoms``, the totals),
``aggregate`` with the denominators from the mask itself (the one-pass route: the native
program where the mode has one), the same mode with its product hidden behind a plain
function (the Python one-pass route), ``aggregate`` with a ``rollout_mask`` (plan, then
reduce), their gradients, the native ``aggregate`` op called with each program, and the
composite that serves devices without that kernel (run here on CPU tensors). Inputs come from
NumPy's PCG64 with fixed seeds; a step with only empty samples and one with a sample whose
``d[i]`` overflows are in it too. tests/test_golden.py checks every result bit for bit, on
every instruction set this CPU has, with 1 and 2 threads.

    python tests/golden_program.py --record     # rewrite the recorded results (only for a deliberate change)
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

GOLDEN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "denom_program.json")
SIZES = (1, 7, 24)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f64": torch.float64}
EMPTY = ("count", "skip")
# Deliberate changes since the recording, each with its reason; never re-recorded silently.
CHANGED: dict[str, str] = {
    "programs": "issue 38: a program is the list of its factor codes (aggregate's int[] denom_program), no longer a nibble-packed int",
    "overflow/composite": "issue 38: the composite's message names the program as that list",
} | {
    # (unchanged: n1, one sample, where N c(M[0]) = c(T); empty8 under skip, where c(N') c(M[i]) = 1 = c(T))
    f"{case}/{layout}/f32/token_mean/{empty}/plan.metric_denoms": "issue 39: metrics reduce by the default reducer of a term, "
    "token_mean when the step is token-level (c(T)), where they used to reduce by sample_mean"
    for case in (*(f"n{n}" for n in SIZES if n > 1), "empty8")
    for layout in ("packed", "padded")
    for empty in ("count", "skip")
    if not (case == "empty8" and empty == "skip")
}
BUILT_IN = ("sample_mean", "prompt_mean", "token_mean", "constant", "max_length")


def _digest(t) -> str:
    t = torch.as_tensor(t).detach().to("cpu").contiguous()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return hashlib.sha256(str(t.dtype).encode() + str(tuple(t.shape)).encode() + raw.numpy().tobytes()).hexdigest()[:16]


def _batch(seed: int, n: int, empty: bool = False):
    rng = np.random.Generator(np.random.PCG64(seed))
    counts = np.zeros(n, dtype=np.int64) if empty else rng.integers(0, 30, size=n)
    if not empty:
        counts[rng.random(n) < 0.2] = 0
    lengths = counts + rng.integers(0, 4, size=n)
    groups = np.arange(n) // 4 if n % 4 == 0 else np.zeros(n, dtype=np.int64)
    total = int(lengths.sum())
    cu = np.concatenate([[0], np.cumsum(lengths)])
    mask = torch.zeros(total, dtype=torch.bool)
    for i in range(n):
        mask[cu[i] : cu[i] + counts[i]] = True
    rollout = mask.clone()
    rollout[torch.from_numpy(rng.random(total) < 0.1)] = False  # a mask changed after rollout: numerators only
    values = torch.from_numpy(rng.standard_normal(total) * 3)
    return values, mask, rollout, torch.from_numpy(cu), torch.from_numpy(groups)


def _padded(values, mask, rollout, cu):
    n, width = cu.shape[0] - 1, int((cu[1:] - cu[:-1]).max()) if cu.shape[0] > 1 else 0
    pv, pm, pr = torch.zeros(n, width, dtype=values.dtype), torch.zeros(n, width, dtype=torch.bool), torch.zeros(n, width, dtype=torch.bool)
    for i in range(n):
        a, b = int(cu[i]), int(cu[i + 1])
        pv[i, : b - a], pm[i, : b - a], pr[i, : b - a] = values[a:b], mask[a:b], rollout[a:b]
    return pv, pm, pr


def _outcome(fn) -> str:
    try:
        return fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _composite():
    """The CUDA composite of the native aggregate op (run here on CPU tensors)."""
    from lossagg.ops import _aggregate_composite

    return _aggregate_composite


def corpus() -> dict[str, str]:
    import lossagg

    composite = _composite()
    out: dict[str, str] = {}
    hidden = {}
    for mode in BUILT_IN:  # each product behind a plain function: aggregate's Python one-pass route
        spec = lossagg.MODES[mode]
        product = spec.denoms
        hidden[mode] = lossagg.ModeSpec(
            name=f"golden_hidden_{mode}",
            summary=spec.summary,
            formula=spec.formula,
            denom_formula=spec.denom_formula,
            totals=spec.totals,
            needs_divisor=spec.needs_divisor,
            denoms=lambda x, product=product: product(x),
            reference=spec.reference,
            example_settings=spec.example_settings,
        )
        lossagg.register_mode(hidden[mode])
    try:
        cases = [(f"n{n}", n, False) for n in SIZES] + [("empty8", 8, True)]
        for case, n, empty_batch in cases:
            values64, mask, rollout, cu, groups = _batch(2000 + n + 100 * empty_batch, n, empty_batch)
            for layout in ("packed", "padded"):
                for dname, dtype in DTYPES.items():
                    v = values64.to(dtype)
                    if layout == "packed":
                        vals, m, r, c = v, mask, rollout, cu
                    else:
                        vals, m, r = _padded(v, mask, rollout, cu)
                        c = None
                    for mode in BUILT_IN:
                        for empty in EMPTY:
                            settings = {"mode": mode, "empty_samples": empty}
                            if mode == "constant":
                                settings["divisor"] = 48.0
                            key = f"{case}/{layout}/{dname}/{mode}/{empty}"
                            cfg = lossagg.LossAggregationConfig.from_dict(settings)
                            gi = groups if mode == "prompt_mean" else None
                            if dname == "f32":  # the plan does not depend on the values' dtype
                                plan = lossagg.StepPlan.from_mask(cfg, m, c, group_index=gi)
                                out[f"{key}/plan.sample_denoms"] = _digest(plan.sample_denoms)
                                out[f"{key}/plan.metric_denoms"] = _digest(plan.metric_denoms)
                                numbers = sorted((k, float(x)) for k, x in plan.totals.items() if not isinstance(x, torch.Tensor))
                                out[f"{key}/plan.totals"] = repr(numbers)
                            for route, route_cfg in (("one_pass", cfg), ("hidden", {**settings, "mode": hidden[mode].name})):
                                leaf = vals.clone().requires_grad_(True)
                                j = lossagg.aggregate(route_cfg, leaf, m, cu_seqlens=c, group_index=gi)
                                j.backward()
                                out[f"{key}/aggregate.{route}"] = _digest(j)
                                out[f"{key}/aggregate.{route}.grad"] = _digest(leaf.grad)
                            leaf = vals.clone().requires_grad_(True)
                            j = lossagg.aggregate(cfg, leaf, m, cu_seqlens=c, group_index=gi, rollout_mask=r)
                            j.backward()
                            out[f"{key}/aggregate.rollout_mask"] = _digest(j)
                            out[f"{key}/aggregate.rollout_mask.grad"] = _digest(leaf.grad)
                            with torch.no_grad():
                                out[f"{key}/aggregate.no_grad"] = _digest(lossagg.aggregate(cfg, vals, m, cu_seqlens=c, group_index=gi))
                            product = lossagg.MODES[mode].denoms
                            program = product.program(empty)
                            if program is not None:
                                divisor = 48.0 if mode == "constant" else 0.0
                                jo, do = torch.ops.lossagg.aggregate(vals, m, c, program, divisor)
                                out[f"{key}/op.aggregate"] = f"{_digest(jo)} {_digest(do)}"
                                jc, dc = composite(vals, m, c, program, divisor)
                                out[f"{key}/composite.aggregate"] = f"{_digest(jc)} {_digest(dc)}"
        # a d[i] that overflows float64, on every route: the error names the numbers it was made of
        values64, mask, rollout, cu, groups = _batch(77, 7)
        for route, mode in (("one_pass", "constant"), ("hidden", hidden["constant"].name)):
            cfg = {"mode": mode, "divisor": 1e308}
            out[f"overflow/{route}"] = _outcome(lambda cfg=cfg: _digest(lossagg.aggregate(cfg, values64, mask, cu_seqlens=cu)))
        out["overflow/rollout_mask"] = _outcome(
            lambda: _digest(lossagg.aggregate({"mode": "constant", "divisor": 1e308}, values64, mask, cu_seqlens=cu, rollout_mask=rollout))
        )
        program = lossagg.MODES["constant"].denoms.program("count")
        out["overflow/composite"] = _outcome(lambda: _digest(composite(values64, mask, cu, program, 1e308)[0]))
        out["programs"] = repr({mode: [lossagg.MODES[mode].denoms.program(e) for e in EMPTY] for mode in BUILT_IN})
    finally:
        for spec in hidden.values():
            lossagg.unregister_mode(spec.name)
    return out


if __name__ == "__main__":
    import golden

    golden.record(GOLDEN_PATH, corpus, "tests/golden_program.py")
