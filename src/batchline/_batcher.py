"""``DynamicBatcher``: submit records from many producers, get a future each; batches go out
under a cost budget and a size cap, as soon as a processing slot is free.

The rules it keeps:

* **Work-conserving.** When a slot is free and a record is queued, a batch goes out now.
  Records that arrive while every slot is busy wait in the queue and join the batch that is
  formed when a slot frees. A batch frees its slot the moment ``process_fn`` returns, and the
  next batch goes out before the results are handed out (waking their callers can take the
  event loop a while). ``min_batch_size``/``batch_timeout_s`` only let the batcher hold
  records while a slot is free, waiting for company; by default nothing is held.
* **Hard budget.** A batch never exceeds ``target_batch_cost`` nor ``max_batch_size``; a record
  costing more than the whole budget goes alone (``oversize="alone"``) or is refused at submit
  (``oversize="reject"``).
* **Fault isolation.** When ``process_fn`` raises, the batch is bisected and retried, so only
  the records that fail on their own get an error, each its own (``on_error="bisect"``).
* **Nothing lost, nothing resolved twice.** Every submitted record's future ends with its
  result, its own error, cancelled, ``DeadlineExceededError`` or ``BatcherClosedError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import functools
import inspect
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, Literal, TypeVar, cast

from batchline._clock import Clock, LoopClock, TimerHandle
from batchline._cost import CostResolver
from batchline._device import Device, _Grant
from batchline._errors import (
    BatcherClosedError,
    BatchProcessingError,
    BatchSizeMismatchError,
    BatchTimeoutError,
    DeadlineExceededError,
    QueueFullError,
    RecordTooLargeError,
)
from batchline._policy import UNSET, BatchPolicy, Unset, admission_capacity
from batchline._queue import Entry, RecordQueue
from batchline._slots import Slot, Slots
from batchline._stats import BatchStats, StatsRecorder

__all__ = ["DynamicBatcher", "ProcessFn", "admission_capacity"]

T = TypeVar("T")
R = TypeVar("R")

ProcessFn = Callable[[list[T]], "Awaitable[Sequence[R]] | Sequence[R]"]
"""``f(batch) -> results``, async or sync, one result per record in the batch's order."""

logger = logging.getLogger("batchline")

_TIMEOUT_MSG = "batchline: process_timeout_s elapsed"


class State(enum.Enum):
    """A batcher's lifecycle: NEW -> RUNNING -> STOPPING -> STOPPED (-> RUNNING again)."""

    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class _RecordFuture(asyncio.Future, Generic[T, R]):  # type: ignore[type-arg]
    """The future handed to a caller; cancelling it withdraws a record still queued."""

    __slots__ = ("_entry", "_owner")
    _entry: Entry[T]
    _owner: DynamicBatcher[T, R] | None

    def cancel(self, msg: object | None = None) -> bool:
        if not super().cancel(msg):
            return False
        owner = self._owner
        if owner is not None:
            owner._on_cancel(self._entry)
        return True


_HOLD = "hold"  # _readiness(): records are held for company (min_batch_size)
_DEFAULT_POLICY = BatchPolicy()


