"""Reading a config from a JSON, YAML or TOML file, optionally one (dotted) section of a
larger training config.

Bounded work whatever the file holds: only a regular file is read (a FIFO, socket or
device such as ``/dev/zero`` is refused without blocking), at most :data:`MAX_FILE_BYTES`
of it (a huge file is refused before parsing); a UTF-8 byte-order mark is skipped in every
format; the parsed structure may hold at most :data:`MAX_NODES` values nested at most
:data:`MAX_DEPTH` deep (YAML aliases are counted where they are used, so an alias bomb is
refused), and a key given twice in one mapping is an error in every format. YAML merge
keys (``<<: *defaults``) work as YAML defines them (the mapping's own keys win). An integer
literal of more than :data:`~lossagg.config.errors.MAX_INT_DIGITS` digits is not converted
but kept as a :class:`~lossagg.config.errors.HugeInt`, so the config's error names its
setting. Every problem is a :class:`ConfigError` naming the
file: never a Python traceback.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import stat
import sys
from collections.abc import Mapping
from typing import Any

import yaml

from lossagg.config.errors import MAX_INT_DIGITS, ConfigError, HugeInt
from lossagg.messages import did_you_mean, short_repr

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

EXTENSIONS = (".json", ".yaml", ".yml", ".toml")
#: The section used when the caller names none and the file has it.
DEFAULT_SECTION = "loss_aggregation"
MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 64
MAX_NODES = 200_000


_NOT_REGULAR = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")


def _check_regular(st: os.stat_result, path) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError([("", "is a directory; expected a .json, .yaml/.yml or .toml file")], path)
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError([("", f"is {_kind(st.st_mode)}, not a regular file; expected a .json, .yaml/.yml or .toml file")], path)


def _open_bounded(path: str) -> bytes:
    """The file's bytes, refusing what is not a readable regular file of a sane size.

    The path is checked before it is opened, then opened without blocking and checked again
    on the open descriptor (it may have been replaced meanwhile): a FIFO with no writer, a
    socket or a device never stalls the caller, and what is read is what was checked.
    """
    try:
        _check_regular(os.stat(path), path)  # follows links; a loop raises ELOOP
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError([("", "file not found")], path) from None
    except OSError as exc:
        raise ConfigError([("", f"cannot read the file: {exc.strerror or exc}")], path) from None
    try:
        _check_regular(os.fstat(fd), path)
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError([("", f"cannot read the file: {exc.strerror or exc}")], path) from None
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError([("", f"the file is larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB; a loss aggregation config is a few lines")], path)
    return raw


def _no_duplicate_pairs(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _DuplicateKey(ValueError):
    def __init__(self, key):
        super().__init__(f"the key {short_repr(key)} is given twice in one mapping")


def _json_int(text: str):
    return HugeInt(len(text.lstrip("+-"))) if len(text) > MAX_INT_DIGITS else int(text)


class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (merge keys aside) and keeps
    over-long integers as HugeInt."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # merged in by SafeLoader; own keys win
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                hashable = hash(key) is not None
            except TypeError:
                hashable = False
            if hashable and key in seen:
                raise _DuplicateKey(key)
            if hashable:
                seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        text = str(self.construct_scalar(node)).replace("_", "")
        if len(text) > MAX_INT_DIGITS:
            return HugeInt(len(text.lstrip("+-")))
        return super().construct_yaml_int(node)


_StrictYamlLoader.add_constructor("tag:yaml.org,2002:int", _StrictYamlLoader.construct_yaml_int)

# TOML has no integer hook: a `key = <long integer>` line is rewritten to a marker string
# before parsing and turned into a HugeInt after.
_TOML_HUGE = re.compile(rf"^([ \t]*[^\s=#\[][^=\n]*=[ \t]*)([+-]?[0-9][0-9_]{{{MAX_INT_DIGITS},}})([ \t]*(?:#.*)?)$", re.M)
_TOML_MARK = "__lossagg_huge_int__"


def _toml_huge(value: Any) -> Any:
    if isinstance(value, str) and value.startswith(_TOML_MARK):
        return HugeInt(int(value[len(_TOML_MARK) :]))
    if isinstance(value, dict):
        return {k: _toml_huge(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_toml_huge(v) for v in value]
    return value


def _check_shape(data: Any, path: str) -> None:
    """Depth and node count of the parsed structure, counting a shared (aliased) node each time it is used."""
    nodes = 0
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise ConfigError([("", f"the file holds more than {MAX_NODES} values (YAML aliases count where used)")], path)
        if depth > MAX_DEPTH:
            raise ConfigError([("", f"the file nests deeper than {MAX_DEPTH} levels")], path)
        if isinstance(value, Mapping):
            stack.extend((v, depth + 1) for v in value.values())
            stack.extend((k, depth + 1) for k in value.keys())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)


_UTF8_BOM = b"\xef\xbb\xbf"


def _parse(raw: bytes, ext: str) -> Any:
    if ext == ".json":
        return json.loads(raw, object_pairs_hook=_no_duplicate_pairs, parse_int=_json_int)
    if ext == ".toml":
        text = _TOML_HUGE.sub(lambda m: f'{m.group(1)}"{_TOML_MARK}{len(m.group(2).lstrip("+-").replace("_", ""))}"{m.group(3)}', raw.decode("utf-8"))
        return _toml_huge(tomllib.loads(text))
    return yaml.load(raw, Loader=_StrictYamlLoader)  # noqa: S506 - a SafeLoader subclass


def read_file(path: str) -> Mapping:
    """The top-level mapping of a config file; ConfigError naming the file otherwise."""
    ext = os.path.splitext(path)[1].lower()
    raw = _open_bounded(path)
    if raw.startswith(_UTF8_BOM):  # an editor's byte-order mark: accepted alike by every format
        raw = raw[len(_UTF8_BOM) :]
    if ext not in EXTENSIONS:
        raise ConfigError([("", f"unknown file type {short_repr(ext)}; expected {', '.join(EXTENSIONS)}")], path)
    if not raw.strip():
        raise ConfigError([("", "the file is empty; expected a mapping of loss aggregation settings")], path)
    try:
        data = _parse(raw, ext)
    except _DuplicateKey as exc:
        raise ConfigError([("", str(exc))], path) from None
    except RecursionError:
        raise ConfigError([("", f"the file nests deeper than the parser can follow (limit {MAX_DEPTH} levels)")], path) from None
    except (json.JSONDecodeError, yaml.YAMLError, tomllib.TOMLDecodeError, UnicodeDecodeError, ValueError, OverflowError) as exc:
        raise ConfigError([("", f"cannot parse the file: {short_repr(str(exc), 300, quote=False)}")], path) from None
    _check_shape(data, path)
    if not isinstance(data, Mapping):
        raise ConfigError([("", f"expected a mapping at the top of the file, got {type(data).__name__}")], path)
    return data


def select_section(data: Mapping, path: str, section: str | None) -> tuple[Any, str]:
    """The settings of ``section`` (dotted) or, without one, of a top-level
    ``loss_aggregation`` entry when there is one (empty means every default), else the
    whole file; and where they came from."""
    if section:
        for part in section.split("."):
            if not isinstance(data, Mapping) or part not in data:
                keys = [k for k in data if isinstance(k, str)] if isinstance(data, Mapping) else []
                raise ConfigError([(section, f"section not found{did_you_mean(part, keys)}")], path)
            data = data[part]
        return ({} if data is None else data), f"{path} [{section}]"
    if DEFAULT_SECTION in data:
        value = data[DEFAULT_SECTION]
        if value is None:  # `loss_aggregation:` with nothing under it
            return {}, f"{path} [{DEFAULT_SECTION}]"
        if not isinstance(value, Mapping):
            raise ConfigError([(DEFAULT_SECTION, f"expected a mapping of settings, got {type(value).__name__}")], path)
        return value, f"{path} [{DEFAULT_SECTION}]"
    near = [k for k in data if isinstance(k, str) and difflib.get_close_matches(k, [DEFAULT_SECTION], n=1, cutoff=0.8)]
    if near:  # a misspelled section: the file's other keys are the trainer's, not lossagg's settings
        raise ConfigError(
            [(near[0], f"the file has no section '{DEFAULT_SECTION}'; did you mean '{DEFAULT_SECTION}' (its other keys are left to the trainer)?")],
            path,
        )
    return data, path
