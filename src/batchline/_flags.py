"""Command-line flags built from a settings class's fields, so that a flag, its type, its
choices and its help are written once, on the field (standard library only: every
``--help`` works without the extras).

A field becomes ``--its-name`` (``_`` as ``-``). Its help is ``metadata["help"]``; its choices
are the values of a ``typing.Literal`` annotation (or ``metadata["choices"]``); its type is the
annotation's (``int``, ``float``, ``str``; ``X | None`` is ``X``). A ``bool`` field defaulting to
true becomes ``--no-its-name`` (help ``metadata["off"]``), one defaulting to false
``--its-name``, one that may be unset ``--its-name/--no-its-name``. A flag not given leaves its
destination ``None``: the setting keeps its value from a file, ``--set`` or the class::

    >>> import argparse, dataclasses
    >>> @dataclasses.dataclass
    ... class Options:
    ...     mode: Literal["fast", "exact"] = dataclasses.field(
    ...         default="fast", metadata={"help": "how to run"})
    >>> p = argparse.ArgumentParser()
    >>> _ = add_field_flags(p, Options)
    >>> p.parse_args(["--mode", "exact"]).mode
    'exact'
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

__all__ = [
    "add_deprecated_flag",
    "add_field_flags",
    "built_from",
    "field_choices",
    "field_flag",
    "field_help",
    "flag_name",
]

#: The attribute a built flag's ``argparse.Action`` carries: ``(class name, field name)``.
_BUILT = "batchline_field"


def flag_name(name: str) -> str:
    """The flag of a field: ``max_batch_size`` -> ``--max-batch-size``."""
    return "--" + name.replace("_", "-")


def field_flag(cls: type, name: str) -> str:
    """The flag :func:`add_field_flags` gives a field: a ``bool`` defaulting to true is
    ``--no-its-name``, any other ``--its-name``."""
    if _field(cls, name).default is True:
        return "--no-" + name.replace("_", "-")
    return flag_name(name)


def _field(cls: type, name: str) -> dataclasses.Field[Any]:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name!r}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _hint(cls: type, name: str) -> Any:
    hint = _hints(cls)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def field_choices(cls: type, name: str) -> tuple[Any, ...] | None:
    """The values a field takes, from its ``Literal`` annotation or ``metadata["choices"]``."""
    given = _field(cls, name).metadata.get("choices")
    if given is not None:
        return tuple(given)
    hint = _hint(cls, name)
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


def field_help(cls: type, name: str) -> str:
    """A field's flag help: ``metadata["help"]`` (``metadata["off"]`` for a ``--no-`` flag),
    then ``(knob: NAME)`` so that the file's key is one read away."""
    f = _field(cls, name)
    text = f.metadata.get("off") if f.default is True else None
    text = text or f.metadata.get("help")
    if not text:
        raise ValueError(f"{cls.__name__}.{name} has no metadata help: write it on the field")
    return f"{text} (knob: {name})"


def add_field_flags(
    container: argparse._ActionsContainer,
    cls: type,
    names: Iterable[str] | None = None,
    *,
    more: Mapping[str, str] | None = None,
    defaults: Mapping[str, object] | None = None,
) -> list[argparse.Action]:
    """Add the flags of ``cls``'s fields ``names`` (default: all) to ``container``.

    ``more``: a sentence a command adds after a field's help (its own default, say);
    ``defaults``: a command's default for a flag (else ``None``: not given)."""
    more = more or {}
    defaults = defaults or {}
    added = []
    for name in names if names is not None else [f.name for f in dataclasses.fields(cls)]:
        f = _field(cls, name)
        help_text = field_help(cls, name) + (f"; {more[name]}" if name in more else "")
        hint = _hint(cls, name)
        default = defaults.get(name)
        if hint is bool:
            if f.default is None:
                kwargs: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
            else:
                kwargs = {"action": "store_const", "const": f.default is not True}
        else:
            choices = field_choices(cls, name)
            kind = type(choices[0]) if choices else hint
            metavar = f.metadata.get("metavar") or (
                None if choices else {int: "N", float: "X"}.get(kind, "TEXT")
            )
            kwargs = {"type": kind, "metavar": metavar, "choices": choices}
        action = container.add_argument(
            field_flag(cls, name), dest=name, default=default, help=help_text, **kwargs
        )
        setattr(action, _BUILT, (cls.__name__, name))
        added.append(action)
    return added


def built_from(action: argparse.Action) -> tuple[str, str] | None:
    """``(class name, field name)`` when :func:`add_field_flags` built ``action``."""
    found = getattr(action, _BUILT, None)
    return found if isinstance(found, tuple) else None


class _DeprecatedFlag(argparse.Action):
    """An old spelling kept for one release: stores as the new flag does, and says so on
    stderr in one line."""

    def __init__(self, option_strings: list[str], dest: str, *, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: warning: {option_string} is deprecated and will be removed in the "
            f"next release; use {self.new}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_deprecated_flag(p: argparse.ArgumentParser, old: str, new: str, **kwargs: Any) -> None:
    """``old`` as a deprecated spelling of ``new`` (same destination), hidden from --help: it
    works for one more release and says, in one line, which flag replaces it."""
    p.add_argument(old, action=_DeprecatedFlag, new=new, help=argparse.SUPPRESS, **kwargs)
