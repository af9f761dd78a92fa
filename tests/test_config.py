"""LossAggregationConfig: every rule of docs/config.md both ways; config files, hostile ones
included (bounded work, every error at once, one line from the command line); the argparse
flags; the ``lossagg`` command line.

Needs neither torch nor the native library: scripts/test_min_python.sh runs this file under
the oldest supported Python with ``--noconftest`` and no torch installed."""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time

import pydantic
import pytest

from lossagg import ConfigError, LossAggregationConfig, add_loss_aggregation_args, config_from_args
from lossagg.cli import main as cli_main
from lossagg.modes import MODES


def issues(**kwargs):
    with pytest.raises(ConfigError) as info:
        LossAggregationConfig.from_dict(kwargs)
    return dict(info.value.issues), str(info.value)


# ----------------------------------------------------------------------- modes
def test_default_is_sample_mean():
    c = LossAggregationConfig()
    assert c.mode == "sample_mean"
    assert c.calculate_per_token_loss is False
    assert c.resolution_notes == ()


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_accepted(mode):
    assert LossAggregationConfig(mode=mode, **MODES[mode].example_settings).mode == mode


def test_unknown_mode_did_you_mean():
    found, _ = issues(mode="tokn_mean")
    assert "did you mean 'token_mean'" in found["mode"]


# --------------------------------------------------------------------- divisor
@pytest.mark.parametrize("divisor", [1, 2.5, 4096])
def test_constant_accepts_positive_finite_divisor(divisor):
    c = LossAggregationConfig(mode="constant", divisor=divisor)
    assert c.divisor == float(divisor)


def test_constant_needs_divisor():
    found, _ = issues(mode="constant")
    assert "needs divisor" in found["divisor"]


@pytest.mark.parametrize("divisor", [0, -1.0, math.nan, math.inf, -math.inf])
def test_constant_rejects_bad_divisor(divisor):
    found, _ = issues(mode="constant", divisor=divisor)
    assert "greater than 0" in found["divisor"] or "finite number" in found["divisor"], found["divisor"]


@pytest.mark.parametrize("mode", [m for m in list(MODES) if not MODES[m].needs_divisor])
def test_divisor_with_other_mode_is_an_error(mode):
    found, _ = issues(mode=mode, divisor=2.0)
    assert f"only used with mode=constant, got it with mode={mode}" in found["divisor"]


def test_divisor_as_string_is_an_error():
    found, _ = issues(mode="constant", divisor="1024")
    assert "divisor" in found


# --------------------------------------------------------- legacy flag, explicit vs default
def test_flag_with_default_mode_resolves_to_token_mean():
    c = LossAggregationConfig(calculate_per_token_loss=True)
    assert c.mode == "token_mean" and c.calculate_per_token_loss is True
    assert any("resolved to token_mean" in n for n in c.resolution_notes)


def test_flag_with_explicit_sample_mean_is_an_error():
    found, _ = issues(mode="sample_mean", calculate_per_token_loss=True)
    assert "contradicts mode=sample_mean" in found["calculate_per_token_loss"]


@pytest.mark.parametrize("mode", ["prompt_mean", "constant"])
def test_flag_with_other_explicit_modes_is_an_error(mode):
    extra = {"divisor": 2.0} if mode == "constant" else {}
    found, _ = issues(mode=mode, calculate_per_token_loss=True, **extra)
    assert f"contradicts mode={mode}" in found["calculate_per_token_loss"]


def test_flag_with_token_mean_is_consistent_and_token_mean_sets_it():
    assert LossAggregationConfig(mode="token_mean", calculate_per_token_loss=True).calculate_per_token_loss
    assert LossAggregationConfig(mode="token_mean").calculate_per_token_loss is True


def test_explicit_false_flag_with_token_mean_is_an_error():
    found, _ = issues(mode="token_mean", calculate_per_token_loss=False)
    assert "contradicts mode=token_mean" in found["calculate_per_token_loss"]


def test_false_flag_with_default_mode_keeps_sample_mean():
    c = LossAggregationConfig(calculate_per_token_loss=False)
    assert c.mode == "sample_mean" and c.calculate_per_token_loss is False


def test_boolean_given_as_string_is_an_error():
    found, _ = issues(calculate_per_token_loss="true")
    assert "expected a boolean (true/false, unquoted)" in found["calculate_per_token_loss"]


