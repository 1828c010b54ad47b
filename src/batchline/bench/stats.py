"""The numbers behind ``batchline bench``: percentiles, throughput, Poisson schedules, clocks.

Standard library only, and no real time anywhere a test needs to control it: the load generator
reads time from a :class:`batchline.Clock`, so tests drive it with :class:`batchline.ManualClock`.

Open-loop latency is measured from a request's *intended* send time, the instant its arrival was
scheduled, not from when the generator got round to sending it. A system that stalls for a
second then delays every request scheduled during that second, and their latencies say so; a
generator that waits for answers before sending more (coordinated omission) would report only
the few requests that happened to be in flight.

    >>> schedule = poisson_schedule(rate_per_s=200, duration_s=10, seed=1)
    >>> len(schedule)              # about 2,000 arrival times in [0, 10)
    >>> summarize([0.010, 0.012, 0.250]).p99_s
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from batchline._stats import percentile

__all__ = [
    "LatencySummary",
    "Sample",
    "censored_latencies",
    "percentile",
    "poisson_arrivals",
    "poisson_schedule",
    "summarize",
    "throughput",
]


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Latency percentiles of one load point, in seconds (``nan`` when there is no sample)."""

    count: int
    p50_s: float
    p95_s: float
    p99_s: float
    mean_s: float
    max_s: float


def summarize(latencies_s: Iterable[float]) -> LatencySummary:
    """p50/p95/p99 (linear interpolation, as ``numpy.percentile``), mean and max."""
    values = sorted(latencies_s)
    if not values:
        return LatencySummary(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    return LatencySummary(
        count=len(values),
        p50_s=percentile(values, 50),
        p95_s=percentile(values, 95),
        p99_s=percentile(values, 99),
        mean_s=math.fsum(values) / len(values),
        max_s=values[-1],
    )


def throughput(records: int, elapsed_s: float) -> float:
    """Records per second; 0.0 for an empty or zero-length window."""
    if records < 0:
        raise ValueError(f"records must be >= 0, got {records}")
    return records / elapsed_s if elapsed_s > 0 else 0.0


def poisson_schedule(
    rate_per_s: float, duration_s: float, *, seed: int | random.Random, start_s: float = 0.0
) -> list[float]:
    """Arrival times of a Poisson process of ``rate_per_s`` in ``[start_s, start_s + duration_s)``.

    Inter-arrival gaps are exponential with mean ``1 / rate_per_s``, drawn from a
    ``random.Random`` seeded with ``seed`` (or the generator given), so one seed gives the same
    schedule to every configuration of a run.
    """
    if not rate_per_s > 0 or math.isinf(rate_per_s):
        raise ValueError(f"rate_per_s must be > 0 and finite, got {rate_per_s!r}")
    if not duration_s >= 0 or math.isinf(duration_s):
        raise ValueError(f"duration_s must be >= 0 and finite, got {duration_s!r}")
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    end = start_s + duration_s
    return list(itertools.takewhile(lambda t: t < end, _arrivals(rate_per_s, rng, start_s)))


def poisson_arrivals(rate_per_s: float, count: int, *, seed: int | random.Random) -> list[float]:
    """The first ``count`` arrival times of a Poisson process of ``rate_per_s`` from 0: a
    fixed amount of work arriving at a rate (the same draws as :func:`poisson_schedule`)."""
    if not rate_per_s > 0 or math.isinf(rate_per_s):
        raise ValueError(f"rate_per_s must be > 0 and finite, got {rate_per_s!r}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    return list(itertools.islice(_arrivals(rate_per_s, rng, 0.0), count))


def _arrivals(rate_per_s: float, rng: random.Random, start_s: float) -> Iterator[float]:
    t = start_s
    while True:
        t += rng.expovariate(rate_per_s)
        yield t


@dataclass(frozen=True, slots=True)
class Sample:
    """One request: when it was meant to go, when it went, when it ended, and how.

    ``done_s`` is ``None`` for a request still unanswered when the run gave up on it;
    ``index`` is the request's number (what ``Target.call`` was given; -1 when unknown).
    """

    intended_s: float
    sent_s: float
    done_s: float | None
    ok: bool
    index: int = -1

    @property
    def latency_s(self) -> float | None:
        """From the intended send time to the answer (``None`` when unanswered)."""
        return None if self.done_s is None else self.done_s - self.intended_s

    @property
    def service_s(self) -> float | None:
        """From the actual send time to the answer: what a coordinated-omission harness reports."""
        return None if self.done_s is None else self.done_s - self.sent_s


def censored_latencies(samples: Sequence[Sample], cutoff_s: float) -> list[float]:
    """Latencies of answered requests, plus ``cutoff_s - intended`` for unanswered ones.

    A request the run gave up on has waited at least that long, so it counts with that lower
    bound: an overloaded point is never flattered by leaving its slowest requests out. Requests
    that failed quickly (errors) are left out: their latency says nothing about service.
    """
    out: list[float] = []
    for s in samples:
        if s.done_s is None:
            out.append(max(0.0, cutoff_s - s.intended_s))
        elif s.ok:
            out.append(s.done_s - s.intended_s)
    return out
