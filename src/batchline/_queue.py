"""The batcher's queue and how a batch is formed from it.

Batches are formed when a slot is free to run them, never earlier, so a record that
arrives while every slot is busy still joins the next batch.

Two ways to form a batch, both starting from the oldest record of the highest priority
(so nothing starves):

* ``sum`` cost: take records in arrival order while the sum of their costs stays within the
  budget and the count within ``max_batch_size``.
* ``padded`` cost (``padding_aware=True``): a batch costs ``len(batch) * max(cost)``, the
  padded tokens a model really computes. Records are also kept in buckets of similar cost;
  after the oldest record, the batch takes whichever bucket's oldest record adds the least
  padding, as long as that padding stays within ``padding_slack`` (about what the fixed
  overhead of one more model call costs, in tokens) and the budget holds.

Withdrawn records (cancelled, expired) are marked and skipped when reached.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

QUEUED = 0
DISPATCHED = 1
WITHDRAWN = 2


class Entry(Generic[T]):
    """One submitted record and everything the batcher knows about it."""

    __slots__ = (
        "cost",
        "deadline_timer",
        "dispatched_at",
        "enqueued_at",
        "future",
        "priority",
        "record",
        "seq",
        "state",
    )

    def __init__(
        self,
        record: T,
        cost: int,
        future: asyncio.Future[Any],
        seq: int,
        priority: int,
        enqueued_at: float,
    ) -> None:
        self.record = record
        self.cost = cost
        self.future = future
        self.seq = seq
        self.priority = priority
        self.enqueued_at = enqueued_at
        self.dispatched_at = 0.0
        self.state = QUEUED
        self.deadline_timer: Any = None


def _front(dq: deque[Entry[Any]]) -> Entry[Any] | None:
    """The oldest live entry of ``dq``, dropping dead ones in front of it."""
    while dq:
        e = dq[0]
        if e.state == QUEUED:
            return e
        dq.popleft()
    return None


class _Level:
    """The records of one priority level."""

    __slots__ = ("buckets", "fifo")

    def __init__(self) -> None:
        self.fifo: deque[Entry[Any]] = deque()
        self.buckets: dict[int, deque[Entry[Any]]] = {}


class RecordQueue(Generic[T]):
    """Records waiting for a slot; see the module docstring for how batches are formed."""

    def __init__(
        self,
        *,
        padding_aware: bool,
        bucket_width: int = 8,
        padding_slack: int = 16,
    ) -> None:
        self.padding_aware = padding_aware
        self.bucket_width = bucket_width
        self.padding_slack = padding_slack
        self._levels: dict[int, _Level] = {}
        self._order: list[int] = []  # priorities, highest first
        self.size = 0
        self.total_cost = 0

    def push(self, entry: Entry[T]) -> None:
        level = self._levels.get(entry.priority)
        if level is None:
            level = self._levels[entry.priority] = _Level()
            self._order.append(entry.priority)
            self._order.sort(reverse=True)
        level.fifo.append(entry)
        if self.padding_aware:
            key = entry.cost // self.bucket_width
            bucket = level.buckets.get(key)
            if bucket is None:
                bucket = level.buckets[key] = deque()
            bucket.append(entry)
        self.size += 1
        self.total_cost += entry.cost

    def withdraw(self, entry: Entry[T]) -> bool:
        """Take a queued entry out (it stays in the deques, marked). False if not queued."""
        if entry.state != QUEUED:
            return False
        entry.state = WITHDRAWN
        self.size -= 1
        self.total_cost -= entry.cost
        return True

    def oldest(self) -> Entry[T] | None:
        """The entry that the next batch will start with."""
        for priority in self._order:
            head = _front(self._levels[priority].fifo)
            if head is not None:
                return head
        return None

    def drain(self) -> list[Entry[T]]:
        """Withdraw and return every queued entry, oldest first."""
        out: list[Entry[T]] = []
        for priority in self._order:
            for e in self._levels[priority].fifo:
                if e.state == QUEUED:
                    out.append(e)
        for e in out:
            self.withdraw(e)
        self._levels.clear()
        self._order.clear()
        return out

    def take_batch(self, budget: int, max_size: int) -> tuple[list[Entry[T]], int, bool]:
        """Form the next batch: ``(entries, batch_cost, stopped_by_budget)``.

        The first entry is always taken, even when its cost alone exceeds the budget
        (the batcher rejects such records at submit unless ``oversize="alone"``).
        """
        if self.padding_aware:
            batch, cost, by_budget = self._take_padded(budget, max_size)
        else:
            batch, cost, by_budget = self._take_fifo(budget, max_size)
        for e in batch:
            e.state = DISPATCHED
        self.size -= len(batch)
        self.total_cost -= sum(e.cost for e in batch)
        return batch, cost, by_budget

    def _take_fifo(self, budget: int, max_size: int) -> tuple[list[Entry[T]], int, bool]:
        batch: list[Entry[T]] = []
        cost = 0
        for priority in self._order:
            fifo = self._levels[priority].fifo
            while fifo:
                e = fifo[0]
                if e.state != QUEUED:
                    fifo.popleft()
                    continue
                if len(batch) >= max_size:
                    return batch, cost, False
                if batch and cost + e.cost > budget:
                    return batch, cost, True
                fifo.popleft()
                e.state = DISPATCHED  # so _front() of other structures skips it
                batch.append(e)
                cost += e.cost
        return batch, cost, False

    def _take_padded(self, budget: int, max_size: int) -> tuple[list[Entry[T]], int, bool]:
        head = self.oldest()
        if head is None:
            return [], 0, False
        head.state = DISPATCHED
        batch: list[Entry[T]] = [head]
        longest = head.cost
        by_budget = False
        while len(batch) < max_size:
            best: Entry[T] | None = None
            best_waste = 0
            blocked = False
            n = len(batch)
            # only lengths within padding_slack of the longest can qualify: a shorter record
            # wastes (longest - cost), a longer one (cost - longest) on each of the n others
            lo_key = max(0, longest - self.padding_slack) // self.bucket_width
            hi_key = (longest + self.padding_slack // n) // self.bucket_width
            for priority in self._order:
                buckets = self._levels[priority].buckets
                if hi_key - lo_key + 1 < len(buckets):
                    keys: Iterable[int] = range(lo_key, hi_key + 1)
                else:
                    keys = list(buckets)
                for key in keys:
                    bucket = buckets.get(key)
                    if bucket is None:
                        continue
                    e = _front(bucket)
                    if e is None:
                        continue
                    new_longest = longest if e.cost <= longest else e.cost
                    if (n + 1) * new_longest > budget:
                        blocked = True
                        continue
                    waste = (new_longest - e.cost) + n * (new_longest - longest)
                    if waste > self.padding_slack:
                        continue
                    if (
                        best is None
                        or waste < best_waste
                        or (waste == best_waste and e.seq < best.seq)
                    ):
                        best, best_waste = e, waste
                if best is not None:
                    break  # a higher priority level had a fit: do not mix in lower ones
            if best is None:
                by_budget = blocked
                break
            best.state = DISPATCHED
            batch.append(best)
            if best.cost > longest:
                longest = best.cost
        return batch, len(batch) * longest, by_budget