def test_rules_are_not_judged_against_a_default_standing_in_for_an_invalid_value():
    with pytest.raises(ConfigError) as info:
        LossAggregationConfig.from_dict({"mode": "tokn_mean", "divisor": 2.0})
    assert "sample_mean" not in str(info.value).split("expected one of")[0]
    assert [p for p, _ in info.value.issues] == ["mode"]


def test_a_mode_given_explicitly_keeps_its_rules_when_the_flag_is_invalid():
    with pytest.raises(ConfigError) as err:
        LossAggregationConfig.from_dict({"mode": "constant", "calculate_per_token_loss": 1})
    assert [p for p, _ in err.value.issues] == ["calculate_per_token_loss", "divisor"]
    # with the mode unset, the flag decides it: no rule is judged against a default
    with pytest.raises(ConfigError) as err:
        LossAggregationConfig.from_dict({"calculate_per_token_loss": 1, "divisor": 2.0})
    assert [p for p, _ in err.value.issues] == ["calculate_per_token_loss"]


# ----------------------------------------------------------- groups and batches
def test_n_samples_per_prompt_must_be_positive():
    found, _ = issues(n_samples_per_prompt=0)
    assert "n_samples_per_prompt" in found


def test_global_batch_size_multiple_of_n_under_prompt_mean():
    LossAggregationConfig(mode="prompt_mean", n_samples_per_prompt=8, global_batch_size=64)
    found, _ = issues(mode="prompt_mean", n_samples_per_prompt=8, global_batch_size=60)
    assert "multiple of n_samples_per_prompt (8)" in found["global_batch_size"]


def test_global_batch_size_not_checked_for_other_modes():
    assert LossAggregationConfig(n_samples_per_prompt=8, global_batch_size=60).global_batch_size == 60


def test_every_error_at_once_with_did_you_mean():
    found, text = issues(mdoe="x", n_samples_per_prompt=0, global_batch_size=-1)
    assert "did you mean 'mode'" in found["mdoe"]
    assert "n_samples_per_prompt" in found and "global_batch_size" in found
    assert "(3 errors)" in text


def test_a_mistyped_term_setting_is_named_by_its_path_with_did_you_mean():
    with pytest.raises(ConfigError) as info:
        LossAggregationConfig.from_dict({"mode": "sample_mean", "terms": {"kl": {"coef": 0.1}}})
    found = dict(info.value.issues)
    assert "unknown setting" in found["terms.kl.coef"] and "did you mean 'coefficient'" in found["terms.kl.coef"], found


def test_unknown_setting_with_a_huge_name_is_quoted_short():
    with pytest.raises(ConfigError) as info:
        LossAggregationConfig.from_dict({"m" * 100_000: 1})
    assert len(str(info.value)) < 500


def test_cross_field_errors_reported_together():
    found, _ = issues(mode="prompt_mean", n_samples_per_prompt=8, global_batch_size=12, divisor=3.0)
    assert set(found) == {"divisor", "global_batch_size"}


def test_frozen():
    c = LossAggregationConfig()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        c.mode = "token_mean"


# ------------------------------------------------------------- migration names
@pytest.mark.parametrize(
    "name,mode,extra",
    [
        ("seq-mean-token-mean", "sample_mean", {}),
        ("token-mean", "token_mean", {}),
        ("seq-mean-token-sum-norm", "constant", {"divisor": 512}),
        ("grpo", "sample_mean", {}),
        ("dapo", "token_mean", {}),
        ("dr_grpo", "constant", {"divisor": 1024}),
        ("seq-mean-token-sum", "constant", {}),
        ("seq_mean", "sample_mean", {}),
        ("token_mean", "token_mean", {}),
    ],
)
def test_migration_names_map_and_say_so(name, mode, extra):
    c = LossAggregationConfig.from_dict({"mode": name, **extra})
    assert c.mode == mode
    assert name == mode or any(name in note for note in c.resolution_notes)
    if name == "seq-mean-token-sum":
        assert c.divisor == 1.0


@pytest.mark.parametrize("name,why", [("bnpo", "micro-batch"), ("token-sum", "no normalisation")])
def test_refused_names_explain(name, why):
    found, _ = issues(mode=name)
    assert "not supported" in found["mode"] and why in found["mode"]


# ----------------------------------------------------------------------- files
GOOD = {"mode": "prompt_mean", "n_samples_per_prompt": 8, "global_batch_size": 64}


def write(tmp_path, name, data: bytes | str):
    p = tmp_path / name
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


