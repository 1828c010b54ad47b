"""Load generation: closed loop (N clients, each waits for its answer) and open loop (Poisson
arrivals at a fixed rate, latency from the intended send time).

A *target* is anything with ``async call(index)`` that sends request ``index`` and returns
when it is answered (raising on failure), plus ``counters()`` for batch statistics when it has
them. :func:`run_point` drives one target at one load point and returns a :class:`PointResult`.

    >>> point = parse_load("closed:1,8,32")[1]         # LoadPoint("closed", 8)
    >>> result = await run_point(target, point, duration_s=5, config="defaults")
    >>> result.achieved_rps, result.p99_ms

Both loops read time from a :class:`~batchline.bench.stats.Clock`, so tests run them on a
manual clock. Only requests answered inside the measurement window count towards throughput;
every request counts towards latency, those still unanswered when the run gives up with the
time they had waited by then (a lower bound), so an overloaded point is never flattered.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

from batchline._clock import Clock, MonotonicClock, sleep_until
from batchline._errors import InputError
from batchline.bench.stats import (
    Sample,
    censored_latencies,
    poisson_schedule,
    summarize,
    throughput,
)

__all__ = [
    "Counters",
    "LoadKind",
    "LoadPoint",
    "PointResult",
    "Target",
    "parse_load",
    "parse_loads",
    "run_closed",
    "run_open",
    "run_point",
]

LoadKind = Literal["closed", "open"]

# After an error a closed-loop client pauses this long, so a dead target is not hammered in a
# tight loop (and the error count stays meaningful).
_ERROR_PAUSE_S = 0.01


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One load level: ``closed`` with ``value`` concurrent clients, or ``open`` with ``value``
    records/s of Poisson arrivals."""

    kind: LoadKind
    value: float

    @property
    def label(self) -> str:
        return f"closed {self.offered}" if self.kind == "closed" else f"open {self.value:g}/s"

    @property
    def offered(self) -> str:
        """The offered load with its unit, for a table cell."""
        if self.kind == "closed":
            return f"{self.value:g} client{'s' if self.value != 1 else ''}"
        return f"{self.value:g} rec/s"

    def __str__(self) -> str:
        return f"{self.kind}:{self.value:g}"


def parse_load(spec: str) -> list[LoadPoint]:
    """``"closed:1,8,32"`` (concurrent clients) or ``"open:50,200"`` (records/s) to points."""
    kind, sep, values = spec.partition(":")
    kind = kind.strip().lower()
    if not sep or kind not in ("closed", "open"):
        raise InputError(
            f"--load {spec!r}: expected closed:N,N,... (concurrent clients) or "
            "open:RATE,RATE,... (records/s), e.g. closed:1,8,32,64"
        )
    points: list[LoadPoint] = []
    for raw in values.split(","):
        raw = raw.strip()
        try:
            value = float(raw)
        except ValueError:
            raise InputError(f"--load {spec!r}: {raw!r} is not a number") from None
        if kind == "closed":
            if not value.is_integer() or value < 1:
                raise InputError(f"--load {spec!r}: clients must be whole numbers >= 1")
            points.append(LoadPoint("closed", int(value)))
        else:
            if not (value > 0 and math.isfinite(value)):
                raise InputError(f"--load {spec!r}: rates must be > 0 records/s")
            points.append(LoadPoint("open", value))
    return points


def parse_loads(specs: Sequence[str]) -> list[LoadPoint]:
    """Several ``--load`` specs, in order, duplicates dropped."""
    return list(dict.fromkeys(point for spec in specs for point in parse_load(spec)))


@dataclass(frozen=True, slots=True)
class Counters:
    """Cumulative batch counters of a target; the difference of two gives a point's figures."""

    batches: float = 0.0
    records: float = 0.0
    busy_s: float = 0.0  # slot-seconds spent running batches
    slot_s: float = 0.0  # slot-seconds the batcher ran
    pending: int = 0  # records queued or running right now


class Target(Protocol):
    """What the load generator drives."""

    async def call(self, index: int) -> None:
        """Send request ``index`` (inputs are reused cyclically) and return once answered."""
        ...

    def counters(self) -> Counters | None:
        """Batch counters so far, or ``None`` when the target does not expose them (HTTP)."""
        ...


