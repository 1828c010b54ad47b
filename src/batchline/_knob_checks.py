"""The check of one knob's value (each options class's ``__post_init__``): its choices (the
field's ``Literal``), a rule of its own, or a number >= 1. One ``InputError`` each, naming the
knob and what it wants. Each options class keeps its fields' rules beside them (``Rules``) and
checks only the fields it declares (:func:`check_own_fields`). The knobs a batcher reads under
the same names are checked by :class:`~batchline.BatchPolicy` (``check_policy_knobs``), where
their rules live."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

from batchline._errors import InputError
from batchline._flags import field_choices
from batchline._policy import BatchPolicy

__all__ = [
    "DEVICE_RULE",
    "Rules",
    "check_knob",
    "check_own_fields",
    "check_policy_knobs",
    "integer",
    "is_number",
    "own_fields",
]

#: A knob's rule: the check, and what it wants (said in the error).
Rules = Mapping[str, tuple[Callable[[object], bool], str]]

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
DEVICE_RULE = (lambda v: isinstance(v, str) and bool(_DEVICE.match(v)), "cpu, cuda or cuda:N")


def is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def integer(least: int) -> Callable[[object], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= least


def check_knob(
    name: str,
    value: object,
    choices: tuple[Any, ...] | None,
    rules: Rules | None = None,
    *,
    unset: bool = False,
) -> None:
    """Refuse a bad ``value`` of the knob ``name`` in one line: its rule in ``rules``, else its
    ``choices``, else a number >= 1 (or ``None`` where ``unset``: the field may be unset)."""
    if rules and name in rules:
        ok, want = rules[name]
        if not ok(value):
            raise InputError(f"{name} must be {want}, got {value!r}")
    elif choices is not None:
        if value not in choices:
            names = [str(c) for c in choices]
            want = " or ".join(names) if len(names) == 2 else "one of " + ", ".join(names)
            raise InputError(f"{name} must be {want}, got {value!r}")
    elif not (unset and value is None):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InputError(f"{name} must be a number, got {value!r}")
        if value < 1:
            raise InputError(f"{name} must be >= 1, got {value!r}")


@functools.cache
def own_fields(cls: type) -> tuple[str, ...]:
    """The fields ``cls`` declares itself, not those its dataclass bases give it."""
    inherited = {
        name for base in cls.__bases__ for name in getattr(base, "__dataclass_fields__", {})
    }
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in inherited)


def check_own_fields(obj: object, cls: type, rules: Rules, *, skip: tuple[str, ...] = ()) -> None:
    """Check each field ``cls`` declares (but ``skip``) on ``obj`` (:func:`check_knob`); a
    field whose default is ``None`` may be unset."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in own_fields(cls):
        if name not in skip:
            unset = fields[name].default is None
            check_knob(name, getattr(obj, name), field_choices(cls, name), rules, unset=unset)


def check_policy_knobs(values: dict[str, Any]) -> None:
    """Refuse a bad batcher knob (``values``: the knobs named as ``BatchPolicy`` fields) with
    the policy's own error, in one line. ``min_batch_size`` above ``max_batch_size`` passes:
    ``Knobs.policy`` caps it."""
    low, high = values.get("min_batch_size"), values.get("max_batch_size")
    if is_number(low) and is_number(high) and low > high:
        values = {**values, "min_batch_size": high}
    try:
        BatchPolicy(**values)
    except ValueError as exc:
        raise InputError(str(exc)) from None
