"""``ConfigError`` and the wording of configuration errors: one line per problem, each
with its field path (and the source), "did you mean" for near misses."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """Every problem of a configuration at once: ``issues`` is a list of (path, message)."""

    def __init__(self, issues: list[tuple[str, str]], source: str | None = None):
        self.issues = issues
        self.source = source
        where = f"{source}: " if source else ""
        lines = [f"{where}{path}: {msg}" if path else f"{where}{msg}" for path, msg in issues]
        header = f"invalid loss aggregation config ({len(issues)} error{'s' if len(issues) != 1 else ''})"
        super().__init__(header + "\n  " + "\n  ".join(lines))


def did_you_mean(name: Any, candidates: Iterable[Any]) -> str:
    """`` (did you mean 'x'?)`` for a close candidate, else ``""``."""
    close = difflib.get_close_matches(str(name), [str(c) for c in candidates], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def issues_from_validation(exc, *, fields: Iterable[str], modes: Iterable[str], migration_names: Iterable[str]) -> list[tuple[str, str]]:
    """(path, message) for each error of a pydantic ``ValidationError`` of the config model."""
    fields, modes, migration_names = list(fields), list(modes), sorted(migration_names)
    issues: list[tuple[str, str]] = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        ctx = err.get("ctx") or {}
        kind = err["type"]
        if kind == "loss_aggregation_rules":
            issues.extend((p, m) for p, m in ctx["problems"])
        elif kind == "refused_mode":
            issues.append(("mode", err["msg"]))
        elif kind == "extra_forbidden":
            issues.append((loc, f"unknown setting{did_you_mean(err['loc'][-1], fields)}"))
        elif kind == "enum" and err["loc"] == ("mode",):
            issues.append(
                (
                    "mode",
                    f"unknown mode {err['input']!r}{did_you_mean(err['input'], modes + migration_names)}; expected one of "
                    f"{', '.join(modes)} (or a migration name: {', '.join(migration_names)})",
                )
            )
        elif kind == "bool_type" and isinstance(err.get("input"), str):
            issues.append((loc, f"expected a boolean (true/false, unquoted), got the string {err['input']!r}"))
        else:
            issues.append((loc, f"{err['msg']}, got {err.get('input')!r}"))
    return issues
