"""The ``lossagg`` command: ``check`` a config file, print the ``schema``, run the ``demo``.

Nothing it imports loads torch: ``lossagg check`` and ``lossagg schema`` work without it (the
demo imports its training, and torch, only when it runs).
"""

from __future__ import annotations

import argparse
import json
import sys

from lossagg.config import ConfigError, LossAggregationConfig
from lossagg.demo import add_demo_args, run_demo
from lossagg.env import check_cpu_isa_env
from lossagg.messages import short_repr

EXAMPLES = """examples:
  lossagg check train.yaml                      # uses its loss_aggregation: section if any
  lossagg check train.yaml --section trainer.loss_aggregation
  lossagg schema > loss_aggregation.schema.json
  lossagg demo --steps 40 --modes sample_mean token_mean --out demo-out
"""


def _cmd_check(args) -> int:
    try:
        config = LossAggregationConfig.from_file(args.file, section=args.section)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(f"{args.file}: valid loss aggregation config")
    meanings = {"group_index": "its prompt group", "session_index": "its session, the trajectory it belongs to"}
    needed = config.sample_indices()
    if needed:
        print("each sample needs: " + ", ".join(f"{name} ({meanings[name]})" for name in needed))
    print(json.dumps(config.summary(), indent=2))
    for note in config.resolution_notes:
        print(f"note: {note}")
    return 0


def _cmd_schema(args) -> int:
    print(json.dumps(LossAggregationConfig.model_json_schema(), indent=2))
    return 0


def _cmd_demo(args) -> int:
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lossagg",
        description="Exact, split-invariant aggregation of per-token policy-gradient losses.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser(
        "check",
        help="validate a JSON/YAML/TOML config file and print the resolved config",
        description="Validate a loss aggregation config; prints the resolved config and exits 0, or prints every error and exits 1.",
        epilog="example: lossagg check train.yaml --section loss_aggregation",
    )
    check.add_argument("file", help="a .json, .yaml/.yml or .toml file")
    check.add_argument("--section", default=None, help="dotted path of the section holding the settings")
    check.set_defaults(func=_cmd_check)

    schema = sub.add_parser("schema", help="print the JSON Schema of the config", epilog="example: lossagg schema > schema.json")
    schema.set_defaults(func=_cmd_schema)

    demo = sub.add_parser(
        "demo",
        help="train a tiny policy with GRPO under each mode and compare",
        epilog="example: lossagg demo --steps 60 --out demo-out",
    )
    add_demo_args(demo)
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_cpu_isa_env()
    except ValueError as exc:
        print(f"lossagg {args.command}: {exc}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"lossagg {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # never a traceback from the command line: one line, exit 1
        print(f"lossagg {args.command}: {type(exc).__name__}: {short_repr(str(exc), 300, quote=False)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
