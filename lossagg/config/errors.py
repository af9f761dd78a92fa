"""``ConfigError`` and the wording of configuration errors: one line per problem, each
with its field path (and the source), "did you mean" for near misses."""

from __future__ import annotations

from collections.abc import Iterable

# the wording shared with the registry and the step totals is lossagg/messages.py's (still importable from here)
from lossagg.messages import MAX_QUOTED, did_you_mean, short_repr  # noqa: F401


class ConfigError(ValueError):
    """Every problem of a configuration at once: ``issues`` is a list of (path, message)."""

    def __init__(self, issues: list[tuple[str, str]], source: str | None = None):
        self.issues = issues
        self.source = source
        where = f"{source}: " if source else ""
        lines = [f"{where}{path}: {msg}" if path else f"{where}{msg}" for path, msg in issues]
        if len(lines) == 1:  # one problem: one line
            super().__init__(f"invalid loss aggregation config: {lines[0]}")
        else:
            header = f"invalid loss aggregation config ({len(issues)} errors)"
            super().__init__(header + "\n  " + "\n  ".join(lines))


#: Integer literals longer than this many digits are not converted (Python refuses over 4300
#: by default, and the conversion costs quadratic time): they are kept as a HugeInt, so the
#: error names the setting.
MAX_INT_DIGITS = 4000


class HugeInt:
    """An integer literal of a config file too long to convert, kept as its length."""

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def issues_from_validation(
    exc,
    *,
    fields: Iterable[str],
    modes: Iterable[str],
    migration_names: Iterable[str],
    invalid: Iterable[str] = (),
    term_fields: Iterable[str] = (),
) -> list[tuple[str, str]]:
    """(path, message) for each error of a pydantic ``ValidationError`` of the config model.

    Cross-field problems that depend on a setting in ``invalid`` are left out: they would
    be judged against a default standing in for the user's invalid value.
    """
    invalid = set(invalid)
    fields, modes, migration_names, term_fields = list(fields), list(modes), sorted(migration_names), list(term_fields)
    issues: list[tuple[str, str]] = []
    for err in exc.errors():
        loc = ".".join(short_repr(p, quote=False) for p in err["loc"])
        ctx = err.get("ctx") or {}
        kind = err["type"]
        if kind == "loss_aggregation_rules":
            issues.extend((p, m) for p, m, depends in ctx["problems"] if not invalid & set(depends))
        elif kind == "refused_mode":
            issues.append(("mode", err["msg"]))
        elif kind == "extra_forbidden":
            in_term = err["loc"][0] == "terms" and len(err["loc"]) == 3
            issues.append((loc, f"unknown setting{did_you_mean(err['loc'][-1], term_fields if in_term else fields)}"))
        elif kind == "unknown_mode" and err["loc"][0] == "terms":  # a term's reducer: a registered mode's own name
            value = err.get("input")
            what = f"unknown mode {short_repr(value)}" if isinstance(value, str) else f"expected a mode name (a string), got {short_repr(value)}"
            issues.append((loc, f"{what}{did_you_mean(value, modes)}; a term's reducer is one of {', '.join(modes)}"))
        elif kind == "unknown_mode":
            value = err.get("input")
            what = f"unknown mode {short_repr(value)}" if isinstance(value, str) else f"expected a mode name (a string), got {short_repr(value)}"
            issues.append(
                (
                    "mode",
                    f"{what}{did_you_mean(value, modes + migration_names)}; expected one of "
                    f"{', '.join(modes)} (or a migration name: {', '.join(migration_names)})",
                )
            )
        elif isinstance(err.get("input"), HugeInt):
            issues.append((loc, f"an integer of {err['input'].digits} digits is out of range for this setting"))
        elif kind == "bool_type" and isinstance(err.get("input"), str):
            issues.append((loc, f"expected a boolean (true/false, unquoted), got the string {short_repr(err['input'])}"))
        else:
            issues.append((loc, f"{err['msg']}, got {short_repr(err.get('input'))}"))
    return issues
