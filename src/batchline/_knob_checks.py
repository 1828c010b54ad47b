"""The check of one knob's value (``Knobs.__post_init__``): its choices (the field's
``Literal``), a rule of its own, or a number >= 1. One ``InputError`` each, naming the knob and
what it wants. The knobs a batcher reads under the same names are checked by
:class:`~batchline.BatchPolicy` (``check_policy_knobs``), where their rules live."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeGuard

from batchline._errors import InputError
from batchline._policy import BatchPolicy

__all__ = ["check_knob", "check_policy_knobs"]

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(least: int) -> Callable[[object], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= least


#: Knobs fields that are not plain numbers: the check and what it wants; the rest are numbers
#: >= 1 (``batch_timeout_s`` >= 0).
_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "batching": (lambda v: isinstance(v, bool), "true or false"),
    "engine_process": (lambda v: isinstance(v, bool), "true or false"),
    "bulk_batch_tokens": (lambda v: v is None or _integer(1)(v), "an integer >= 1 or unset"),
    "device": (lambda v: isinstance(v, str) and bool(_DEVICE.match(v)), "cpu, cuda or cuda:N"),
    "eager": (lambda v: v is None or isinstance(v, bool), "true, false or unset"),
    "gpu_memory_fraction": (lambda v: v is None or (_number(v) and 0 < v <= 1), "in (0, 1]"),
    "kv_cache_gib": (lambda v: v is None or (_number(v) and v > 0), "a number > 0"),
    "max_context_tokens": (lambda v: v is None or _integer(2)(v), "an integer >= 2"),
    "kv_token_budget": (_integer(2), "an integer >= 2"),
    "max_running_sequences": (_integer(1), "an integer >= 1"),
    "start_running_sequences": (_integer(1), "an integer >= 1"),
    "generation_threads": (lambda v: v is None or _integer(1)(v), "an integer >= 1 or unset"),
    "quantize": (lambda v: v is None or v == "int8", "int8 or unset"),
}


def check_knob(name: str, value: object, choices: tuple[Any, ...] | None) -> None:
    """Refuse a bad ``value`` of the knob ``name`` in one line."""
    if name in _RULES:
        ok, want = _RULES[name]
        if not ok(value):
            raise InputError(f"{name} must be {want}, got {value!r}")
    elif choices is not None:
        if value not in choices:
            names = [str(c) for c in choices]
            want = " or ".join(names) if len(names) == 2 else "one of " + ", ".join(names)
            raise InputError(f"{name} must be {want}, got {value!r}")
    elif not (name == "solo_intra_op_threads" and value is None):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InputError(f"{name} must be a number, got {value!r}")
        if value < 1:
            raise InputError(f"{name} must be >= 1, got {value!r}")


def check_policy_knobs(values: dict[str, Any]) -> None:
    """Refuse a bad batcher knob (``values``: the knobs named as ``BatchPolicy`` fields) with
    the policy's own error, in one line. ``min_batch_size`` above ``max_batch_size`` passes:
    ``Knobs.policy`` caps it."""
    low, high = values.get("min_batch_size"), values.get("max_batch_size")
    if _number(low) and _number(high) and low > high:
        values = {**values, "min_batch_size": high}
    try:
        BatchPolicy(**values)
    except ValueError as exc:
        raise InputError(str(exc)) from None