class DynamicBatcher(Generic[T, R]):
    """Batches records from many concurrent producers through one processing function.

    A drop-in for ``flyte.extras.DynamicBatcher`` (same keywords and methods) that
    dispatches as soon as a slot is free, keeps a hard budget, isolates failing records,
    and can run several batches at once.

    >>> async def double(batch: list[int]) -> list[int]:
    ...     return [x * 2 for x in batch]
    >>> async def main() -> int:
    ...     async with DynamicBatcher(double, max_batch_size=64) as batcher:
    ...         return await batcher.run(21)

    Args:
        process_fn: ``f(batch) -> results``: async, or sync (then run in a worker thread so
            the event loop never blocks). One result per record, in order.
        policy: every batching setting in one :class:`~batchline.BatchPolicy` (budget, sizes,
            hold, admission, slots, errors, padding, priorities, bulk lane), passed whole;
            each field is documented there. The same names are accepted as keywords (Flyte's
            signature: ``max_batch_size=64``); a keyword given wins over ``policy``'s field.
        cost_estimator: ``f(record) -> int``, used when ``submit`` gets no explicit cost.
        device: a ``Device`` whose slots this batcher shares with others (several models,
            one device): each batch then needs a free slot of its own (at most
            ``max_concurrent_batches``) and one of the device's, granted by the device's
            weighted fair, work-conserving policy (see ``batchline._device``). Without it the
            batcher's own slots are all there is.
        weight: this batcher's share of the device relative to the others' (> 0).
        clock: where time comes from; tests pass a ``ManualClock``. On a device the
            batcher uses the device's clock unless given the same one.
        name: used in logs and thread names.

    Admission, as in Flyte: Flyte holds up to ``max_queue_size`` records in its queue plus,
    outside it, the batch its aggregator is assembling and ``prefetch_batches`` pre-built
    batches; batchline forms batches at dispatch time, so it holds all of those in its one
    queue (``queue_capacity``; see ``admission_capacity``). ``priority_aging_s``: a record of
    priority ``p`` ranks as if it had arrived ``p * priority_aging_s`` earlier, in this queue
    and, for the record its next batch starts with, at the device.
    """

    _use_tokens = False
    #: ``BatchPolicy.padding_aware=None`` means this for the class
    _padding_aware_default = False

    def __init__(
        self,
        process_fn: ProcessFn[T, R],
        *,
        policy: BatchPolicy | None = None,
        cost_estimator: Callable[[T], int] | None = None,
        target_batch_cost: int | Unset = UNSET,
        max_batch_size: int | Unset = UNSET,
        min_batch_size: int | Unset = UNSET,
        batch_timeout_s: float | Unset = UNSET,
        max_queue_size: int | Unset = UNSET,
        prefetch_batches: int | Unset = UNSET,
        default_cost: int | Unset = UNSET,
        max_concurrent_batches: int | Unset = UNSET,
        oversize: Literal["alone", "reject"] | Unset = UNSET,
        on_error: Literal["bisect", "fail_batch"] | Unset = UNSET,
        process_timeout_s: float | Unset | None = UNSET,
        padding_aware: bool | Unset | None = UNSET,
        bucket_width: int | Unset = UNSET,
        padding_slack: int | Unset = UNSET,
        device: Device | None = None,
        weight: float = 1.0,
        priority_aging_s: float | Unset | None = UNSET,
        mix_priorities: bool | Unset = UNSET,
        priority_yield: float | Unset = UNSET,
        bulk_slots: int | Unset | None = UNSET,
        bulk_thread_nice: int | Unset = UNSET,
        bulk_batch_cost: int | Unset | None = UNSET,
        clock: Clock | None = None,
        name: str = "batcher",
    ) -> None:
        if not callable(process_fn):
            raise TypeError(f"process_fn must be callable, got {type(process_fn).__name__}")
        if policy is not None and not isinstance(policy, BatchPolicy):
            raise TypeError(f"policy must be a batchline.BatchPolicy, got {type(policy).__name__}")
        # the keywords given (Flyte's way) win over the policy's fields; validated there
        policy = (policy or _DEFAULT_POLICY).given(
            target_batch_cost=target_batch_cost,
            max_batch_size=max_batch_size,
            min_batch_size=min_batch_size,
            batch_timeout_s=batch_timeout_s,
            max_queue_size=max_queue_size,
            prefetch_batches=prefetch_batches,
            default_cost=default_cost,
            max_concurrent_batches=max_concurrent_batches,
            oversize=oversize,
            on_error=on_error,
            process_timeout_s=process_timeout_s,
            padding_aware=padding_aware,
            bucket_width=bucket_width,
            padding_slack=padding_slack,
            priority_aging_s=priority_aging_s,
            mix_priorities=mix_priorities,
            priority_yield=priority_yield,
            bulk_slots=bulk_slots,
            bulk_thread_nice=bulk_thread_nice,
            bulk_batch_cost=bulk_batch_cost,
        )
        if policy.padding_aware is None:
            policy = policy.replace(padding_aware=self._padding_aware_default)
        if device is None:
            if weight != 1.0:
                raise ValueError(f"weight={weight!r} needs a device: pass device=Device(...)")
        else:
            if not isinstance(device, Device):
                raise TypeError(f"device must be a batchline.Device, got {type(device).__name__}")
            if clock is None:
                clock = device.clock
            elif clock is not device.clock and not (
                isinstance(clock, LoopClock) and isinstance(device.clock, LoopClock)
            ):
                raise ValueError(
                    "a batcher on a device must use the device's clock: pass "
                    "Device(clock=...) the same clock, and leave the batcher's out"
                )

        self._policy = policy
        self._process_fn = process_fn
        self._is_async = inspect.iscoroutinefunction(process_fn) or (
            inspect.iscoroutinefunction(getattr(process_fn, "__call__", None))  # noqa: B004
        )
        # the same function, typed as what it is when it runs in a worker thread
        self._sync_fn = cast(Callable[[list[T]], Sequence[R]], process_fn)
        self._cost = CostResolver(
            default_cost=policy.default_cost,
            cost_estimator=cost_estimator,
            use_tokens=self._use_tokens,
        )
        self._capacity = policy.queue_capacity
        self._slots = policy.max_concurrent_batches
        self._clock: Clock = clock if clock is not None else LoopClock()
        self.name = name
        self._device = device
        self._member = device._attach(self, weight) if device is not None else None

        self._state = State.NEW
        self._priority_aging_s = policy.priority_aging_s
        self._mix_priorities = policy.mix_priorities
        self._priority_yield = policy.priority_yield
        self._bulk_batch_cost = policy.bulk_batch_cost or policy.target_batch_cost
        self._queue = self._new_queue()
        self._seq = itertools.count()
        self._stats = StatsRecorder()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._in_flight: set[asyncio.Task[None]] = set()
        self._space_waiters: list[asyncio.Future[None]] = []
        self._stop_task: asyncio.Task[None] | None = None
        self._lanes = Slots(  # a batch frees its slot as soon as process_fn returns
            policy.max_concurrent_batches,
            policy.bulk_slots,
            policy.bulk_thread_nice,
            policy.bulk_batch_cost is not None,
        )
        self._hold_timer: TimerHandle | None = None
        self._started_at = 0.0
        self._now: Callable[[], float] = self._clock.now

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """True between ``start()`` and the beginning of ``stop()``."""
        return self._state is State.RUNNING

    @property
    def state(self) -> State:
        return self._state

    @property
    def queue_depth(self) -> int:
        """Records queued and not yet dispatched (at most ``queue_capacity``)."""
        return self._queue.size

    @property
    def policy(self) -> BatchPolicy:
        """The settings this batcher runs with (``padding_aware`` resolved)."""
        return self._policy

    @property
    def target_batch_cost(self) -> int:
        return self._policy.target_batch_cost

    @property
    def max_batch_size(self) -> int:
        return self._policy.max_batch_size

    @property
    def max_queue_size(self) -> int:
        return self._policy.max_queue_size

    @property
    def prefetch_batches(self) -> int:
        return self._policy.prefetch_batches

    @property
    def queue_capacity(self) -> int:
        """Records that may be queued at once (see ``admission_capacity``)."""
        return self._capacity

    @property
    def max_concurrent_batches(self) -> int:
        return self._slots

    @property
    def device(self) -> Device | None:
        """The ``Device`` this batcher shares, or ``None``."""
        return self._device

    def _new_queue(self) -> RecordQueue[T]:
        return RecordQueue(
            padding_aware=bool(self._policy.padding_aware),
            bucket_width=self._policy.bucket_width,
            padding_slack=self._policy.padding_slack,
            aging_s=self._priority_aging_s,
            mix_priorities=self._mix_priorities,
            priority_yield=self._priority_yield,
            yield_window_s=self._priority_aging_s or 10.0,
        )

    async def start(self) -> None:
        """Start dispatching on the running event loop. Raises ``RuntimeError`` if running."""
        if self._state in (State.RUNNING, State.STOPPING):
            raise RuntimeError(f"{self.name} is already {self._state.value}")
        loop = asyncio.get_running_loop()
        if self._device is not None and self._member is not None:
            self._device._bind(loop, self._member)
        self._loop = loop
        self._wake = asyncio.Event()
        self._queue = self._new_queue()
        self._in_flight = set()
        self._space_waiters = []
        self._stop_task = None
        self._lanes.start(self.name, threads=not self._is_async)
        # reading the loop's clock directly saves a lookup per record
        self._now = loop.time if isinstance(self._clock, LoopClock) else self._clock.now
        self._started_at = self._clock.now()
        self._state = State.RUNNING
        self._dispatcher = loop.create_task(self._dispatch_loop(), name=f"{self.name}-dispatch")

    async def stop(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop taking records and finish.

        ``drain=True`` (default) runs everything already queued; with ``timeout_s``, whatever
        is still queued or running when it elapses fails with ``BatcherClosedError``.
        ``drain=False`` fails queued records at once and waits only for running batches.
        ``submit`` raises ``BatcherClosedError`` from the moment ``stop`` is called. Several
        concurrent calls are safe: they all return when the batcher has stopped.
        """
        if self._state in (State.NEW, State.STOPPED):
            return
        if self._stop_task is None:
            assert self._loop is not None
            self._stop_task = self._loop.create_task(self._do_stop(drain, timeout_s))
        await asyncio.shield(self._stop_task)

    async def __aenter__(self) -> DynamicBatcher[T, R]:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _do_stop(self, drain: bool, timeout_s: float | None) -> None:
        self._state = State.STOPPING
        closed = BatcherClosedError(f"{self.name} is stopping")
        for waiter in self._space_waiters:
            if not waiter.done():
                waiter.set_exception(closed)
        self._space_waiters.clear()
        if not drain:
            self._fail_queued("stopped without draining")
        self._notify()
        dispatcher = self._dispatcher
        assert dispatcher is not None
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(dispatcher)
                while self._in_flight:
                    await asyncio.wait(set(self._in_flight))
        except TimeoutError:
            dispatcher.cancel()
            self._fail_queued(f"stop() did not finish within timeout_s={timeout_s}")
            for task in list(self._in_flight):
                task.cancel()
            await asyncio.gather(dispatcher, *self._in_flight, return_exceptions=True)
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        self._stats.running_s += (self._clock.now() - self._started_at) * self._lanes.total
        self._lanes.stop()
        if self._device is not None:
            assert self._member is not None
            self._device._leave(self._member)
            self._device._unbind(self._member)
        self._state = State.STOPPED

    def _fail_queued(self, why: str) -> None:
        for entry in self._queue.drain():
            self._cancel_deadline(entry)
            if not entry.future.done():
                entry.future.set_exception(BatcherClosedError(f"{self.name}: {why}"))
                self._stats.failed += 1
        self._leave_device_if_idle()

    def _leave_device_if_idle(self) -> None:
        """Nothing queued any more: stop waiting for a device slot."""
        if self._member is not None and self._queue.size == 0:
            assert self._device is not None
            self._device._leave(self._member)

    # -- submitting -------------------------------------------------------------------------

    async def submit(
        self,
        record: T,
        *,
        estimated_cost: int | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> asyncio.Future[R]:
        """Queue ``record``; return a future of its result. Waits while the queue is full.

        ``priority``: higher goes first (default 0), aged by ``priority_aging_s`` so that
        nothing starves. ``timeout_s``: if the record is still
        queued that long after submit, it fails with ``DeadlineExceededError`` and is never
        processed. Cancelling the future withdraws the record if it is still queued.
        """
        if self._state is not State.RUNNING:
            self._raise_not_running()
        while self._queue.size >= self._capacity:
            await self._wait_for_space()
        return self._enqueue(record, estimated_cost, priority, timeout_s)

    def submit_nowait(
        self,
        record: T,
        *,
        estimated_cost: int | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> asyncio.Future[R]:
        """Like ``submit`` but never waits: raises ``QueueFullError`` when the queue is full."""
        if self._state is not State.RUNNING:
            self._raise_not_running()
        if self._queue.size >= self._capacity:
            raise self._queue_full(1)
        return self._enqueue(record, estimated_cost, priority, timeout_s)

    def submit_many_nowait(
        self,
        records: Sequence[T],
        *,
        estimated_costs: Sequence[int | None] | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> list[asyncio.Future[R]]:
        """Queue every record or none; return their futures in the same order.

        Never waits. When the queue has room for fewer than ``len(records)`` more records,
        or any record is refused (``RecordTooLargeError``, a bad cost), nothing is queued
        and the error is raised: ``QueueFullError`` says how many were asked and how much
        room there was. ``priority`` and ``timeout_s`` apply to every record, as in
        ``submit_nowait``. For a server: all of a request's inputs, or a 429.

        >>> futures = batcher.submit_many_nowait(["a", "bb"], estimated_costs=[1, 2])
        """
        if self._state is not State.RUNNING:
            self._raise_not_running()
        n = len(records)
        if estimated_costs is not None and len(estimated_costs) != n:
            raise ValueError(f"estimated_costs has {len(estimated_costs)} entries for {n} records")
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        # every check before the first record is queued: a refusal leaves nothing behind
        resolve = self._cost
        if estimated_costs is None:
            costs = [resolve(r, None) for r in records]
        else:
            costs = [resolve(r, c) for r, c in zip(records, estimated_costs, strict=True)]
        if self._policy.oversize == "reject":
            for i, cost in enumerate(costs):
                if cost > self._policy.target_batch_cost:
                    raise self._too_large(cost, f"record {i} of {n}")
        if self._queue.size + n > self._capacity:
            raise self._queue_full(n)
        enqueue = self._enqueue
        return [enqueue(r, c, priority, timeout_s) for r, c in zip(records, costs, strict=True)]

    async def submit_batch(
        self,
        records: Sequence[T],
        *,
        estimated_cost: Sequence[int] | None = None,
    ) -> list[asyncio.Future[R]]:
        """Submit several records, one ``submit`` each (waiting for room while the queue is
        full); return their futures in the same order.

        Flyte's name and keyword (``estimated_cost``, one per record), kept so Flyte code runs
        unchanged. A server that wants all of a request's records queued or none, without
        waiting, uses :meth:`submit_many_nowait` (``estimated_costs``) instead.
        """
        if estimated_cost is not None and len(estimated_cost) != len(records):
            raise ValueError(
                f"estimated_cost has {len(estimated_cost)} entries for {len(records)} records"
            )
        futures = []
        for i, record in enumerate(records):
            cost = estimated_cost[i] if estimated_cost is not None else None
            futures.append(await self.submit(record, estimated_cost=cost))
        return futures

    async def run(
        self,
        record: T,
        *,
        estimated_cost: int | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> R:
        """Submit ``record`` and wait for its result."""
        future = await self.submit(
            record, estimated_cost=estimated_cost, priority=priority, timeout_s=timeout_s
        )
        return await future

    def submit_threadsafe(
        self,
        record: T,
        *,
        estimated_cost: int | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> concurrent.futures.Future[R]:
        """Submit from any thread to this batcher, running on a loop the caller does not
        own; returns a ``concurrent.futures.Future``.

        Never blocks the calling thread: when the queue is full the record waits for room on
        the event loop. Cancelling the returned future withdraws a record still queued. For
        plain threaded code, :class:`batchline.SyncBatcher` is the facade (it runs the batcher
        on a loop thread of its own and blocks a submitting thread while the queue is full);
        this is the primitive for a batcher that already runs on someone else's loop.
        """
        loop = self._loop
        if loop is None or self._state is not State.RUNNING:
            self._raise_not_running()
        assert loop is not None
        outer: concurrent.futures.Future[R] = concurrent.futures.Future()

        def enqueue() -> None:
            if not outer.set_running_or_notify_cancel():
                return
            try:
                if self._state is not State.RUNNING:
                    self._raise_not_running()
                if self._queue.size < self._capacity:
                    chain_future(
                        self._enqueue(record, estimated_cost, priority, timeout_s), outer, loop
                    )
                    return
            except BaseException as exc:
                outer.set_exception(exc)
                return
            task = loop.create_task(
                self.submit(
                    record, estimated_cost=estimated_cost, priority=priority, timeout_s=timeout_s
                )
            )
            task.add_done_callback(functools.partial(_chain_submit, outer=outer, loop=loop))

        loop.call_soon_threadsafe(enqueue)
        return outer

    def _queue_full(self, asked: int) -> QueueFullError:
        room = max(0, self._capacity - self._queue.size)
        rule = (
            f"queue_capacity {self._capacity} = max_queue_size {self._policy.max_queue_size} + "
            f"(prefetch_batches {self._policy.prefetch_batches} + 1) x max_batch_size "
            f"{self._policy.max_batch_size}"
        )
        if asked == 1:
            return QueueFullError(
                f"{self.name}: queue is full ({rule}); retry later or raise max_queue_size"
            )
        return QueueFullError(
            f"{self.name}: queue is full for {asked} records: room for {room} ({rule}); "
            "none were queued; retry later, send fewer, or raise max_queue_size"
        )

    def _too_large(self, cost: int, what: str = "record") -> RecordTooLargeError:
        return RecordTooLargeError(
            f"{self.name}: {what} cost {cost} exceeds target_batch_cost="
            f"{self._policy.target_batch_cost}; split the record, raise the budget, "
            "or build the batcher with oversize='alone'"
        )

    def _raise_not_running(self) -> None:
        if self._state in (State.STOPPING, State.STOPPED):
            raise BatcherClosedError(f"{self.name} is {self._state.value}; submit refused")
        raise RuntimeError(f"{self.name} is not running; call start() or use 'async with'")

    async def _wait_for_space(self) -> None:
        assert self._loop is not None
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._space_waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._space_waiters:
                self._space_waiters.remove(waiter)
        if self._state is not State.RUNNING:
            self._raise_not_running()

    def _release_space(self, count: int) -> None:
        waiters = self._space_waiters
        while count > 0 and waiters:
            waiter = waiters.pop(0)
            if not waiter.done():
                waiter.set_result(None)
                count -= 1

    def _enqueue(
        self, record: T, estimated_cost: int | None, priority: int, timeout_s: float | None
    ) -> asyncio.Future[R]:
        # the hot path: one call per record, kept lean on purpose
        cost = self._cost(record, estimated_cost)
        if cost > self._policy.target_batch_cost and self._policy.oversize == "reject":
            raise self._too_large(cost)
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        future: _RecordFuture[T, R] = _RecordFuture(loop=self._loop)
        entry: Entry[T] = Entry(record, cost, future, next(self._seq), priority, self._now())
        future._entry = entry
        future._owner = self
        if timeout_s is not None:
            entry.deadline_timer = self._clock.call_at(
                entry.enqueued_at + timeout_s, functools.partial(self._expire, entry, timeout_s)
            )
        self._queue.push(entry)
        self._stats.submitted += 1
        wake = self._wake
        if wake is not None and not wake.is_set():
            wake.set()
        return cast(asyncio.Future[R], future)

    def _on_cancel(self, entry: Entry[T]) -> None:
        self._stats.cancelled += 1
        if self._queue.withdraw(entry):
            self._cancel_deadline(entry)
            self._release_space(1)
            self._leave_device_if_idle()

    def _expire(self, entry: Entry[T], timeout_s: float) -> None:
        entry.deadline_timer = None
        if not self._queue.withdraw(entry):
            return
        self._stats.expired += 1
        if not entry.future.done():
            entry.future.set_exception(
                DeadlineExceededError(
                    f"{self.name}: record waited {timeout_s}s in the queue without being "
                    "dispatched; it was not processed"
                )
            )
        self._release_space(1)
        self._leave_device_if_idle()

    @staticmethod
    def _cancel_deadline(entry: Entry[T]) -> None:
        if entry.deadline_timer is not None:
            entry.deadline_timer.cancel()
            entry.deadline_timer = None

    # -- dispatching ------------------------------------------------------------------------

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _dispatch_loop(self) -> None:
        wake = self._wake
        assert wake is not None
        queue = self._queue
        member = self._member
        device = self._device
        while True:
            stopping = self._state is not State.RUNNING
            if stopping and queue.size == 0:
                return
            if (
                queue.size == 0
                or self._lanes.free_lane(self._queue) is None
                or (member is not None and member.waiting)  # the device grants in its turn
            ):
                wake.clear()
                await wake.wait()
                continue
            if not stopping and queue.size < self._policy.max_batch_size:
                # Let callbacks that are already scheduled run first: when a batch's results
                # wake their producers, their resubmits land now and go out together instead of
                # the first one leaving alone (which would split the cohort).
                await asyncio.sleep(0)
                if queue.size == 0:
                    continue
            reason = self._readiness(stopping)
            if reason is _HOLD:
                # a slot is free, but min_batch_size asks to wait a little for company
                oldest = queue.oldest()
                assert oldest is not None
                self._arm_hold_timer(oldest.enqueued_at + self._policy.batch_timeout_s)
                wake.clear()
                await wake.wait()
                continue
            if device is None:
                self._dispatch(reason)
                continue
            assert member is not None
            busy = self._lanes.busy
            # a grant dispatches at once (_use_device_slot); otherwise we wait our turn
            device._request(member)
            if not member.waiting and self._lanes.busy == busy:
                wake.clear()  # not expected: never spin
                await wake.wait()

    def _readiness(self, stopping: bool) -> str | None:
        """Why a batch would go out now (``None``: decided by the batch), or ``_HOLD``."""
        if stopping:
            return "stop"
        if not self._short_of_min_batch():
            return None
        oldest = self._queue.oldest()
        assert oldest is not None
        if self._clock.now() < oldest.enqueued_at + self._policy.batch_timeout_s:
            return _HOLD
        return "timeout"

    def _use_device_slot(self, grant: _Grant) -> bool:
        """The device granted a slot: dispatch now, or say no (the grant goes to another)."""
        if (
            self._state not in (State.RUNNING, State.STOPPING)
            or self._queue.size == 0
            or self._lanes.free_lane(self._queue) is None
        ):
            return False
        reason = self._readiness(self._state is not State.RUNNING)
        if reason is _HOLD:
            return False
        dispatched = self._dispatch(reason, grant)
        self._notify()  # more may be ready: the loop asks again
        return dispatched

    def _head_priority(self, now: float) -> tuple[int, float]:
        """The aged priority of the record this batcher's next batch starts with."""
        return self._queue.head_priority(now)

    def _device_ready(self) -> bool:
        """A batch could go out now if the device granted a slot."""
        return (
            self._state in (State.RUNNING, State.STOPPING)
            and self._queue.size > 0
            and self._lanes.free_lane(self._queue) is not None
            and self._readiness(self._state is not State.RUNNING) is not _HOLD
        )

    def _short_of_min_batch(self) -> bool:
        """Too little is queued to dispatch without holding (``min_batch_size``)."""
        queue = self._queue
        return (
            queue.size < self._policy.min_batch_size
            and queue.total_cost < self._policy.target_batch_cost
        )

    def _arm_hold_timer(self, when: float) -> None:
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        self._hold_timer = self._clock.call_at(when, self._notify)

    def _dispatch(self, reason: str | None, grant: _Grant | None = None) -> bool:
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        lane = self._lanes.free_lane(self._queue)
        if lane is None:
            return False
        bulk = lane == "bulk"
        if lane == "all" and self._lanes.bulk_aware:  # in shared slots, the head tells
            head = self._queue.oldest()
            bulk = head is not None and head.priority < 0
        entries, cost, by_budget = self._queue.take_batch(
            self._bulk_batch_cost if bulk else self._policy.target_batch_cost,
            self._policy.max_batch_size,
            self._now(),
            lane,
        )
        if not entries:
            return False
        if reason is None:
            if len(entries) >= self._policy.max_batch_size:
                reason = "full"
            elif by_budget:
                reason = "budget"
            else:
                reason = "slot_free"
        now = self._clock.now()
        stats = self._stats
        waits = stats.queue_waits
        for e in entries:
            e.dispatched_at = now
            waits.append(now - e.enqueued_at)
            if e.deadline_timer is not None:
                e.deadline_timer.cancel()
                e.deadline_timer = None
        stats.batches += 1
        stats.batched_records += len(entries)
        stats.batch_cost += cost
        stats.budget_fill += min(1.0, cost / self._policy.target_batch_cost)
        stats.reasons[reason] += 1
        if self._policy.padding_aware:
            stats.padded_tokens += cost
            stats.real_tokens += sum(e.cost for e in entries)
        self._release_space(len(entries))
        assert self._loop is not None
        started: asyncio.Future[Sequence[R]] | None = None
        executor = self._lanes.pool(bulk)
        if executor is not None:
            # hand a sync batch to its worker thread now rather than on the task's first step:
            # the device starts one event-loop turn sooner
            started = self._loop.run_in_executor(
                executor, self._sync_fn, [e.record for e in entries]
            )
        slot = self._lanes.hold(grant, bulk)
        task = self._loop.create_task(self._run_batch(entries, started, slot))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)
        return True

    def _free_slot(self, slot: Slot) -> None:
        if not self._lanes.free(slot):
            return
        grant = slot.grant
        if grant is not None:
            device = self._device
            member = self._member
            assert device is not None
            assert member is not None
            if self._device_ready():
                # join the queue for slots first, so that the device's choice of who gets
                # this one includes us
                device._request(member)
            device._release(grant)
            self._notify()
        elif (
            self._state is State.RUNNING
            and self._queue.size > 0
            and self._lanes.free_lane(self._queue) is not None
            and not self._short_of_min_batch()
        ):
            # Dispatch now, before this batch's results are handed out: resolving them wakes
            # their callers (and, in a server, writes their responses), and the device would
            # sit idle for all of that while records are already waiting.
            self._dispatch(None)
        else:
            self._notify()

    # -- running a batch --------------------------------------------------------------------

    async def _run_batch(
        self, entries: list[Entry[T]], started: asyncio.Future[Sequence[R]] | None, slot: Slot
    ) -> None:
        try:
            await self._process(entries, started, slot)
        except asyncio.CancelledError:
            # stop(timeout_s=...) gave up on this batch
            self._fail_each(entries, lambda: BatcherClosedError(f"{self.name}: stop() timed out"))
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: fail the records, go on up
            what = repr(exc)
            self._fail_each(entries, lambda: BatchProcessingError(f"{self.name}: {what}"))
            raise
        finally:
            self._free_slot(slot)

    async def _process(
        self,
        entries: list[Entry[T]],
        running: asyncio.Future[Sequence[R]] | None = None,
        slot: Slot | None = None,
    ) -> None:
        # ``running``: the call already started at dispatch on exactly these entries.
        # ``slot``: freed early when the call succeeds; a failed batch keeps it for bisecting.
        live = entries if running is not None else [e for e in entries if not e.future.done()]
        if not live:
            return
        started = self._clock.now()
        error: BaseException | None = None
        try:
            results = await self._call([e.record for e in live], running, live[0].priority < 0)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            assert task is not None
            if exc.args and exc.args[0] == _TIMEOUT_MSG:
                task.uncancel()
                self._stats.busy_s += self._clock.now() - started
                limit = self._policy.process_timeout_s
                self._fail_each(
                    live,
                    lambda: BatchTimeoutError(
                        f"{self.name}: process_fn did not return within process_timeout_s={limit}"
                    ),
                )
                return
            if task.cancelling():
                raise  # stop(timeout_s=...) is cancelling this batch
            # process_fn itself raised CancelledError: a failure like any other
            error = BatchProcessingError(f"{self.name}: process_fn raised CancelledError")
        except Exception as exc:
            error = exc
        finished = self._clock.now()
        self._stats.busy_s += finished - started
        if error is not None:
            if self._policy.on_error == "bisect" and len(live) > 1:
                middle = len(live) // 2
                await self._process(live[:middle])
                await self._process(live[middle:])
            else:
                self._fail_all(live, error)
            return
        if not hasattr(results, "__len__") or len(results) != len(live):
            got = len(results) if hasattr(results, "__len__") else type(results).__name__
            n = len(live)
            self._fail_each(
                live,
                lambda: BatchSizeMismatchError(
                    f"{self.name}: process_fn returned {got} results for a batch of {n} "
                    "records; it must return exactly one result per record, in order"
                ),
            )
            return
        if slot is not None:
            self._free_slot(slot)
        stats = self._stats
        latencies = stats.latencies
        completed = 0
        for e, result in zip(live, results, strict=True):
            future = e.future
            if not future.done():
                future.set_result(result)
                completed += 1
                latencies.append(finished - e.enqueued_at)
        stats.completed += completed

    def _fail_each(self, entries: list[Entry[T]], make: Callable[[], BaseException]) -> None:
        """Fail each record with an exception of its own (no shared traceback)."""
        for e in entries:
            self._fail_all([e], make())

    def _fail_all(self, entries: list[Entry[T]], exc: BaseException) -> None:
        now = self._clock.now()
        for e in entries:
            if not e.future.done():
                e.future.set_exception(exc)
                self._stats.failed += 1
                self._stats.latencies.append(now - e.enqueued_at)

    async def _call(
        self, records: list[T], running: asyncio.Future[Sequence[R]] | None, bulk: bool
    ) -> Sequence[R]:
        timer = None
        if self._policy.process_timeout_s is not None:
            task = asyncio.current_task()
            assert task is not None
            timer = self._clock.call_at(
                self._clock.now() + self._policy.process_timeout_s,
                functools.partial(task.cancel, _TIMEOUT_MSG),
            )
        try:
            if self._is_async:
                return await cast(Awaitable[Sequence[R]], self._process_fn(records))
            if running is None:
                assert self._loop is not None
                executor = self._lanes.pool(bulk)
                assert executor is not None
                running = self._loop.run_in_executor(executor, self._sync_fn, records)
            result: object = await running
            if inspect.isawaitable(result):  # e.g. a lambda that returns a coroutine
                result = await result
            return cast(Sequence[R], result)
        finally:
            if timer is not None:
                timer.cancel()

    # -- stats ------------------------------------------------------------------------------

    @property
    def stats(self) -> BatchStats:
        """A frozen snapshot of the counters (see ``BatchStats`` for how utilization is defined)."""
        slot_seconds = self._stats.running_s
        if self._state in (State.RUNNING, State.STOPPING):
            slot_seconds += (self._clock_now() - self._started_at) * self._lanes.total
        member = self._member
        return self._stats.snapshot(
            slot_seconds=slot_seconds,
            queue_depth=self._queue.size,
            in_flight=self._lanes.busy,
            device_wait_s=(
                self._device._wait_s(member)
                if self._device is not None and member is not None
                else 0.0
            ),
        )

    def _clock_now(self) -> float:
        try:
            return self._clock.now()
        except RuntimeError:  # LoopClock read from a thread without a running loop
            assert self._loop is not None
            return self._loop.time()


def chain_future(
    inner: asyncio.Future[R], outer: concurrent.futures.Future[R], loop: asyncio.AbstractEventLoop
) -> None:
    """Mirror ``inner`` (on ``loop``) into ``outer`` (any thread), both ways for cancel."""

    def copy(fut: asyncio.Future[R]) -> None:
        if outer.done():
            return
        if fut.cancelled():
            outer.cancel()
        elif (exc := fut.exception()) is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(fut.result())

    def cancel_inner(fut: concurrent.futures.Future[R]) -> None:
        if fut.cancelled() and not loop.is_closed():
            loop.call_soon_threadsafe(inner.cancel)

    inner.add_done_callback(copy)
    outer.add_done_callback(cancel_inner)


def _chain_submit(
    task: asyncio.Task[asyncio.Future[R]],
    *,
    outer: concurrent.futures.Future[R],
    loop: asyncio.AbstractEventLoop,
) -> None:
    if task.cancelled():
        outer.cancel()
    elif (exc := task.exception()) is not None:
        outer.set_exception(exc)
    else:
        chain_future(task.result(), outer, loop)