def test_yaml_section_found_automatically(tmp_path):
    p = write(tmp_path, "train.yaml", "lr: 1.0e-6\nloss_aggregation: {mode: prompt_mean, n_samples_per_prompt: 8}\n")
    c = LossAggregationConfig.from_file(p)
    assert c.mode == "prompt_mean" and c.n_samples_per_prompt == 8


def test_json_and_toml(tmp_path):
    assert LossAggregationConfig.from_file(write(tmp_path, "c.json", json.dumps(GOOD))).n_samples_per_prompt == 8
    toml = 'mode = "constant"\ndivisor = 2048\n'
    assert LossAggregationConfig.from_file(write(tmp_path, "c.toml", toml)).divisor == 2048.0


def test_dotted_section_of_larger_file(tmp_path):
    text = '[trainer]\nlr = 1e-6\n[trainer.loss_aggregation]\nmode = "token_mean"\n'
    p = write(tmp_path, "big.toml", text)
    assert LossAggregationConfig.from_file(p, section="trainer.loss_aggregation").mode == "token_mean"
    with pytest.raises(ConfigError, match="section not found.*did you mean 'trainer'"):
        LossAggregationConfig.from_file(p, section="trainr.loss_aggregation")


def test_invalid_file_reports_every_error_with_path_and_file_name(tmp_path):
    p = write(tmp_path, "bad.yaml", "mode: constant\ndivisor: -1\nn_samples_per_promt: 4\ncalculate_per_token_loss: 'yes'\n")
    with pytest.raises(ConfigError) as info:
        LossAggregationConfig.from_file(p)
    text = str(info.value)
    assert "bad.yaml" in text
    paths = dict(info.value.issues)
    assert "did you mean 'n_samples_per_prompt'" in paths["n_samples_per_promt"]
    assert "calculate_per_token_loss" in paths


@pytest.mark.parametrize(
    "name,text,message",
    [
        ("empty.yaml", "", "empty"),
        ("list.yaml", "- 1\n- 2\n", "expected a mapping"),
        ("scalar.json", "3", "expected a mapping"),
        ("broken.json", "{mode: ", "cannot parse"),
        ("broken.toml", "mode = ", "cannot parse"),
        ("c.ini", "mode=x", "unknown file type"),
    ],
)
def test_bad_files(tmp_path, name, text, message):
    with pytest.raises(ConfigError, match=message):
        LossAggregationConfig.from_file(write(tmp_path, name, text))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        LossAggregationConfig.from_file(tmp_path / "nope.yaml")


def test_empty_section_means_every_default(tmp_path):
    path = str(write(tmp_path, "train.yaml", "lr: 1.0e-6\nbatch: 8\nloss_aggregation:\n"))
    assert LossAggregationConfig.from_file(path) == LossAggregationConfig()


CONFIG_FILES = [
    (
        "YAML merge key",
        "t.yaml",
        "defaults: &d\n  mode: prompt_mean\n  n_samples_per_prompt: 4\n"
        "loss_aggregation:\n  <<: *d\n  n_samples_per_prompt: 8\n  global_batch_size: 16\n",
        {"mode": "prompt_mean", "n_samples_per_prompt": 8, "global_batch_size": 16},
    ),
    (
        "YAML merge of a list of mappings",
        "t.yaml",
        "a: &a {mode: constant}\nb: &b {divisor: 4.0}\nloss_aggregation:\n  <<: [*a, *b]\n",
        {"mode": "constant", "divisor": 4.0},
    ),
    ("YAML merge key at the top", "t.yaml", "base: &b {mode: token_mean}\n<<: *b\n", None),
]


@pytest.mark.parametrize(("case", "name", "text", "expected"), CONFIG_FILES, ids=[c[0] for c in CONFIG_FILES])
def test_config_files_accepted(case, name, text, expected, tmp_path):
    path = str(write(tmp_path, name, text))
    if expected is None:  # a top-level merge brings 'base' along: an unknown setting, named
        with pytest.raises(ConfigError, match="base: unknown setting"):
            LossAggregationConfig.from_file(path)
        return
    config = LossAggregationConfig.from_file(path)
    assert {k: getattr(config, k) for k in expected} == expected


