"""The mode registry is the one home of the modes: everything else reads it, the docs' one
table of modes matches it, and the pre-release names are gone."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

import lossagg
from lossagg.cli import build_parser
from lossagg.modes import ALIASES, MODES, REFUSED_NAMES, mode_spec
from lossagg.testing import reference_loss
from lossagg.totals import TOTALS

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_schema_cli_and_demo_follow_the_registry():
    schema = lossagg.LossAggregationConfig.model_json_schema()
    assert schema["properties"]["mode"]["enum"] == list(MODES)
    assert schema["properties"]["mode"]["default"] == next(iter(MODES))
    demo = build_parser().parse_args(["demo"])
    assert demo.modes == list(MODES)


@pytest.mark.parametrize("name", list(MODES))
def test_each_entry_is_complete(name):
    spec = MODES[name]
    assert spec.name == name and spec.summary and spec.formula and spec.denom_formula
    assert spec.totals and all(t in TOTALS for t in spec.totals)
    config = lossagg.LossAggregationConfig(mode=name, **spec.example_settings)
    assert config.mode == name


def _docs_table(marker: str = "<!-- modes table") -> dict[str, list[str]]:
    """The rows of a table of docs/modes.md (the first after ``marker``): name -> cells."""
    text = (DOCS / "modes.md").read_text()
    start = text.index(marker)
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.match(r"`([a-z0-9_-]+)`", cells[0])
        if name:
            rows[name.group(1)] = cells
    return rows


def test_the_docs_table_of_modes_is_the_registry():
    rows = _docs_table()
    assert list(rows) == list(MODES), "docs/modes.md lists the modes of lossagg.MODES, in the same order"
    for name, cells in rows.items():
        spec = MODES[name]
        assert cells[1] == f"`{spec.formula}`" and cells[2] == f"`{spec.denom_formula}`", name
        assert cells[3] == ", ".join(TOTALS[t].symbol for t in spec.totals) + (", L" if spec.needs_divisor else ""), name


def test_the_docs_table_of_step_totals_is_lossagg_totals():
    rows = _docs_table("<!-- totals table")
    assert list(rows) == list(TOTALS), "docs/modes.md lists the step totals of lossagg.TOTALS, in the same order"
    for name, cells in rows.items():
        total = TOTALS[name]
        assert (cells[1], cells[3]) == (total.symbol, total.meaning), name
        assert cells[2].startswith(total.combine), name


def test_the_docs_table_of_other_trainers_names_is_the_registry():
    rows = _docs_table("<!-- aliases table")
    assert set(rows) == set(ALIASES) | set(REFUSED_NAMES)
    for name, cells in rows.items():
        if name in REFUSED_NAMES:
            assert cells[2] == "**refused**", name
        else:
            alias = ALIASES[name]
            shown = {m for m in re.findall(r"`([a-z0-9_]+)`", cells[2])}
            assert shown == {alias.mode} | ({alias.with_divisor} if alias.with_divisor else set()), name


def test_the_other_docs_point_to_the_one_table():
    """README, config.md and the trainers' index link docs/modes.md and do not repeat its rows."""
    from lossagg.integrations.served import BEGIN, END

    readme = (DOCS.parent / "README.md").read_text()
    trainers = (DOCS / "trainers" / "README.md").read_text()
    # its generated table quotes the adapters' refusals, made from the registry (tests/test_served_table.py keeps it so)
    trainers = trainers.split(BEGIN)[0] + trainers.split(END)[-1]
    pages = {"README.md": readme, "config.md": (DOCS / "config.md").read_text(), "trainers/README.md": trainers}
    for where, text in pages.items():
        assert "modes.md" in text, where
        for spec in MODES.values():
            assert spec.denom_formula not in text, f"{where} repeats the d[i] of {spec.name}; point to docs/modes.md"


def test_aliases_point_to_modes_and_never_hide_one():
    for name, alias in ALIASES.items():
        assert alias.mode in MODES and (alias.with_divisor is None or alias.with_divisor in MODES), name
        assert name not in MODES and name.replace("-", "_") not in MODES or name.replace("-", "_") == alias.mode, name
        resolved = lossagg.LossAggregationConfig.from_dict({"mode": name, **MODES[alias.mode].example_settings, **alias.implies})
        assert resolved.mode == alias.mode and resolved.resolution_notes, name
    assert not set(REFUSED_NAMES) & (set(ALIASES) | set(MODES))


def test_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match=re.escape(f"mode must be one of {', '.join(MODES)}, got 'bogus'")):
        mode_spec("bogus")
    fake_config = types.SimpleNamespace(mode="bogus", divisor=None)
    with pytest.raises(ValueError, match="'bogus'"):
        reference_loss(fake_config, torch.ones(3), torch.ones(3, dtype=torch.bool), torch.tensor([0, 3]))


