"""``BatchStats``: a frozen snapshot of what a batcher has done.

How ``utilization`` is computed: each processing slot is either running a batch or not.
``busy_time_s`` is the sum, over batches, of the time from the call of ``process_fn`` to
its return (slot-seconds); ``idle_time_s`` is the slot-seconds the batcher was running
minus ``busy_time_s``; ``utilization = busy_time_s / (busy_time_s + idle_time_s)``, that is
the mean fraction of slots busy while the batcher ran. With one slot this is Flyte's
definition; with ``max_concurrent_batches=2`` a value of 1.0 means both slots were always busy.

Latency percentiles cover the most recent ``window`` records (10,000 by default).

``device_wait_s`` (batchers on a shared ``Device`` only): seconds this batcher had a batch
ready (and a free slot of its own) but waited for one of the device's slots.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

__all__ = ["DISPATCH_REASONS", "BatchStats", "percentile"]

#: Why a batch left the queue.
#: ``full``: it reached max_batch_size; ``budget``: the next record would exceed target_batch_cost;
#: ``slot_free``: a slot was free and the queue held no more that fits; ``timeout``: min_batch_size
#: was not reached within batch_timeout_s; ``stop``: the batcher was draining on stop().
DISPATCH_REASONS = ("full", "budget", "slot_free", "timeout", "stop")


def percentile(values: list[float] | deque[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; ``nan`` when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class BatchStats:
    """What a batcher has done so far. A snapshot: it never changes after it is taken.

    The first eight fields and ``utilization`` carry the names and meaning of Flyte's
    ``BatchStats``; ``total_completed`` counts records resolved with a result.
    """

    total_submitted: int = 0
    total_completed: int = 0
    total_batches: int = 0
    total_batch_cost: int = 0
    avg_batch_size: float = 0.0
    avg_batch_cost: float = 0.0
    busy_time_s: float = 0.0
    idle_time_s: float = 0.0
    total_failed: int = 0
    total_cancelled: int = 0
    total_expired: int = 0
    queue_depth: int = 0
    in_flight_batches: int = 0
    queue_wait_p50_s: float = math.nan
    queue_wait_p99_s: float = math.nan
    latency_p50_s: float = math.nan
    latency_p99_s: float = math.nan
    avg_budget_fill: float = 0.0
    padding_waste: float = 0.0
    dispatch_reasons: dict[str, int] = field(default_factory=dict)
    device_wait_s: float = 0.0

    @property
    def utilization(self) -> float:
        """Mean fraction of processing slots busy while the batcher ran (0.0-1.0)."""
        total = self.busy_time_s + self.idle_time_s
        return self.busy_time_s / total if total > 0 else 0.0

    @property
    def total_resolved(self) -> int:
        """Records resolved in any way: result, error, cancelled or expired."""
        return self.total_completed + self.total_failed + self.total_cancelled + self.total_expired


class StatsRecorder:
    """The batcher's mutable counters; ``snapshot()`` turns them into ``BatchStats``."""

    def __init__(self, window: int = 10_000) -> None:
        self.submitted = 0
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        self.expired = 0
        self.batches = 0
        self.batched_records = 0
        self.batch_cost = 0
        self.busy_s = 0.0
        self.running_s = 0.0  # slot-seconds over finished running periods
        self.budget_fill = 0.0
        self.padded_tokens = 0
        self.real_tokens = 0
        self.reasons: Counter[str] = Counter()
        self.queue_waits: deque[float] = deque(maxlen=window)
        self.latencies: deque[float] = deque(maxlen=window)

    def snapshot(
        self,
        *,
        slot_seconds: float,
        queue_depth: int,
        in_flight: int,
        device_wait_s: float = 0.0,
    ) -> BatchStats:
        batches = self.batches
        # busy time of a batch still running is not yet counted; clamp so idle is never negative
        idle = max(0.0, slot_seconds - self.busy_s)
        return BatchStats(
            total_submitted=self.submitted,
            total_completed=self.completed,
            total_batches=batches,
            total_batch_cost=self.batch_cost,
            avg_batch_size=self.batched_records / batches if batches else 0.0,
            avg_batch_cost=self.batch_cost / batches if batches else 0.0,
            busy_time_s=self.busy_s,
            idle_time_s=idle,
            total_failed=self.failed,
            total_cancelled=self.cancelled,
            total_expired=self.expired,
            queue_depth=queue_depth,
            in_flight_batches=in_flight,
            queue_wait_p50_s=percentile(self.queue_waits, 50),
            queue_wait_p99_s=percentile(self.queue_waits, 99),
            latency_p50_s=percentile(self.latencies, 50),
            latency_p99_s=percentile(self.latencies, 99),
            avg_budget_fill=self.budget_fill / batches if batches else 0.0,
            padding_waste=(
                1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0
            ),
            dispatch_reasons={r: self.reasons.get(r, 0) for r in DISPATCH_REASONS},
            device_wait_s=device_wait_s,
        )
