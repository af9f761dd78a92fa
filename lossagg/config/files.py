"""Reading a config from a JSON, YAML or TOML file, optionally one (dotted) section of a
larger training config."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import yaml

from lossagg.config.errors import ConfigError, did_you_mean

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

EXTENSIONS = (".json", ".yaml", ".yml", ".toml")
#: The section used when the caller names none and the file has it.
DEFAULT_SECTION = "loss_aggregation"


def read_file(path: str) -> Mapping:
    """The top-level mapping of a config file; ConfigError naming the file otherwise."""
    if not os.path.exists(path):
        raise ConfigError([("", "file not found")], path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSIONS:
        raise ConfigError([("", f"unknown file type {ext!r}; expected {', '.join(EXTENSIONS)}")], path)
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.strip():
        raise ConfigError([("", "the file is empty; expected a mapping of loss aggregation settings")], path)
    try:
        if ext == ".json":
            data = json.loads(raw)
        elif ext == ".toml":
            data = tomllib.loads(raw.decode("utf-8"))
        else:
            data = yaml.safe_load(raw)
    except (json.JSONDecodeError, yaml.YAMLError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError([("", f"cannot parse the file: {exc}")], path) from None
    if not isinstance(data, Mapping):
        raise ConfigError([("", f"expected a mapping at the top of the file, got {type(data).__name__}")], path)
    return data


def select_section(data: Mapping, path: str, section: str | None) -> tuple[Any, str]:
    """The settings of ``section`` (dotted) or, without one, of a top-level
    ``loss_aggregation`` mapping when there is one, else the whole file; and where they came from."""
    if section:
        for part in section.split("."):
            if not isinstance(data, Mapping) or part not in data:
                keys = list(data) if isinstance(data, Mapping) else []
                raise ConfigError([(section, f"section not found{did_you_mean(part, keys)}")], path)
            data = data[part]
        return data, f"{path} [{section}]"
    if isinstance(data.get(DEFAULT_SECTION), Mapping):
        return data[DEFAULT_SECTION], f"{path} [{DEFAULT_SECTION}]"
    return data, path
