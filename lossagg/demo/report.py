"""The demo's report, from the runs' histories (:func:`lossagg.demo.train.train_run`): the summary
(``summary.md``: each mode's final reward and answer lengths with their spread over seeds, the length
bias measured, every figure defined in the text) and the figure (``demo.png``: small multiples)."""

from __future__ import annotations

import math
import os
import statistics
import sys

from lossagg.modes import MODES

SAME_GRADIENT = 1e-5  # relative max difference of the split check
#: how a mode's d[i] treats an answer's length, the families the figure colours alike
FAMILIES = ("sample-normalised", "token-normalised", "constant divisor")
COLOURS = {"sample-normalised": "#d62728", "token-normalised": "#1f77b4", "constant divisor": "#2ca02c", "other": "#7f7f7f"}
STYLES = ("-", "--", ":", "-.")
TASK_NOTE = {
    "single-turn": "a session is one answer, rewarded 1 when right",
    "multi-turn": "a session is up to 3 answers, each after feedback on the last; rewarded 0.5^(answers before the right one), 0 if none is right",
}


def family(mode: str) -> str:
    """A mode's family by its d[i] (docs/modes.md): divided by the answer's own length, by a token count of
    more than one answer (the step's, its group's or its session's), or by a constant."""
    spec = MODES.get(mode)
    if spec is None:
        return "other"
    d = spec.denom_formula
    if "c(M[i])" in d:
        return "sample-normalised"
    if "L" in d.replace("L_max", "L"):
        return "constant divisor"
    return "token-normalised"


def tail(values: list[float], share: float = 0.2) -> list[float]:
    return values[-max(1, round(len(values) * share)) :]


def head(values: list[float], share: float = 0.2) -> list[float]:
    return values[: max(1, round(len(values) * share))]


def nanmean(values) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def spread(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation) over seeds, NaNs left out (sd NaN with fewer than two)."""
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return math.nan, math.nan
    return sum(kept) / len(kept), (statistics.stdev(kept) if len(kept) > 1 else math.nan)


def fmt(mean_sd: tuple[float, float], digits: int = 2) -> str:
    mean, sd = mean_sd
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f}" if math.isnan(sd) else f"{mean:.{digits}f} ± {sd:.{digits}f}"


def final(run: dict, key: str) -> float:
    """A run's figure over its last 20% of steps."""
    return nanmean(tail(run["history"][key]))