CONFIG_FILES_REFUSED = [
    (
        "5000-digit integer, YAML",
        "t.yaml",
        "global_batch_size: " + "9" * 5000 + "\n",
        ["global_batch_size: an integer of 5000 digits is out of range"],
    ),
    (
        "5000-digit integer, JSON",
        "t.json",
        '{"n_samples_per_prompt": -' + "9" * 5000 + "}",
        ["n_samples_per_prompt: an integer of 5000 digits is out of range"],
    ),
    (
        "5000-digit integer, TOML",
        "t.toml",
        "[loss_aggregation]\nglobal_batch_size = " + "1_" * 2500 + "1  # big\n",
        ["global_batch_size: an integer of 2501 digits"],
    ),
    ("above 2**53", "t.yaml", "global_batch_size: 9007199254740993\n", ["global_batch_size: Input should be less than or equal to 9007199254740992"]),
    (
        "a key given twice beside a merge",
        "t.yaml",
        "d: &d {mode: token_mean}\nloss_aggregation:\n  <<: *d\n  mode: sample_mean\n  mode: constant\n",
        ["the key 'mode' is given twice"],
    ),
    (
        "four errors, a bad flag among them",
        "t.yaml",
        "mode: prompt_mean\ncalculate_per_token_loss: 'yes'\ndivisor: 1.0\nn_samples_per_prompt: 3\nglobal_batch_size: 7\nlr: 1\n",
        [
            "calculate_per_token_loss: expected a boolean",
            "divisor: divisor is only used with mode=constant",
            "global_batch_size: under prompt_mean global_batch_size (7) must be a multiple",
            "lr: unknown setting",
        ],
    ),
]


@pytest.mark.parametrize(("case", "name", "text", "messages"), CONFIG_FILES_REFUSED, ids=[c[0] for c in CONFIG_FILES_REFUSED])
def test_config_files_refused_with_every_error(case, name, text, messages, tmp_path):
    path = str(write(tmp_path, name, text))
    with pytest.raises(ConfigError) as err:
        LossAggregationConfig.from_file(path)
    text = str(err.value)
    for message in messages:
        assert message in text, text
    if len(messages) > 1:
        assert f"({len(messages)} errors)" in text and len(err.value.issues) == len(messages)


def _fifo(tmp_path):
    path = tmp_path / "pipe.yaml"
    os.mkfifo(path)
    return str(path)


def _socket(tmp_path):
    path = str(tmp_path / "sock.yaml")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)  # the file stays after the socket object is collected
    return path


def _link_to_fifo(tmp_path):
    os.symlink(_fifo(tmp_path), tmp_path / "link.toml")
    return str(tmp_path / "link.toml")


NOT_REGULAR_FILES = [
    ("fifo", _fifo, "is a named pipe (FIFO), not a regular file"),
    ("socket", _socket, "is a socket, not a regular file"),
    ("link_to_fifo", _link_to_fifo, "is a named pipe (FIFO), not a regular file"),
    ("dev_null", lambda _: "/dev/null", "is a character device, not a regular file"),
    ("dev_zero", lambda _: "/dev/zero", "is a character device, not a regular file"),
    ("directory", lambda tmp_path: str(tmp_path), "is a directory"),
]