def test_reference_needs_group_index_under_prompt_mean():
    config = lossagg.LossAggregationConfig(mode="prompt_mean")
    with pytest.raises(ValueError, match="needs group_index"):
        reference_loss(config, torch.ones(3), torch.ones(3, dtype=torch.bool), torch.tensor([0, 3]))


def test_cu_seqlens_from_lengths():
    cu = lossagg.cu_seqlens_from_lengths(torch.tensor([3, 0, 2]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 5]
    assert lossagg.cu_seqlens_from_lengths([], dtype=torch.int64).tolist() == [0]
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        lossagg.cu_seqlens_from_lengths([1, -1])
    with pytest.raises(TypeError, match="lengths must hold integers"):
        lossagg.cu_seqlens_from_lengths(torch.tensor([1.5]))


def test_pre_release_names_are_gone():
    for name in ("sample_denoms", "step_denoms", "AggregationMode", "MODE_NAMES"):
        assert not hasattr(lossagg, name), name
    plan = lossagg.StepPlan(lossagg.LossAggregationConfig(), torch.tensor([2, 0, 6, 4]))
    assert not hasattr(plan, "denoms")
    with pytest.raises(TypeError, match="num_groups"):
        lossagg.StepPlan(lossagg.LossAggregationConfig(), torch.tensor([2, 0]), num_groups=2)


def test_reduce_takes_cu_seqlens_and_denominators_by_keyword_only():
    values = torch.randn(5)
    mask = torch.ones(5, dtype=torch.bool)
    cu = torch.tensor([0, 2, 5])
    d = torch.tensor([2.0, 3.0])
    j = lossagg.reduce(values, mask, cu_seqlens=cu, sample_denoms=d)
    assert torch.equal(j, torch.ops.lossagg.reduce(values, mask, cu, d))
    with pytest.raises(TypeError, match="takes 2 positional arguments, got 4: pass cu_seqlens= and sample_denoms= by keyword"):
        lossagg.reduce(values, mask, d, cu)
    with pytest.raises(TypeError, match="sample_denoms"):
        lossagg.reduce(values, mask, cu_seqlens=cu)


# (name as a user types it, settings, the mode it resolves to, or the start of the refusal)
OTHER_TRAINERS_SPELLINGS = [
    ("sequence_mean", {}, "sample_mean"),  # SkyRL
    ("sequence-mean", {}, "sample_mean"),
    ("seq_mean_token_sum_norm", {"divisor": 4096.0}, "constant"),  # SkyRL, which always sets max_seq_len
    ("seq_mean_token_sum_norm", {}, "max_length"),  # verl's name with '_'
    ("seq-mean-token-sum-norm", {"divisor": 8.0}, "constant"),
    ("seq_mean_token_mean", {}, "sample_mean"),
    ("dr-grpo", {"divisor": 8.0}, "constant"),
    ("seq-mean", {}, "sample_mean"),
    ("Token-Mean", {}, "token_mean"),
    ("token_mean_legacy", {}, "mode 'token_mean_legacy' is not supported: SkyRL's 'token_mean_legacy' divides each micro-batch"),
    ("token-mean-legacy", {}, "mode 'token-mean-legacy' is not supported: SkyRL's 'token_mean_legacy'"),
    ("token_sum", {}, "mode 'token_sum' is not supported: verl's 'token-sum'"),
]


@pytest.mark.parametrize(("name", "settings", "expected"), OTHER_TRAINERS_SPELLINGS, ids=[f"{c[0]}-{c[2][:20]}" for c in OTHER_TRAINERS_SPELLINGS])
def test_other_trainers_names_resolve_whichever_separator_they_use(name, settings, expected):
    if expected in MODES:
        config = lossagg.LossAggregationConfig.from_dict({"mode": name, **settings})
        assert config.mode == expected and config.resolution_notes, (name, config)
        return
    with pytest.raises(lossagg.ConfigError) as info:
        lossagg.LossAggregationConfig.from_dict({"mode": name, **settings})
    assert expected in str(info.value), str(info.value)


def test_a_mode_cannot_be_registered_under_another_trainers_name_in_either_spelling():
    from lossagg.modes import ModeSpec, register_mode

    for taken in ("sequence_mean", "token_mean_legacy", "seq_mean_token_sum_norm"):
        spec = ModeSpec(
            name=taken,
            summary="x",
            formula="x",
            denom_formula="x",
            totals=("num_samples",),
            denoms=lambda x: x.token_counts + 1,
            reference=lambda r: 0,
        )
        with pytest.raises(ValueError, match="is taken"):
            register_mode(spec)
        assert taken not in MODES
