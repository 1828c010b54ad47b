"""A settings file (TOML or JSON, flat keys) and ``--set KEY=VALUE`` items, read into a dict,
and a setting name checked against the valid ones: what ``batchline.knobs`` and the server's
settings read their files with (standard library only)."""

from __future__ import annotations

import difflib
import json
import math
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from batchline._errors import InputError

__all__ = ["NOTE_KEYS", "check_setting_names", "parse_set_options", "read_config_file", "to_toml"]


def check_setting_names(names: Iterable[str], known: Iterable[str], *, where: str) -> None:
    """Refuse a setting name that is not one of ``known``, in one line: the closest valid
    name (a typo is the usual cause) and every valid one. ``where`` says where the names came
    from (a file's path, ``--set``)."""
    valid = sorted(set(known))
    unknown = sorted(set(names) - set(valid))
    if not unknown:
        return
    name = unknown[0]
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    more = f" (and {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
    raise InputError(
        f"{where}: unknown setting {name!r}{more}{hint}; valid settings: {', '.join(valid)}"
    )


def parse_set_options(items: Iterable[str]) -> dict[str, object]:
    """``--set KEY=VALUE`` items (``run`` and ``serve``) as settings: each value is read as
    JSON (``8``, ``true``, ``{"a": 1}``), else taken as the text it is."""
    settings: dict[str, object] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise InputError(f"--set {item!r}: expected KEY=VALUE, e.g. --set max_batch_size=8")
        try:
            settings[key.strip()] = json.loads(value)
        except ValueError:
            settings[key.strip()] = value
    return settings


# Free-form keys a config file may carry next to the settings (what ``tune`` measured).
NOTE_KEYS = ("comment", "measured")


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's settings as a dict, notes removed: TOML for ``.toml``, JSON for
    ``.json``, and for any other name whichever parses. Raises ``InputError`` naming the file."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise InputError(f"{p}: cannot read config file: {exc.strerror or exc}") from None
    suffix = p.suffix.lower()
    try:
        text = raw.decode("utf-8")
        if suffix == ".toml":
            data: object = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            try:
                data = json.loads(text)
            except ValueError:
                data = tomllib.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        kind = {".toml": "TOML", ".json": "JSON"}.get(suffix, "TOML or JSON")
        raise InputError(f"{p}: not a valid {kind} config file: {exc}") from None
    if not isinstance(data, dict):
        raise InputError(f"{p}: a config file holds one table of settings")
    for note in NOTE_KEYS:
        data.pop(note, None)
    return data


def to_toml(data: Mapping[str, object]) -> str:
    """Flat settings as TOML: scalars and lists at the top, one ``[table]`` per dict value.
    ``None`` values are left out (TOML has no null)."""
    top = [
        f"{k} = {_toml_value(v)}"
        for k, v in data.items()
        if v is not None and not isinstance(v, dict)
    ]
    lines = top
    for k, v in data.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]"]
            lines += [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items() if vv is not None]
    return "\n".join(lines) + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else json.dumps(str(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    # JSON's string escapes are all valid in a TOML basic string
    return json.dumps(str(value), ensure_ascii=False)
