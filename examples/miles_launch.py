"""A miles launch with lossagg's flags, checked the way the launcher checks it, without starting Ray.

In miles' own ``train.py`` the change is one line (docs/trainers/miles.md)::

    # from miles.utils.arguments import parse_args
    from lossagg.integrations.miles import parse_args

This script runs that ``parse_args`` (miles' own, lossagg's flags added, then the launch checks)
on a launch's flags and prints what lossagg resolved and which of miles' hooks it set; a refused
launch ends as miles' launcher would, with ``error: ...`` and exit status 2. For example::

    python examples/miles_launch.py --rollout-batch-size 8 --n-samples-per-prompt 4 \\
        --num-steps-per-rollout 2 --num-rollout 1 --loss-aggregation prompt_mean \\
        --num-layers 2 --hidden-size 8 --num-attention-heads 2 --micro-batch-size 1 \\
        --seq-length 64 --max-position-embeddings 64

miles-rl must be importable (scripts/install_peers.sh puts it in build/peers; see tests/miles_peer.py).
"""

from __future__ import annotations

import json

from lossagg.integrations import miles as adapter


def main() -> None:
    args = adapter.parse_args()
    if getattr(args, "lossagg_config", None) is None:
        print("no --loss-aggregation* flag: miles' own reducers, nothing wired")
        return
    print("lossagg:", json.dumps(args.lossagg_config, sort_keys=True))
    print(f"global_batch_size={args.global_batch_size} calculate_per_token_loss={args.calculate_per_token_loss}")
    for name in (*adapter.HOOKS, "loss_type", "lossagg_inner_loss", "lossagg_user_before_train_step_hook_path"):
        print(f"{name} = {getattr(args, name)}")


if __name__ == "__main__":
    main()
