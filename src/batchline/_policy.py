"""``BatchPolicy``: every setting of a batcher, in one frozen object passed whole.

A batcher takes ``policy=BatchPolicy(...)`` as httpx's client takes ``Limits``; the keywords
Flyte's ``DynamicBatcher``/``TokenBatcher`` take (``max_batch_size=64``...) still work and build
one. Each field's default and its meaning are written here once: the batchers' signatures, the
model layer (``models/batching.py``) and the CLI's flag builder (``batchline._flags``) read them
from this class. A bad value is refused here, at construction, with one ``ValueError`` naming
the field::

    >>> policy = BatchPolicy(max_batch_size=64, max_concurrent_batches=2)
    >>> policy.replace(max_batch_size=8).max_batch_size
    8
    >>> BatchPolicy(max_batch_size=0)
    Traceback (most recent call last):
    ...
    ValueError: max_batch_size must be >= 1, got 0

Not in the policy: what is an object rather than a setting (the batch function, a cost
estimator, the shared ``Device`` and this batcher's ``weight`` on it, the clock, the name).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Final, Literal

__all__ = ["UNSET", "BatchPolicy", "Unset", "admission_capacity"]


class Unset(enum.Enum):
    """The default of a batcher keyword that was not given: the policy's value is used."""

    UNSET = "unset"

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = Unset.UNSET


def admission_capacity(*, max_queue_size: int, prefetch_batches: int, max_batch_size: int) -> int:
    """How many records may wait in a batcher's queue at once (the one admission rule).

    ``max_queue_size`` plus what Flyte's batcher holds outside its queue: the batch its
    aggregator is assembling and ``prefetch_batches`` pre-built ones, each up to
    ``max_batch_size`` records. So code written for Flyte meets backpressure at the same
    point. Records being processed are not queued and do not count.

    >>> admission_capacity(max_queue_size=1, prefetch_batches=1, max_batch_size=1)
    3
    """
    return max_queue_size + (prefetch_batches + 1) * max_batch_size


