"""The batcher's queue and how a batch is formed from it.

Batches are formed when a slot is free to run them, never earlier, so a record that
arrives while every slot is busy still joins the next batch.

Priority: a record's ``priority`` is an int, higher first. Without aging that order is
strict. With ``aging_s`` (the batcher's ``priority_aging_s``, 10 s by default) a record of
priority ``p`` ranks as if it had arrived ``p * aging_s`` seconds before it did: it goes
after a record one point higher only while that record arrived less than ``aging_s`` after
it, so a low-priority record that has waited ``aging_s`` longer than a fresh high-priority
one goes first. With the server's classes (``interactive`` 0, ``batch`` -1) and 10 s: a batch
record yields to interactive ones that arrive within 10 s after it, and no longer; nothing
starves. Records of one priority keep their arrival order.

A batch takes no record of a lower priority than the one it starts with, nor one that ranks
after such a record (a batch record aged past an interactive one goes first, so it is not
overtaken; a batch that starts with it may take higher ones). On a CPU a batch's time grows
with what it holds: filling an interactive record's batch with bulk records would make it wait
for all of them. ``mix_priorities=True`` fills a batch from every level in rank order, for a
device where a fuller batch costs little more (a GPU).

A higher-priority record also waits for a slot: for the batches in flight to end. So while
records of a higher priority than a batch's first have arrived within the last
``yield_window_s``, that batch takes at most ``priority_yield`` of the budget (0.5 by
default: on a 2-core CPU serving MiniLM, half the batch roughly halves an interactive record's
wait for a slot and costs bulk a few percent of throughput; 1.0 turns it off).

Two ways to form a batch, both starting from the record that ranks first (the oldest of the
highest priority, after aging):

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
from typing import Generic, Literal, TypeVar

from batchline._clock import TimerHandle
from batchline._priority import aged_rank

T = TypeVar("T")

#: Which records a batch may come from: every one, those of priority >= 0, or the bulk ones
#: (priority < 0), when bulk batches have slots of their own (the batcher's ``bulk_slots``).
Lane = Literal["all", "other", "bulk"]

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
        future: asyncio.Future[object],
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
        self.deadline_timer: TimerHandle | None = None


def _front(dq: deque[Entry[T]]) -> Entry[T] | None:
    """The oldest live entry of ``dq``, dropping dead ones in front of it."""
    while dq:
        e = dq[0]
        if e.state == QUEUED:
            return e
        dq.popleft()
    return None


class _Level(Generic[T]):
    """The records of one priority level."""

    __slots__ = ("buckets", "fifo")

    def __init__(self) -> None:
        self.fifo: deque[Entry[T]] = deque()
        self.buckets: dict[int, deque[Entry[T]]] = {}


class RecordQueue(Generic[T]):
    """Records waiting for a slot; see the module docstring for how batches are formed."""

    def __init__(
        self,
        *,
        padding_aware: bool,
        bucket_width: int = 8,
        padding_slack: int = 16,
        aging_s: float | None = None,
        mix_priorities: bool = False,
        priority_yield: float = 1.0,
        yield_window_s: float = 10.0,
    ) -> None:
        self.padding_aware = padding_aware
        self.aging_s = aging_s
        self.mix_priorities = mix_priorities
        self.priority_yield = priority_yield
        self.yield_window_s = yield_window_s
        self._arrived: dict[int, float] = {}  # priority -> when its last record arrived
        self.bucket_width = bucket_width
        self.padding_slack = padding_slack
        self._levels: dict[int, _Level[T]] = {}
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
        self._arrived[entry.priority] = entry.enqueued_at
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

    def _lane(self, lane: Lane) -> list[int]:
        """The priority levels of ``lane``, highest first."""
        if lane == "all":
            return self._order
        if lane == "bulk":
            return [p for p in self._order if p < 0]
        return [p for p in self._order if p >= 0]

    def _ranked(self, lane: Lane = "all") -> list[int]:
        """The priority levels in the order their oldest records go next (after aging)."""
        aging_s = self.aging_s
        order = self._lane(lane)
        if aging_s is None or len(order) < 2:
            return order
        heads: list[tuple[float, int, int]] = []
        for priority in order:
            head = _front(self._levels[priority].fifo)
            if head is not None:
                heads.append((aged_rank(priority, head.enqueued_at, aging_s), head.seq, priority))
        heads.sort()
        return [priority for _, _, priority in heads]

    def _below(self, batch: list[Entry[T]], e: Entry[T]) -> bool:
        """Whether ``e`` may not join ``batch``: its priority is lower than the batch's first."""
        return not self.mix_priorities and bool(batch) and e.priority < batch[0].priority

    def oldest(self, lane: Lane = "all") -> Entry[T] | None:
        """The entry that the next batch (of ``lane``) will start with."""
        return self._first(self._ranked(lane))

    def _first(self, ranked: list[int]) -> Entry[T] | None:
        """The oldest live entry of the first of ``ranked`` levels that has one."""
        for priority in ranked:
            head = _front(self._levels[priority].fifo)
            if head is not None:
                return head
        return None

    def head_priority(self, now: float) -> tuple[int, float]:
        """The raw and the aged priority (``priority + waited / aging_s``) of the record that
        goes next; ``(0, 0.0)`` when nothing is queued."""
        head = self.oldest()
        if head is None:
            return 0, 0.0
        if self.aging_s is None:
            return head.priority, float(head.priority)
        return head.priority, head.priority + max(0.0, now - head.enqueued_at) / self.aging_s

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

    def yielding(self, now: float) -> bool:
        """Whether the next batch yields to a higher priority (see the module docstring)."""
        if self.priority_yield >= 1.0 or len(self._arrived) < 2:
            return False  # off, or one priority ever seen: nothing to yield to
        head = self.oldest()
        return head is not None and any(
            p > head.priority and now - at <= self.yield_window_s for p, at in self._arrived.items()
        )

    def take_batch(
        self, budget: int, max_size: int, now: float, lane: Lane = "all"
    ) -> tuple[list[Entry[T]], int, bool]:
        """Form the next batch (of ``lane``'s records): ``(entries, batch_cost,
        stopped_by_budget)``.

        The first entry is always taken, even when its cost alone exceeds the budget
        (the batcher rejects such records at submit unless ``oversize="alone"``). ``now``
        (the batcher's clock) decides whether the batch yields to a higher priority (in a
        lane of its own, with slots of its own, it does not).
        """
        if lane == "all" and self.yielding(now):
            budget = max(1, int(budget * self.priority_yield))
        order = self._lane(lane)
        if self.padding_aware:
            batch, cost, by_budget = self._take_padded(budget, max_size, lane)
        else:
            batch, cost, by_budget = self._take_fifo(budget, max_size, order)
        for e in batch:
            e.state = DISPATCHED
        self.size -= len(batch)
        self.total_cost -= sum(e.cost for e in batch)
        return batch, cost, by_budget

    def _take_fifo(
        self, budget: int, max_size: int, order: list[int]
    ) -> tuple[list[Entry[T]], int, bool]:
        if self.aging_s is not None and len(order) > 1:
            return self._take_aged(budget, max_size, self.aging_s, order)
        batch: list[Entry[T]] = []
        cost = 0
        for priority in order:
            fifo = self._levels[priority].fifo
            while fifo:
                e = fifo[0]
                if e.state != QUEUED:
                    fifo.popleft()
                    continue
                if len(batch) >= max_size or self._below(batch, e):
                    return batch, cost, False
                if batch and cost + e.cost > budget:
                    return batch, cost, True
                fifo.popleft()
                e.state = DISPATCHED  # so _front() of other structures skips it
                batch.append(e)
                cost += e.cost
        return batch, cost, False

    def _take_aged(
        self, budget: int, max_size: int, aging_s: float, order: list[int]
    ) -> tuple[list[Entry[T]], int, bool]:
        """``_take_fifo`` over several levels with aging: merge them by rank."""
        batch: list[Entry[T]] = []
        cost = 0
        fifos = [(p, self._levels[p].fifo) for p in order]
        while len(batch) < max_size:
            best: Entry[T] | None = None
            best_fifo: deque[Entry[T]] | None = None
            best_key = 0.0
            for priority, fifo in fifos:
                e = _front(fifo)
                if e is None:
                    continue
                key = aged_rank(priority, e.enqueued_at, aging_s)
                if best is None or key < best_key or (key == best_key and e.seq < best.seq):
                    best, best_fifo, best_key = e, fifo, key
            if best is None or best_fifo is None or self._below(batch, best):
                return batch, cost, False
            if batch and cost + best.cost > budget:
                return batch, cost, True
            best_fifo.popleft()
            best.state = DISPATCHED
            batch.append(best)
            cost += best.cost
        return batch, cost, False

    def _take_padded(
        self, budget: int, max_size: int, lane: Lane
    ) -> tuple[list[Entry[T]], int, bool]:
        ranked = self._ranked(lane)
        head = self._first(ranked)
        if head is None:
            return [], 0, False
        # unless mix_priorities: no level below the head's, nor a record ranked after the
        # first record of such a level (the levels are ranked by their first records)
        cutoff: tuple[float, int] | None = None
        aging_s = self.aging_s or 0.0  # read only where cutoff is set, which needs aging
        if not self.mix_priorities:
            lower = [p for p in ranked if p < head.priority]
            ranked = [p for p in ranked if p >= head.priority]
            first = _front(self._levels[lower[0]].fifo) if lower else None
            if first is not None and self.aging_s is not None:
                cutoff = (aged_rank(first.priority, first.enqueued_at, self.aging_s), first.seq)
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
            for priority in ranked:
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
                    if e is None or (
                        cutoff is not None
                        and (aged_rank(e.priority, e.enqueued_at, aging_s), e.seq) > cutoff
                    ):
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