@dataclass(frozen=True, slots=True)
class PointResult:
    """What one configuration did at one load point.

    ``achieved_rps`` counts records answered inside the ``duration_s`` window. Latencies are in
    milliseconds (``nan`` when nothing was answered); ``avg_batch_size`` and ``utilization``
    (fraction of processing slots busy) are ``None`` for targets that do not expose them.
    ``errors`` counts failed requests (an exception, a non-200 answer); ``unanswered`` those
    still waiting when the run gave up on them (their latency counts, as a lower bound).
    """

    config: str
    kind: LoadKind
    offered: float
    duration_s: float
    sent: int
    completed: int
    errors: int
    achieved_rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    avg_batch_size: float | None = None
    utilization: float | None = None
    unanswered: int = 0

    @property
    def failed(self) -> bool:
        """True when any request failed or went unanswered."""
        return self.errors > 0 or self.unanswered > 0

    @property
    def point(self) -> LoadPoint:
        return LoadPoint(self.kind, self.offered)

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        for key in ("p50_ms", "p95_ms", "p99_ms"):
            if math.isnan(data[key]):
                data[key] = None  # JSON has no NaN
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PointResult:
        values = dict(data)
        for key in ("p50_ms", "p95_ms", "p99_ms"):
            if values.get(key) is None:
                values[key] = math.nan
        return cls(**values)


# -- the two loops -------------------------------------------------------------------------


async def _call(target: Target, index: int) -> bool:
    try:
        await target.call(index)
    except Exception:  # a cancellation (a BaseException) goes through
        return False
    return True