def by_pair(results: list[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        out.setdefault((r["task"], r["mode"]), []).append(r)
    return out


def _split_text(runs: list[dict]) -> tuple[str, bool]:
    checked = [r["split"] for r in runs if r["split"] is not None]
    if not checked:
        return "not checked", False
    worst = max(checked)
    return f"{'same gradient' if worst < SAME_GRADIENT else 'MISMATCH'} ({worst:.1e})", worst < SAME_GRADIENT


def length_bias(pairs: dict, task: str, seeds: list[int]) -> list[str]:
    """The length of wrong answers under sample_mean against token_mean and constant, paired by seed."""
    lines = []
    base = {r["seed"]: final(r, "wrong_length") for r in pairs.get((task, "sample_mean"), [])}
    for other in ("token_mean", "constant"):
        theirs = {r["seed"]: final(r, "wrong_length") for r in pairs.get((task, other), [])}
        diffs = [base[s] - theirs[s] for s in seeds if s in base and s in theirs and not math.isnan(base[s] - theirs[s])]
        if not diffs:
            continue
        mean, sd = spread(diffs)
        what = f"sample_mean's wrong answers end {abs(mean):.2f} tokens {'longer' if mean > 0 else 'shorter'} than {other}'s"
        if len(diffs) < 2:
            lines.append(f"- {task}: {what} (one seed: no spread to judge it by)")
        elif abs(mean) > 2 * sd / math.sqrt(len(diffs)):
            lines.append(
                f"- {task}: {what} (mean ± sd of the {len(diffs)} per-seed differences: {mean:+.2f} ± {sd:.2f}; beyond twice its standard error)"
            )
        else:
            lines.append(
                f"- {task}: no difference beyond the seeds' spread between sample_mean and {other} "
                f"({mean:+.2f} ± {sd:.2f} tokens over {len(diffs)} seeds, within twice its standard error): this run does not show the bias"
            )
    return lines


def summarise(results: list[dict], args) -> tuple[str, bool]:
    """The summary (markdown) and whether every split check passed."""
    pairs = by_pair(results)
    seeds = sorted({r["seed"] for r in results})
    tasks = list(dict.fromkeys(r["task"] for r in results))
    last = max(1, round(args.steps * 0.2))
    out = [
        "# lossagg demo: what the aggregation mode changes",
        "",
        f"GRPO on a counting task (`lossagg/demo/train.py`): write exactly k A's, then EOS, for k in 1..6. Right answers are "
        f"k + 1 tokens; wrong ones can ramble up to 16. {args.steps} steps of {args.prompts_per_step} prompts × "
        f"{args.n_samples_per_prompt} sessions, {args.micro_batches} micro-batches, seeds {', '.join(map(str, seeds))} for every "
        "mode and task (each run starts from its seed).",
        "",
        f"- **final reward**: the sessions' mean reward over a run's last 20% of steps (its last {last}); "
        + "; ".join(f"{t}: {TASK_NOTE[t]}" for t in tasks if t in TASK_NOTE)
        + ".",
        "- **wrong / right answers' length**: the mean token count of the wrong / right answers, over the first and the last 20% of steps.",
        "- **answers per session** (multi-turn): the answers the sessions took, over the last 20% of steps.",
        "- Every figure is the mean over seeds ± the standard deviation over seeds (one seed: the mean alone).",
        "- **family**: how the mode's `d[i]` treats an answer's length (docs/modes.md): divided by the answer's own length "
        "(sample-normalised: each answer weighs the same, so each token of a long answer weighs less), by a token count of "
        "several answers (token-normalised), or by a constant.",
        "- **split check**: one mid-training step's gradient with 1 and with 4 micro-batches, the largest difference relative to "
        "the gradient's largest entry (first seed).",
    ]
    ok = True
    for task in tasks:
        multi = task == "multi-turn"
        out += ["", f"## {task}", ""]
        header = "| mode | family | final reward | wrong answers' length, first → last | right answers' length, last |"
        header += " answers per session |" if multi else ""
        out += [header + " split check |", "|" + "---|" * (header.count("|") - 1 + 1)]
        for (t, mode), runs in pairs.items():
            if t != task:
                continue
            wrong0 = spread([nanmean(head(r["history"]["wrong_length"])) for r in runs])
            wrong1 = spread([final(r, "wrong_length") for r in runs])
            split, good = _split_text(runs)
            ok = ok and good
            row = f"| {mode} | {family(mode)} | {fmt(spread([final(r, 'reward') for r in runs]))} | {fmt(wrong0, 1)} → {fmt(wrong1, 1)} | "
            row += f"{fmt(spread([final(r, 'right_length') for r in runs]), 1)} |"
            row += f" {fmt(spread([final(r, 'turns') for r in runs]))} |" if multi else ""
            out.append(row + f" {split} |")
        if multi:
            out += ["", _session_note(pairs, seeds)]
        twins = _twins(pairs, task)
        if twins:
            out += ["", "Identical runs (every seed, every step): " + "; ".join(" = ".join(t) for t in twins) + _twins_why(task)]
    bias = [line for task in tasks for line in length_bias(pairs, task, seeds)]
    if bias:
        out += [
            "",
            "## The length bias",
            "",
            "Dividing by each answer's own length (`sample_mean`) weighs each token of a long wrong answer less, so long wrong "
            "answers are penalised less; the token-level and constant divisors do not. The wrong answers' length over the last "
            "20% of steps, `sample_mean` against each, paired by seed:",
            "",
            *bias,
        ]
    return "\n".join(out), ok


def _twins(pairs: dict, task: str) -> list[list[str]]:
    """The modes of ``task`` whose runs are the same, seed for seed and step for step."""
    groups: dict[str, list[str]] = {}
    for (t, mode), runs in pairs.items():
        if t == task:
            key = repr(sorted((r["seed"], r["history"]) for r in runs))
            groups.setdefault(key, []).append(mode)
    return [modes for modes in groups.values() if len(modes) > 1]


def _twins_why(task: str) -> str:
    if task == "multi-turn":
        return " (every prompt group holds the same number of sessions, n, so dividing by P · Sp[g] is dividing by S: docs/modes.md)."
    return "."


def _session_note(pairs: dict, seeds: list[int]) -> str:
    """How far the session modes' runs are from sample_mean's on the multi-turn task (the same seeds)."""
    base = {r["seed"]: r["history"] for r in pairs.get(("multi-turn", "sample_mean"), [])}
    parts = []
    for mode in [m for (t, m) in pairs if t == "multi-turn" and MODES.get(m) is not None and MODES[m].needs_sessions]:
        runs = {r["seed"]: r["history"] for r in pairs.get(("multi-turn", mode), [])}
        differing = [s for s in seeds if s in base and s in runs and runs[s] != base[s]]
        if runs and base:
            parts.append(f"{mode} {len(differing)}/{len([s for s in seeds if s in runs and s in base])}")
    if not parts:
        return "Sessions: run sample_mean and a session mode to compare them."
    return (
        "Sessions differ in length here (1 to 3 answers), so a session mode (each session once) weighs the answers "
        "differently from sample_mean (each answer once): seeds whose run differs from sample_mean's: " + ", ".join(parts) + "."
    )


def _smooth(values, width: int = 5):
    import numpy as np  # deferred: with matplotlib, only for the figure

    v = np.asarray(values, dtype=float)
    out = np.full_like(v, np.nan)
    for i in range(len(v)):
        window = v[max(0, i - width + 1) : i + 1]
        window = window[~np.isnan(window)]
        if window.size:
            out[i] = window.mean()
    return out


def write_figure(results: list[dict], out: str) -> str | None:
    """Small multiples, one row per task: reward, wrong answers' length, right answers' length (single-turn) or
    answers per session (multi-turn); the mean over seeds of each mode's 5-step moving average with a band of ±1
    standard deviation over seeds; modes of one family share a colour; the legend beside the plots."""
    try:
        import matplotlib  # deferred: optional (no figure without it), and only the demo draws one

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after the backend is chosen
        import numpy as np  # deferred: comes with matplotlib
    except ImportError:
        print("matplotlib is not installed: no figure (pip install matplotlib)", file=sys.stderr)
        return None
    pairs = by_pair(results)
    tasks = list(dict.fromkeys(r["task"] for r in results))
    panels = {
        "single-turn": (("reward", "reward"), ("wrong_length", "wrong answers' length"), ("right_length", "right answers' length")),
        "multi-turn": (("reward", "reward"), ("wrong_length", "wrong answers' length"), ("turns", "answers per session")),
    }
    fig, axes = plt.subplots(len(tasks), 3, figsize=(13, 3.3 * len(tasks)), squeeze=False)
    handles = {}
    used_styles: dict[str, int] = {}
    style_of = {}
    for mode in dict.fromkeys(r["mode"] for r in results):
        fam = family(mode)
        style_of[mode] = (COLOURS[fam], STYLES[used_styles.get(fam, 0) % len(STYLES)])
        used_styles[fam] = used_styles.get(fam, 0) + 1
    with np.errstate(all="ignore"):
        for row, task in enumerate(tasks):
            for col, (key, title) in enumerate(panels[task]):
                ax = axes[row][col]
                for (t, mode), runs in pairs.items():
                    if t != task:
                        continue
                    curves = np.array([_smooth(r["history"][key]) for r in runs])
                    mean = np.nanmean(curves, 0)
                    colour, style = style_of[mode]
                    (line,) = ax.plot(mean, color=colour, linestyle=style, linewidth=1.4, label=f"{mode} ({family(mode)})")
                    if len(runs) > 1:
                        sd = np.nanstd(curves, 0, ddof=1)
                        ax.fill_between(np.arange(len(mean)), mean - sd, mean + sd, color=colour, alpha=0.08, linewidth=0)
                    handles.setdefault(mode, line)
                ax.set_title(f"{task}: {title}", fontsize=10)
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
    seeds = len({r["seed"] for r in results})
    fig.legend(handles.values(), [h.get_label() for h in handles.values()], loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9, frameon=False)
    over = f"{seeds} seed{'s' if seeds > 1 else ''}"
    fig.suptitle(f"GRPO on the counting task per aggregation mode: mean over {over} ± 1 sd (5-step moving average)", fontsize=11)
    fig.tight_layout()
    path = os.path.join(out, "demo.png")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
