"""LossAggregationConfig: every rule of SPEC §6 both ways, files, argparse, the CLI."""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys

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


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
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
def test_paths_that_are_not_regular_files_are_refused_without_blocking(tmp_path, case, make, message):
    """The loader and `lossagg check` read regular files only: a FIFO with no writer, a socket
    or a device is named and refused at once, never waited on."""
    path = make(tmp_path)
    with pytest.raises(ConfigError) as info:
        LossAggregationConfig.from_file(path)
    assert message in str(info.value) and path in str(info.value), str(info.value)
    done = subprocess.run([sys.executable, "-m", "lossagg", "check", path], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert done.returncode == 1 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


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


def test_cli_schema_is_json(capsys):
    assert cli_main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "mode" in schema["properties"] and schema["additionalProperties"] is False


def test_console_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "lossagg", "--help"], capture_output=True, text=True, check=True)
    assert "lossagg check" in out.stdout
