"""A batcher's processing slots, and the worker threads its sync batches run on.

There are ``max_concurrent_batches`` slots. With ``bulk_slots``, bulk batches (those that start
with a record of priority below 0) have that many more of their own, a lane beside the others':
each lane takes a batch while it has a free slot, whatever the other holds, so bulk work never
holds a slot that a live record needs, and live records never starve bulk of its slots. A
batch holds its slot (and on a ``Device``, the device's grant) until it is freed, exactly once.

A sync ``process_fn`` runs on worker threads; with ``bulk_thread_nice``, bulk batches run on
threads of their own whose nice value is raised by that much (Linux), so the OS gives the cores
to every other thread first.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, TypeVar

from batchline._queue import Lane
from batchline._threads import lower_thread_priority

if TYPE_CHECKING:
    from batchline._device import _Grant
    from batchline._queue import RecordQueue

__all__ = ["Slot", "Slots"]

T = TypeVar("T")

#: Workers beyond the slots: a timed-out sync batch keeps its thread until it returns.
_SPARE_WORKERS = 2


class Slot:
    """A processing slot held by one batch until it is freed, exactly once; on a ``Device``
    it also holds the device's grant."""

    __slots__ = ("bulk", "grant", "held")

    def __init__(self, grant: _Grant | None, bulk: bool) -> None:
        self.held = True
        self.grant = grant
        self.bulk = bulk


class Slots:
    """The slots of one batcher (``regular``: ``max_concurrent_batches``; ``bulk``:
    ``bulk_slots``) and its worker threads."""

    def __init__(
        self, regular: int, bulk: int | None, bulk_thread_nice: int, bulk_budget: bool = False
    ) -> None:
        self.regular = regular
        self.bulk = bulk
        self.bulk_thread_nice = bulk_thread_nice
        self.bulk_budget = bulk_budget  # bulk batches have a budget of their own
        self.busy = 0  # slots held, bulk ones included
        self.bulk_busy = 0  # slots held by bulk batches
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._bulk_pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def bulk_aware(self) -> bool:
        """Whether a bulk batch differs from another here (threads, budget or slots)."""
        return self.bulk is not None or self.bulk_thread_nice > 0 or self.bulk_budget

    @property
    def total(self) -> int:
        return self.regular + (self.bulk or 0)

    def free_lane(self, queue: RecordQueue[T]) -> Lane | None:
        """Where the next batch comes from (``None``: no slot is free for a queued record)."""
        if self.bulk is None:
            return "all" if self.busy < self.regular else None
        if self.busy - self.bulk_busy < self.regular and queue.oldest("other") is not None:
            return "other"
        if self.bulk_busy < self.bulk and queue.oldest("bulk") is not None:
            return "bulk"
        return None

    def hold(self, grant: _Grant | None, bulk: bool) -> Slot:
        self.busy += 1
        self.bulk_busy += bulk
        return Slot(grant, bulk)

    def free(self, slot: Slot) -> bool:
        """Free ``slot``; False if it was freed before."""
        if not slot.held:
            return False
        slot.held = False
        self.busy -= 1
        self.bulk_busy -= slot.bulk
        return True

    # -- worker threads ---------------------------------------------------------------------

    def start(self, name: str, *, threads: bool) -> None:
        """Every slot free, and with ``threads`` (a sync ``process_fn``) the worker threads
        started."""
        self.busy = self.bulk_busy = 0
        if not threads:
            return
        own_bulk = self.bulk_thread_nice > 0
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.regular + (0 if own_bulk else self.bulk or 0) + _SPARE_WORKERS,
            thread_name_prefix=f"batchline-{name}",
        )
        if own_bulk:
            self._bulk_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=(self.bulk or self.regular) + _SPARE_WORKERS,
                thread_name_prefix=f"batchline-{name}-bulk",
                initializer=lower_thread_priority,
                initargs=(self.bulk_thread_nice,),
            )

    def pool(self, bulk: bool) -> concurrent.futures.ThreadPoolExecutor | None:
        """The worker threads of a sync batch (``None``: none started)."""
        if bulk and self._bulk_pool is not None:
            return self._bulk_pool
        return self._pool

    def stop(self) -> None:
        """Stop the worker threads (a batch still running keeps its thread)."""
        for pool in (self._pool, self._bulk_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._bulk_pool = None