@pytest.mark.parametrize(("case", "make", "message"), NOT_REGULAR_FILES, ids=[c[0] for c in NOT_REGULAR_FILES])
def test_paths_that_are_not_regular_files_are_refused_without_blocking(tmp_path, case, make, message, capsys):
    """The loader and `lossagg check` read regular files only: a FIFO with no writer, a socket
    or a device is named and refused at once, never waited on (the CLI in this process; a fresh
    process below)."""
    path = make(tmp_path)
    with pytest.raises(ConfigError) as info:
        LossAggregationConfig.from_file(path)
    assert message in str(info.value) and path in str(info.value), str(info.value)
    assert cli_main(["check", path]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and path in err and "\n" not in err, err


def test_the_cli_refuses_a_fifo_in_a_fresh_process_without_blocking(tmp_path):
    """`python -m lossagg check` on a named pipe with no writer, as a user runs it (no stdin): one line, exit 1."""
    path = _fifo(tmp_path)
    done = subprocess.run([sys.executable, "-m", "lossagg", "check", path], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert done.returncode == 1 and "is a named pipe (FIFO), not a regular file" in done.stderr and "Traceback" not in done.stderr, done.stderr


BOM_FILES = [
    ("c.toml", 'mode = "constant"\ndivisor = 8.0\n'),
    ("c.json", '{"mode": "constant", "divisor": 8.0}'),
    ("c.yaml", "mode: constant\ndivisor: 8.0\n"),
    ("c.yml", "loss_aggregation:\n  mode: constant\n  divisor: 8.0\n"),
]


@pytest.mark.parametrize(("name", "text"), BOM_FILES, ids=[c[0] for c in BOM_FILES])
def test_a_utf8_byte_order_mark_is_accepted_in_every_format(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    c = LossAggregationConfig.from_file(str(path))
    assert (c.mode, c.divisor) == ("constant", 8.0)


def test_cli_check_paths_that_are_not_files(tmp_path, capsys):
    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    cases = {
        str(tmp_path): "is a directory",
        str(tmp_path / "loop_a"): "cannot read the file",
        "/dev/zero": "is a character device, not a regular file",
    }
    for path, message in cases.items():
        assert cli_main(["check", path]) == 1
        err = capsys.readouterr().err.strip()
        assert message in err and path in err and "\n" not in err, err


# ------------------------------------------------------------------ hostile files
# each is refused by `lossagg check` in bounded time, in one line that names the cause
def alias_bomb():
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    prev = "a"
    for name in "bcdefghi":
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
        prev = name
    return "\n".join(lines) + f"\nmode: *{prev}\n"


BAD_FILES = {
    "deep.json": ('{"a":' * 100_000 + "1" + "}" * 100_000, "nests deeper"),
    "deep.yaml": ("a:\n  " + "- " * 3000 + "1\n", "nests deeper"),
    "deep.toml": ("x = " + "[" * 5000 + "]" * 5000 + "\n", "nests deeper"),
    "bigint.json": ('{"mode": "constant", "divisor": ' + "9" * 5000 + "}", "divisor: an integer of 5000 digits is out of range"),
    "bigdiv.yaml": ("mode: constant\ndivisor: " + "9" * 400 + "\n", "divisor"),
    "bomb.yaml": (alias_bomb(), "more than"),
    "longstring.yaml": ("mode: " + "x" * 3_000_000 + "\n", "unknown mode"),
    "toolarge.yaml": ("# " + "x" * (5 * 1024 * 1024) + "\n", "larger than"),
    "dup.yaml": ("mode: token_mean\nmode: constant\n", "'mode' is given twice"),
    "dup.json": ('{"mode": "token_mean", "mode": "constant"}', "'mode' is given twice"),
    "dup.toml": ('mode = "token_mean"\nmode = "constant"\n', "cannot parse"),
    "binary.yaml": (b"\xff\xfe\x00mode", "cannot parse"),
    "list.json": ("[1, 2]", "expected a mapping"),
    "section.yaml": ("loss_aggregation: 3\n", "expected a mapping of settings"),
    "keys.yaml": ("1: 2\n", "setting names must be strings"),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_cli_check_bad_files_one_line_exit_1_bounded(tmp_path, capsys, name):
    text, message = BAD_FILES[name]
    path = str(write(tmp_path, name, text))
    start = time.perf_counter()
    assert cli_main(["check", path]) == 1
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err.strip()
    assert message in err, err[:500]
    assert "Traceback" not in err and len(err) < 2000, err[:500]
    assert elapsed < 10, f"took {elapsed:.1f}s"


# -------------------------------------------------------------------- argparse
def test_flags_round_trip():
    parser = add_loss_aggregation_args(argparse.ArgumentParser())
    args = parser.parse_args(["--loss-aggregation", "prompt_mean", "--n-samples-per-prompt", "4", "--global-batch-size", "32"])
    c = config_from_args(args)
    assert (c.mode, c.n_samples_per_prompt, c.global_batch_size) == ("prompt_mean", 4, 32)
    c = config_from_args(parser.parse_args(["--loss-aggregation", "constant", "--loss-aggregation-divisor", "8"]))
    assert c.divisor == 8.0
    assert config_from_args(parser.parse_args(["--calculate-per-token-loss"])).mode == "token_mean"


def test_parser_that_already_defines_global_batch_size():
    parser = argparse.ArgumentParser()
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser.add_argument("--calculate-per-token-loss", action="store_true")
    add_loss_aggregation_args(parser)  # must not raise "conflicting option string"
    args = parser.parse_args(["--loss-aggregation", "prompt_mean", "--n-samples-per-prompt", "8", "--global-batch-size", "12"])
    with pytest.raises(ConfigError) as info:
        config_from_args(args)
    assert "--global-batch-size" in dict(info.value.issues)


def test_flag_errors_name_the_flag():
    parser = add_loss_aggregation_args(argparse.ArgumentParser())
    with pytest.raises(ConfigError) as info:
        config_from_args(parser.parse_args(["--loss-aggregation", "sample_mean", "--calculate-per-token-loss"]))
    assert "--calculate-per-token-loss" in dict(info.value.issues)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--loss-aggregation", "constant", "--loss-aggregation-divisor", "0"], "--loss-aggregation-divisor"),
        (["--loss-aggregation", "prompt_mean", "--n-samples-per-prompt", "0"], "--n-samples-per-prompt"),
        (["--global-batch-size", "0"], "--global-batch-size"),
    ],
)
def test_zero_is_a_value_not_unset(argv, flag):
    parser = argparse.ArgumentParser()
    add_loss_aggregation_args(parser)
    with pytest.raises(ConfigError, match=flag):
        config_from_args(parser.parse_args(argv))


# ------------------------------------------------------------------------- CLI
def test_cli_check_ok(tmp_path, capsys):
    p = write(tmp_path, "train.yaml", "loss_aggregation:\n  calculate_per_token_loss: true\n")
    assert cli_main(["check", str(p)]) == 0
    out = capsys.readouterr().out
    assert '"mode": "token_mean"' in out and "note: mode unset and calculate_per_token_loss=true" in out


def test_cli_check_errors_exit_nonzero(tmp_path, capsys):
    p = write(tmp_path, "bad.json", json.dumps({"mode": "constant", "extra": 1}))
    assert cli_main(["check", str(p)]) == 1
    err = capsys.readouterr().err
    assert "divisor" in err and "extra: unknown setting" in err and "bad.json" in err


def test_cli_check_suggests_a_mistyped_term_setting(tmp_path, capsys):
    p = write(tmp_path, "typo.yaml", "mode: sample_mean\nterms:\n  kl:\n    coef: 0.1\n")
    assert cli_main(["check", str(p)]) == 1
    err = capsys.readouterr().err
    assert "terms.kl.coef: unknown setting (did you mean 'coefficient'?)" in err and "Traceback" not in err, err


def test_cli_check_suggests_a_misspelled_section_and_leaves_the_trainers_keys_alone(tmp_path, capsys):
    """A file whose section is misspelled: the section it meant is suggested, and the file's other keys (the
    trainer's own settings) are not reported as lossagg's errors."""
    p = write(tmp_path, "train.yaml", "lr: 1.0e-6\nbatch_size: 8\nloss_agregation:\n  mode: sample_mean\n")
    assert cli_main(["check", str(p)]) == 1
    err = capsys.readouterr().err
    assert "loss_agregation" in err and "did you mean 'loss_aggregation'" in err, err
    assert "lr:" not in err and "batch_size" not in err and "Traceback" not in err, err


def test_cli_schema_is_json(capsys):
    assert cli_main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "mode" in schema["properties"] and schema["additionalProperties"] is False


def test_console_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "lossagg", "--help"], capture_output=True, text=True, check=True)
    assert "lossagg check" in out.stdout