async def _until_done_or(
    tasks: Sequence[asyncio.Task[None]], clock: Clock, give_up_at: float | None
) -> None:
    """Wait for ``tasks``; at ``give_up_at`` (on ``clock``; ``None``: never) cancel whatever
    still runs."""
    if not tasks:
        return
    everything: asyncio.Future[object] = asyncio.ensure_future(
        asyncio.gather(*tasks, return_exceptions=True)
    )
    if give_up_at is None:
        await everything
        return
    watchdog: asyncio.Future[object] = asyncio.ensure_future(sleep_until(clock, give_up_at))
    try:
        await asyncio.wait([everything, watchdog], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watchdog.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(everything, watchdog, return_exceptions=True)


async def run_closed(
    target: Target,
    clients: int,
    duration_s: float | None,
    *,
    requests: int | None = None,
    clock: Clock | None = None,
    drain_s: float = 5.0,
) -> tuple[list[Sample], float]:
    """``clients`` concurrent clients, each sending its next request as soon as the previous is
    answered, for ``duration_s``, or until ``requests`` requests (indices ``0 .. requests-1``)
    have been sent, whichever comes first. Returns the samples and the start time.

    In a closed loop the load adapts to the system: a client whose request is slow sends less.
    So latency is measured from the actual send; the open loop is the tool for latency under a
    given arrival rate. With a duration, answers are awaited ``drain_s`` past it; with only a
    request count (a fixed amount of work), until the last one is answered.
    """
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    if duration_s is None and requests is None:
        raise ValueError("run_closed needs a duration_s, a requests count or both")
    clock = clock or MonotonicClock()
    start = clock.now()
    stop = math.inf if duration_s is None else start + duration_s
    last = math.inf if requests is None else requests
    numbers = itertools.count()
    samples: list[Sample] = []

    async def client() -> None:
        while clock.now() < stop:
            index = next(numbers)
            if index >= last:
                return
            sent = clock.now()
            try:
                ok = await _call(target, index)
            except asyncio.CancelledError:
                samples.append(Sample(sent, sent, None, False, index))
                raise
            samples.append(Sample(sent, sent, clock.now(), ok, index))
            if not ok:
                await sleep_until(clock, clock.now() + _ERROR_PAUSE_S)

    tasks = [asyncio.ensure_future(client()) for _ in range(clients)]
    await _until_done_or(tasks, clock, None if duration_s is None else stop + drain_s)
    return samples, start


async def run_open(
    target: Target,
    schedule: Sequence[float],
    *,
    clock: Clock | None = None,
    drain_s: float | None = 5.0,
    duration_s: float | None = None,
) -> tuple[list[Sample], float]:
    """Send request ``i`` at ``start + schedule[i]`` whether or not earlier ones were answered.

    Each request's latency runs from its intended send time, so time the generator itself lost
    (a stalled event loop, a paused process) is charged to the requests it delayed. After the
    last arrival (or ``duration_s``), answers are awaited for up to ``drain_s`` more (``None``:
    until every one is answered). Returns the samples and the start time.
    """
    clock = clock or MonotonicClock()
    start = clock.now()
    intended = [start + offset for offset in schedule]
    # filled in as requests go and come back; a request cancelled before its task first ran
    # still has its intended time, so it is counted as unanswered, never lost
    sent: list[float | None] = [None] * len(intended)
    done: list[float | None] = [None] * len(intended)
    ok: list[bool] = [False] * len(intended)
    tasks: list[asyncio.Task[None]] = []

    async def one(index: int) -> None:
        sent[index] = clock.now()
        ok[index] = await _call(target, index)
        done[index] = clock.now()

    try:
        for index, when in enumerate(intended):
            await sleep_until(clock, when)
            tasks.append(asyncio.ensure_future(one(index)))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    end = start + (duration_s if duration_s is not None else (schedule[-1] if schedule else 0.0))
    await _until_done_or(tasks, clock, None if drain_s is None else max(end, clock.now()) + drain_s)
    samples = [
        Sample(when, sent_at if sent_at is not None else when, done_at, good, index)
        for index, (when, sent_at, done_at, good) in enumerate(
            zip(intended, sent, done, ok, strict=True)
        )
    ]
    return samples, start


# -- one load point ------------------------------------------------------------------------


async def _wait_idle(target: Target, clock: Clock, give_up_at: float) -> Counters | None:
    counters = target.counters()
    while counters is not None and counters.pending > 0 and clock.now() < give_up_at:
        await sleep_until(clock, clock.now() + 0.005)
        counters = target.counters()
    return counters


async def run_point(
    target: Target,
    point: LoadPoint,
    *,
    duration_s: float,
    config: str = "",
    clock: Clock | None = None,
    seed: int = 0,
    drain_s: float | None = None,
) -> PointResult:
    """Drive ``target`` at ``point`` for ``duration_s`` and summarise what happened.

    ``seed`` fixes the open-loop arrival schedule, so every configuration of a run gets the same
    one. ``drain_s`` (default: ``max(1, duration_s)``) bounds the wait for late answers.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    clock = clock or MonotonicClock()
    drain = max(1.0, duration_s) if drain_s is None else drain_s
    # requests given up on at the previous point may still be running: let them finish, or
    # this point would pay for them
    before = await _wait_idle(target, clock, clock.now() + max(drain, 5.0))
    if point.kind == "closed":
        samples, start = await run_closed(
            target, int(point.value), duration_s, clock=clock, drain_s=drain
        )
    else:
        # a different seed per rate, the same for every configuration at that rate
        schedule = poisson_schedule(
            point.value, duration_s, seed=seed * 1_000_003 + int(point.value)
        )
        samples, start = await run_open(
            target, schedule, clock=clock, drain_s=drain, duration_s=duration_s
        )
    cutoff = clock.now()
    after = target.counters()
    window_end = start + duration_s
    in_window = sum(1 for s in samples if s.ok and s.done_s is not None and s.done_s <= window_end)
    answered = sum(1 for s in samples if s.ok and s.done_s is not None)
    unanswered = sum(1 for s in samples if s.done_s is None)
    summary = summarize(censored_latencies(samples, cutoff))
    batch_size: float | None = None
    utilization: float | None = None
    if before is not None and after is not None:
        batches = after.batches - before.batches
        slots = after.slot_s - before.slot_s
        batch_size = (after.records - before.records) / batches if batches > 0 else 0.0
        utilization = min(1.0, max(0.0, (after.busy_s - before.busy_s) / slots)) if slots else 0.0
    return PointResult(
        config=config,
        kind=point.kind,
        offered=point.value,
        duration_s=duration_s,
        sent=len(samples),
        completed=answered,
        errors=len(samples) - answered - unanswered,
        achieved_rps=throughput(in_window, duration_s),
        p50_ms=summary.p50_s * 1e3,
        p95_ms=summary.p95_s * 1e3,
        p99_ms=summary.p99_s * 1e3,
        avg_batch_size=batch_size,
        utilization=utilization,
        unanswered=unanswered,
    )
