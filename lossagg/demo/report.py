"""The demo's report: the summary table and the figure, from the training histories."""

from __future__ import annotations

import os
import sys

SAME_GRADIENT = 1e-5  # relative max difference of the split check


def summarise(results: dict) -> tuple[str, bool]:
    """A markdown table, one row per mode, and whether every split check passed."""
    header = "| mode | final reward | length first→last | grad-norm range | aggregation share of step | split check |"
    lines = [header, "|---|---|---|---|---|---|"]
    ok = True
    for mode, (h, inv) in results.items():
        k = max(1, len(h["reward"]) // 5)
        reward = sum(h["reward"][-k:]) / k
        l0, l1 = sum(h["length"][:k]) / k, sum(h["length"][-k:]) / k
        share = 100 * sum(h["agg_share"]) / len(h["agg_share"])
        check = f"{'same gradient' if inv < SAME_GRADIENT else 'MISMATCH'} ({inv:.1e})" if inv is not None else "not checked"
        ok = ok and inv is not None and inv < SAME_GRADIENT
        lines.append(
            f"| {mode} | {reward:.2f} | {l0:.1f} → {l1:.1f} | {min(h['grad_norm']):.3g}–{max(h['grad_norm']):.3g} | {share:.1f}% | {check} |"
        )
    return "\n".join(lines), ok


def write_figure(results: dict, out: str) -> str | None:
    """Reward and response length per step for each mode, as ``out/demo.png``."""
    try:
        import matplotlib  # deferred: optional (no figure without it), and only the demo draws one

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after the backend is chosen
    except ImportError:
        print("matplotlib is not installed: no figure (pip install matplotlib)", file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode, (h, _) in results.items():
        axes[0].plot(h["reward"], label=mode)
        axes[1].plot(h["length"], label=mode)
    axes[0].set(title="reward per step", xlabel="step", ylabel="mean reward")
    axes[1].set(title="response length per step", xlabel="step", ylabel="mean tokens")
    axes[0].legend()
    fig.tight_layout()
    path = os.path.join(out, "demo.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
