"""The modes are listed in one place, the registry (lossagg/modes.py) and its docs table
(docs/modes.md, checked against it by tests/test_modes.py): no other library file names
every original mode, and no doc or example keeps a list of modes by hand (code that needs
every mode iterates ``lossagg.MODES``), so a new mode cannot leave a stale list behind."""

from __future__ import annotations

import os
import re
import subprocess

import lossagg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORIGINAL_MODES = ("sample_mean", "prompt_mean", "token_mean", "constant")


def _tracked(prefixes: tuple[str, ...], suffixes: tuple[str, ...]) -> list[str]:
    files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    return [f for f in files if f.startswith(prefixes) and f.endswith(suffixes)]


def _names(text: str, names) -> list[str]:
    return [n for n in names if re.search(rf"\b{n}\b", text)]


def test_only_the_registry_names_every_original_mode_among_library_files():
    offenders = []
    for path in _tracked(("lossagg/",), (".py",)):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            if len(_names(f.read(), ORIGINAL_MODES)) == len(ORIGINAL_MODES):
                offenders.append(path)
    assert offenders == ["lossagg/modes.py"], offenders


def test_no_doc_or_example_keeps_a_list_of_modes_by_hand():
    """A line naming three or more modes outside docs/modes.md (the one table) is a list that
    would go stale when a mode is added."""
    from lossagg.integrations.served import BEGIN, END

    modes = tuple(lossagg.MODES)
    offenders = []
    for path in _tracked(("docs/", "examples/", "README.md"), (".md", ".py", ".yaml", ".yml", ".toml", ".json")):
        if path == "docs/modes.md":
            continue
        generated = False  # the table between the served markers is made from the registry and the adapters (tests/test_served_table.py)
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                generated = (generated or line.strip() == BEGIN) and line.strip() != END
                if not generated and len(_names(line, modes)) >= 3:
                    offenders.append(f"{path}:{number}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)
