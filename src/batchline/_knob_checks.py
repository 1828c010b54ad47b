"""The check of one knob's value (``Knobs.__post_init__``): its choices (the field's
``Literal``), a rule of its own, or a number >= 1 (``batch_timeout_s`` >= 0). One
``InputError`` each, naming the knob and what it wants."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeGuard

from batchline._errors import InputError

__all__ = ["check_knob"]

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
    "mix_priorities": (lambda v: isinstance(v, bool), "true or false"),
    "priority_yield": (lambda v: _number(v) and 0 < v <= 1, "in (0, 1]"),
    "bulk_slots": (lambda v: v is None or _integer(1)(v), "an integer >= 1 or unset"),
    "bulk_batch_tokens": (lambda v: v is None or _integer(1)(v), "an integer >= 1 or unset"),
    "bulk_thread_nice": (lambda v: _integer(0)(v) and v in range(20), "an integer in [0, 19]"),
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
        least = 0 if name == "batch_timeout_s" else 1
        if value < least:
            raise InputError(f"{name} must be >= {least}, got {value!r}")