def run_cli(args, cwd, env=None):
    """``python -m lossagg *args`` in ``cwd``, no stdin, importing lossagg from where this process
    does (PYTHONPATH made absolute: scripts/test_min_python.sh sets ``PYTHONPATH=.``)."""
    path = os.pathsep.join(os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    return subprocess.run(
        [sys.executable, "-m", "lossagg", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **({"PYTHONPATH": path} if path else {}), **(env or {})},
        stdin=subprocess.DEVNULL,
        timeout=300,
    )


def test_cli_never_shows_a_traceback(tmp_path):
    path = str(write(tmp_path, "deep.json", '{"a":' * 50_000 + "1" + "}" * 50_000))
    run = subprocess.run([sys.executable, "-m", "lossagg", "check", path], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert run.returncode == 1 and "Traceback" not in run.stderr and run.stderr.count("\n") == 1, run.stderr


@pytest.mark.parametrize("command", [["check", "f.yaml"], ["schema"]])
def test_a_bad_cpu_isa_variable_is_one_line_from_the_cli(command, tmp_path):
    write(tmp_path, "f.yaml", "mode: token_mean\n")
    out = run_cli(command, tmp_path, {"LOSSAGG_CPU_ISA": "bogus"})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"lossagg {command[0]}: LOSSAGG_CPU_ISA must be one of auto, avx512, avx2, baseline, got 'bogus'"