def _doc(text: str, default: Any) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True, kw_only=True)
class BatchPolicy:
    """How a batcher forms and runs batches (each field's ``help`` is its documentation).

    ``padding_aware=None`` leaves it to the batcher: off for a ``DynamicBatcher``, on for a
    ``TokenBatcher``, whose budget is in padded tokens.
    """

    target_batch_cost: int = _doc(
        "the budget: a batch's cost never exceeds it (see padding_aware)", 32_000
    )
    max_batch_size: int = _doc("records per batch, at most", 256)
    min_batch_size: int = _doc(
        "while a slot is free, hold records until this many are queued (see batch_timeout_s; "
        "1: nothing is ever held)",
        1,
    )
    batch_timeout_s: float = _doc(
        "hold records for min_batch_size no longer than this after the oldest arrived", 0.05
    )
    max_queue_size: int = _doc(
        "admission capacity, as in Flyte: at most max_queue_size + (prefetch_batches + 1) * "
        "max_batch_size records wait at once (admission_capacity); beyond it submit waits for "
        "room and submit_nowait raises QueueFullError",
        5_000,
    )
    prefetch_batches: int = _doc(
        "Flyte's pre-built batches, held here in the one queue as admission room", 2
    )
    default_cost: int = _doc("the cost of a record when nothing else says", 1)
    max_concurrent_batches: int = _doc(
        "processing slots: batches in flight at once, e.g. one per model session", 1
    )
    oversize: Literal["alone", "reject"] = _doc(
        "a record costing more than target_batch_cost goes in a batch of its own (alone) or "
        "is refused with RecordTooLargeError (reject)",
        "alone",
    )
    on_error: Literal["bisect", "fail_batch"] = _doc(
        "when process_fn raises, bisect splits the batch and retries the halves so only "
        "failing records get an error (calling process_fn again on records processed once); "
        "fail_batch fails them all",
        "bisect",
    )
    process_timeout_s: float | None = _doc(
        "a batch running longer fails its records with BatchTimeoutError and frees its slot "
        "(a sync process_fn's thread runs on, its result discarded); None: no limit",
        None,
    )
    padding_aware: bool | None = _doc(
        "cost a batch as len(batch) * max(record cost), padded tokens, and group records of "
        "similar cost (None: the batcher's own default)",
        None,
    )
    bucket_width: int = _doc("padding_aware: the width of a length group", 8)
    padding_slack: int = _doc(
        "padding_aware: a batch takes a record that adds at most this many padded tokens", 16
    )
    priority_aging_s: float | None = _doc(
        "seconds of waiting worth one point of priority (None: strict priority, which can "
        "starve low priorities)",
        10.0,
    )
    mix_priorities: bool = _doc(
        "let a batch take records of lower priority than its first; off: on a CPU a batch's "
        "time grows with its size, so an interactive record would wait for the bulk records "
        "beside it; on for a device where a fuller batch costs little more",
        False,
    )
    priority_yield: float = _doc(
        "while records of a higher priority than a batch's first have arrived within the last "
        "priority_aging_s (10 s if None), the batch takes at most this fraction of "
        "target_batch_cost, so its slot frees sooner for them (in (0, 1]; 1.0: off)",
        0.5,
    )
    bulk_slots: int | None = _doc(
        "slots of their own for bulk batches (first record's priority below 0; None: they "
        "share the others')",
        None,
    )
    bulk_thread_nice: int = _doc(
        "bulk batches' worker threads run at nice +this (0-19; 0: the same threads)", 0
    )
    bulk_batch_cost: int | None = _doc("bulk batches' own budget (None: target_batch_cost)", None)

    def __post_init__(self) -> None:
        for name in (
            "target_batch_cost",
            "max_batch_size",
            "min_batch_size",
            "max_queue_size",
            "max_concurrent_batches",
            "bucket_width",
        ):
            _at_least(name, getattr(self, name), 1)
        for name in ("batch_timeout_s", "prefetch_batches", "padding_slack", "default_cost"):
            _at_least(name, getattr(self, name), 0)
        if self.min_batch_size > self.max_batch_size:
            raise ValueError(
                f"min_batch_size ({self.min_batch_size}) must be <= max_batch_size "
                f"({self.max_batch_size})"
            )
        if self.process_timeout_s is not None:
            _at_least("process_timeout_s", self.process_timeout_s, 0)
        aging = self.priority_aging_s
        if aging is not None and not (_is_number(aging) and aging > 0):
            raise ValueError(f"priority_aging_s must be > 0 or None, got {aging!r}")
        if not (_is_number(self.priority_yield) and 0 < self.priority_yield <= 1):
            raise ValueError(f"priority_yield must be in (0, 1], got {self.priority_yield!r}")
        if self.bulk_slots is not None and not _is_int(self.bulk_slots, 1):
            raise ValueError(f"bulk_slots must be an integer >= 1 or None, got {self.bulk_slots!r}")
        if self.bulk_batch_cost is not None:
            _at_least("bulk_batch_cost", self.bulk_batch_cost, 1)
        nice = self.bulk_thread_nice
        if not _is_int(nice, 0) or nice not in range(20):
            raise ValueError(f"bulk_thread_nice must be an integer in [0, 19], got {nice!r}")
        if self.oversize not in ("alone", "reject"):
            raise ValueError(f"oversize must be 'alone' or 'reject', got {self.oversize!r}")
        if self.on_error not in ("bisect", "fail_batch"):
            raise ValueError(f"on_error must be 'bisect' or 'fail_batch', got {self.on_error!r}")
        for name in ("padding_aware", "mix_priorities"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "padding_aware" and value is None):
                raise ValueError(f"{name} must be true or false, got {value!r}")

    @property
    def queue_capacity(self) -> int:
        """Records that may be queued at once (see :func:`admission_capacity`)."""
        return admission_capacity(
            max_queue_size=self.max_queue_size,
            prefetch_batches=self.prefetch_batches,
            max_batch_size=self.max_batch_size,
        )

    def replace(self, **changes: Any) -> BatchPolicy:
        """This policy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def given(self, **keywords: Any) -> BatchPolicy:
        """This policy with the ``keywords`` that were given (not :data:`UNSET`): how a
        batcher merges its Flyte keywords into ``policy=``; a keyword wins over the policy."""
        changes = {k: v for k, v in keywords.items() if v is not UNSET}
        return self.replace(**changes) if changes else self


#: The policy's field names, in order (what a batcher's keywords may set).
POLICY_FIELDS: Final = tuple(f.name for f in dataclasses.fields(BatchPolicy))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _at_least(name: str, value: object, minimum: float) -> None:
    if not _is_number(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < minimum:  # type: ignore[operator]
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
