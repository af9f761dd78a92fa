"""The wording shared by every error message: a user's value quoted within bounds and "did
you mean" for a near miss. A leaf: it imports nothing of lossagg (nor torch), so the
registry, the step totals and the configuration all word their errors with it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

MAX_QUOTED = 80  # characters of a user's value quoted in a message


def short_repr(value: Any, limit: int = MAX_QUOTED, quote: bool = True) -> str:
    """``repr(value)`` (or the string itself) cut to ``limit`` characters, without building
    the repr of a huge or deeply nested value."""
    if isinstance(value, (dict, list, tuple, set)) and len(value) > 8:
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        text = repr(value) if quote else str(value)
    except (RecursionError, ValueError):
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def did_you_mean(name: Any, candidates: Iterable[Any]) -> str:
    """`` (did you mean 'x'?)`` for a close candidate, else ``""``; only for short strings.

    Close: similar as difflib judges it, or else the one candidate that ``name`` (3 characters
    or more) abbreviates, as ``coef`` does ``coefficient``."""
    if not isinstance(name, str) or len(name) > 64:
        return ""
    names = [c for c in candidates if isinstance(c, str)]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if not close and len(name) >= 3:
        close = [c for c in dict.fromkeys(names) if c.startswith(name) and c != name]
        close = close if len(close) == 1 else []
    return f" (did you mean {close[0]!r}?)" if close else ""
