"""The lines and branches of lossagg/ that one coverage run covers and another does not.

    python scripts/coverage_compare.py WIDER.json NARROWER.json

Both are ``coverage json`` reports over the same code (scripts/coverage.sh writes one): e.g. the full
tier's and the default tier's. Prints each file's lines and branches covered by WIDER only, and exits
1 when there is any (the narrower run lost the last test of those), 0 when none.
"""

from __future__ import annotations

import json
import sys


def covered(report: dict) -> dict[str, tuple[set[int], set[tuple[int, int]]]]:
    out = {}
    for path, data in report["files"].items():
        key = path[path.index("lossagg/") :] if "lossagg/" in path else path
        out[key] = (set(data["executed_lines"]), {tuple(b) for b in data.get("executed_branches", [])})
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    wide, narrow = (covered(json.load(open(p))) for p in argv)
    lost = 0
    for path in sorted(wide):
        lines, branches = wide[path]
        have_lines, have_branches = narrow.get(path, (set(), set()))
        only_lines, only_branches = sorted(lines - have_lines), sorted(branches - have_branches)
        if only_lines or only_branches:
            lost += len(only_lines) + len(only_branches)
            print(f"{path}: lines {only_lines or '-'}; branches {[f'{a}->{b}' for a, b in only_branches] or '-'}")
    print(f"coverage_compare: {lost} lines and branches covered by {argv[0]} only")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
