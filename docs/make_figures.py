"""Draws docs/length_bias.png: the weight each mode gives one token, against response length.

python docs/make_figures.py
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import lossagg  # noqa: E402
from lossagg.modes import divisor_for  # noqa: E402


def token_weights(mode: str, lengths: torch.Tensor, n: int) -> torch.Tensor:
    """d J / d l[i, t] for a token of each sample: the per-token weight, from the plan's d[i]."""
    divisor = divisor_for(lossagg.MODES[mode], default=float(lengths.max()), default_name="the step's longest response")
    extra = {} if divisor is None else {"divisor": divisor}
    config = lossagg.LossAggregationConfig(mode=mode, n_samples_per_prompt=n, **extra)
    group_index = torch.arange(lengths.numel()) // n
    # single-turn samples: each its own session (a session mode's weights depend on its sessions: docs/modes.md, "Sessions")
    plan = lossagg.StepPlan(config, lengths, group_index=group_index, session_index=torch.arange(lengths.numel()))
    return 1.0 / plan.sample_denoms


def main(out: str = os.path.join(os.path.dirname(__file__), "length_bias.png")) -> str:
    # one step: 8 prompts x 8 samples, responses of 16..2048 tokens
    n = 8
    lengths = torch.logspace(4, 11, 64, base=2).round()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for mode, spec in lossagg.MODES.items():
        if spec.needs_sessions:  # with single-turn samples each session mode is its one-sample form, a curve already drawn
            continue
        w = token_weights(mode, lengths, n)
        ax.plot(lengths, w / w.mean(), marker=".", label=mode)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="response length (tokens)",
        ylabel="weight of one token (relative to the step mean)",
        title="Per-token weight against response length",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main())
