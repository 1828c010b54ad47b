"""Request priority classes and how a request's priority maps to the batcher's.

A request names its priority as a class or an integer, as vLLM's API does: **a lower number
goes sooner**. ``interactive`` is 0 and ``batch`` is 1; any integer from -100 to 100 is
accepted. The batcher's ``priority`` runs the other way (higher first, as its ``submit`` has
always taken it), so a request priority ``n`` becomes batcher priority ``-n``: interactive 0,
batch -1.

Aging keeps the order starvation-free: with the batcher's ``priority_aging_s`` of 10 s, a
request ranks as if it had arrived ``10 s x (its number - the other's)`` later than it did, so
a ``batch`` request goes after ``interactive`` ones that arrive within 10 s after it, and
before any that arrive later. :func:`aged_rank` is that rule, the one copy: the core queue
(``batchline._queue``; across models, ``batchline._device`` through it), the generation
scheduler (``models/generation/continuous.py``) and the vLLM adapter all rank by it.
"""

from __future__ import annotations

__all__ = [
    "BATCH",
    "INTERACTIVE",
    "PRIORITY_CLASSES",
    "aged_rank",
    "batcher_priority",
    "priority_label",
]

INTERACTIVE = 0
BATCH = 1
PRIORITY_CLASSES = {"interactive": INTERACTIVE, "batch": BATCH}
_LIMIT = 100


def batcher_priority(value: object) -> int:
    """The batcher priority (higher first) of a request priority (``interactive``, ``batch``
    or an integer, lower first). Raises ``ValueError`` with the accepted forms."""
    number: int | None = None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in PRIORITY_CLASSES:
            number = PRIORITY_CLASSES[text]
        else:
            try:
                number = int(text)
            except ValueError:
                number = None
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    if number is None or not -_LIMIT <= number <= _LIMIT:
        raise ValueError(
            f"priority must be 'interactive', 'batch' or an integer from -{_LIMIT} to {_LIMIT} "
            f"(lower goes sooner), got {value!r}"
        )
    return -number


def aged_rank(priority: int, enqueued_at: float, aging_s: float) -> float:
    """When a record of batcher ``priority`` (higher first) queued at ``enqueued_at`` ranks as
    if it had arrived: ``priority * aging_s`` seconds earlier. The lowest rank goes next; equal
    ranks go in arrival order. A record's rank never changes while it waits, so a queue ordered
    by it once stays ordered, and a fresh record can pass a waiting one only by ranking lower:
    nothing starves."""
    return enqueued_at - priority * aging_s


def priority_label(batcher_prio: int) -> str:
    """A metrics label for a batcher priority: its class name, or the request's integer."""
    number = -batcher_prio
    for name, n in PRIORITY_CLASSES.items():
        if n == number:
            return name
    return str(number)
