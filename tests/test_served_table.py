"""The table of what each trainer serves (docs/trainers/README.md, between its ``served`` markers) is the one
:mod:`lossagg.integrations.served` derives from the adapters' own checks, at the top of the page; and its cells
follow those checks: a refusal planted in an adapter, or one taken out, changes the cell (so the comparison with
the page cannot pass on a table that ignores the adapters). No trainer is imported."""

from __future__ import annotations

import os

from lossagg.integrations import areal, openrlhf, served

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "trainers", "README.md")


def row(prefix: str) -> tuple[dict[str, str], list[str]]:
    """The cells of the trainer whose row name starts with ``prefix``, by column key, and the notes they number."""
    (trainer,) = [t for t in served.trainers() if t.name.startswith(prefix)]
    answers, notes = served.outcomes(trainer), served.Notes()
    cells = {key: served.cell(answers[key], notes, key) for key in served.COLUMNS}
    return cells, list(notes.numbers)


def test_the_page_holds_the_generated_table_at_its_top():
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    assert served.block(text) == served.table(), (
        f"docs/trainers/README.md's table of what each trainer serves is not what the adapters' checks say now: run `{served.COMMAND}`"
    )
    first_section = text.index("\n## ")
    assert text.index(served.BEGIN) < text.index("\n## ", first_section + 1), "the table is the page's first section"
    assert served.COMMAND in text, "the page says how its table is made"


def test_a_removed_refusal_turns_its_cell_to_served(monkeypatch):
    cells, notes = row("OpenRLHF")
    assert cells["sessions"] == "✗ [1]", cells
    assert notes[0].startswith("mode=session_mean weighs each session (multi-turn trajectory) once"), notes
    monkeypatch.setattr(openrlhf, "session_refusal", lambda config, trainer, why: None)
    assert row("OpenRLHF")[0]["sessions"] == "✓"


def test_a_planted_refusal_turns_its_cells_to_refused_with_its_reason(monkeypatch):
    cells, _ = row("AReaL")
    assert cells["plain"] == "✓" and cells["sessions"] == "✓ with `sessions=True`", cells

    def refusing(actor_config, loss_aggregation=None, *, sessions=False):
        raise areal.AReaLConfigError("lossagg cannot serve this AReaL actor:\n- planted: no   data\n  for it\n- a second reason")

    monkeypatch.setattr(areal, "config_for", refusing)
    cells, notes = row("AReaL")
    assert cells["plain"] == cells["sessions"] == cells["weighting"] == "✗ [1]", cells
    assert cells["filter"] == "✗ `actor.m2_threshold` [1]", cells
    assert notes == ["planted: no data for it"]


def test_refusals_that_differ_only_in_their_modes_share_a_note():
    a = "mode=session_mean needs the step total(s) num_sessions, session_sizes, which X does not hand its loss"
    b = "mode=prompt_session_token_mean needs the step total(s) num_groups, group_sessions, session_token_sums, which X does not hand its loss"
    assert served.vocabulary_free(a) == served.vocabulary_free(b) != served.vocabulary_free(a.replace("X", "Y"))
    assert served.one_line("terms (kl): X reduces them\n   inside: its own | reducer") == "terms (kl): X reduces them inside: its own \\| reducer"
