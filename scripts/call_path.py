"""The modules a call passes through, in order: how far a reader follows ``StepPlan.__init__``.

Traces one call with ``sys.setprofile`` and prints the modules of the lossagg functions it
runs, in the order each function is first called (a reader reads a function once, however
often it runs; a comprehension is part of its function), one stop per change of module; functions outside lossagg (torch, the
standard library) are left out, and so are the leaves of layer 1 (:mod:`lossagg.validate`,
:mod:`lossagg.messages`, ...: argument checks any layer calls, which a reader does not
follow). A *return* is a stop at a module visited before: the path bounced back to it.

    python scripts/call_path.py              # StepPlan(config, counts) under every built-in mode,
                                             # then a micro-batch's reduction from each plan
    python scripts/call_path.py --leaves     # the leaves counted too

The second part shows the one function both plans call for a micro-batch's share of J
(``lossagg.micro_batch.reduce_micro_batch``): ``plan.loss(values, mb)`` of a ``StepPlan`` and of a
``DeferredPlan``, with terms and weights, and the module each reaches it from.
"""

from __future__ import annotations

import sys

# comprehensions and generator expressions: part of the function that holds them (Python 3.11
# runs them as functions of their own)
INLINE = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")
LEAVES = ("lossagg.env", "lossagg.messages", "lossagg.dtypes", "lossagg.validate", "lossagg._build_info")


def call_path(fn, leaves: bool = False) -> list[str]:
    """The modules of the functions ``fn`` runs, in the order each is first called (a reader
    reads a function once, however often it runs: a table's callback per entry, a loop),
    consecutive ones of one module as one stop."""
    stops: list[str] = []
    seen = set()

    def profile(frame, event, arg):
        if event != "call" or frame.f_code in seen or frame.f_code.co_name in INLINE:
            return
        seen.add(frame.f_code)
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("lossagg") or (not leaves and name in LEAVES):
            return
        if not stops or stops[-1] != name:
            stops.append(name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return stops


def summary(stops: list[str]) -> tuple[int, int, int]:
    """(stops, modules, returns) of a path; its first module is where it starts, not a stop."""
    seen, returns = {stops[0]}, 0
    for m in stops[1:]:
        returns += m in seen
        seen.add(m)
    return len(stops) - 1, len(seen), returns


def main() -> None:
    import torch

    import lossagg

    leaves = "--leaves" in sys.argv
    counts = torch.tensor([3.0, 0.0, 5.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1])
    sessions = torch.tensor([0, 0, 1, 2])  # read by the session modes (docs/modes.md, "Sessions")
    worst = (0, 0, 0)
    for mode, spec in lossagg.MODES.items():
        settings = {"mode": mode, **spec.example_settings}
        config = lossagg.LossAggregationConfig.from_dict(settings)
        lossagg.StepPlan(config, counts, group_index=groups, session_index=sessions)  # warm: first-use imports are not the path
        stops = call_path(lambda config=config: lossagg.StepPlan(config, counts, group_index=groups, session_index=sessions), leaves)
        n, modules, returns = summary(stops)
        worst = max(worst, (n, modules, returns))
        short = [s.removeprefix("lossagg.") for s in stops]
        print(f"{mode:>12}: {n} stops over {modules} modules, {returns} returns: {' -> '.join(short)}")
    print(f"most: {worst[0]} stops, {worst[2]} returns")

    # a micro-batch's share of J, from each plan: both reach the one reduction
    settings = {"mode": "sample_mean", "weighting": "mean", "terms": {"entropy": {"coefficient": -0.01, "weighting": "mean"}}}
    config = lossagg.LossAggregationConfig.from_dict(settings)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    cu = torch.tensor([0, 3, 3, 6, 10])
    weights = torch.tensor([1.0, 0.5, 2.0, 1.0], dtype=torch.float64)
    values = {"pg": torch.randn(10), "entropy": torch.randn(10)}
    plans = {
        "StepPlan": lossagg.StepPlan.from_mask(config, mask, cu, sample_weights=weights),
        "DeferredPlan": lossagg.DeferredPlan(config, 4, sample_weights=weights),
    }
    for name, plan in plans.items():
        mb = plan.micro_batch(slice(None), mask, cu)
        plan.loss(values, mb)  # warm
        mb = plan.micro_batch(slice(None), mask, cu) if name == "StepPlan" else mb
        stops = call_path(lambda plan=plan, mb=mb: plan.loss(values, mb), leaves)
        n, modules, returns = summary(stops)
        short = [s.removeprefix("lossagg.") for s in stops]
        print(f"{name}.loss(values, mb): {n} stops over {modules} modules, {returns} returns: {' -> '.join(short)}")


if __name__ == "__main__":
    main()
