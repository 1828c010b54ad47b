"""A classic timeout batcher, the reference configuration of ``batchline bench``.

The shape most serving stacks ship: take the first queued record, wait until ``max_batch_size``
records have arrived or ``batch_timeout_s`` has passed since the first, run the batch, repeat.
One batch at a time, no cost budget, no length grouping, and it waits for company even when the
model is idle. It exists to be measured against, not to be used.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from batchline.bench.loadgen import Counters

__all__ = ["TimeoutBatcher"]

T = TypeVar("T")
R = TypeVar("R")


class TimeoutBatcher(Generic[T, R]):
    """Collect up to ``max_batch_size`` records or wait ``batch_timeout_s``, then run the batch.

    ``process_fn`` runs one batch at a time: a sync function in a worker thread, a coroutine
    function (or a function returning an awaitable, as a model's ``run_batch`` may) awaited
    on the loop.

    >>> async with TimeoutBatcher(embed, max_batch_size=32, batch_timeout_s=0.01) as b:
    ...     vector = await (await b.submit(text))
    """

    def __init__(
        self,
        process_fn: Callable[[list[T]], Sequence[R] | Awaitable[Sequence[R]]],
        *,
        max_batch_size: int = 32,
        batch_timeout_s: float = 0.01,
        max_queue_size: int = 5_000,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if batch_timeout_s < 0:
            raise ValueError(f"batch_timeout_s must be >= 0, got {batch_timeout_s}")
        self._fn = process_fn
        self._is_async = inspect.iscoroutinefunction(process_fn)
        self.max_batch_size = max_batch_size
        self.batch_timeout_s = batch_timeout_s
        self._queue: asyncio.Queue[tuple[T, asyncio.Future[R]]] = asyncio.Queue(max_queue_size)
        self._task: asyncio.Task[None] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._batches = 0
        self._records = 0
        self._busy_s = 0.0
        self._running = 0
        self._started_at = 0.0

    async def __aenter__(self) -> TimeoutBatcher[T, R]:
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="classic")
        self._started_at = time.perf_counter()
        self._task = asyncio.create_task(self._loop(), name="classic-batcher")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        assert self._executor is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        while not self._queue.empty():
            _, future = self._queue.get_nowait()
            future.cancel()
        self._executor.shutdown(wait=True)

    async def submit(self, record: T) -> asyncio.Future[R]:
        """Queue ``record`` (waiting while the queue is full); return the future of its result."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        await self._queue.put((record, future))
        return future

    def counters(self) -> Counters:
        """Batches and records so far; one processing slot, busy while a batch runs."""
        return Counters(
            batches=self._batches,
            records=self._records,
            busy_s=self._busy_s,
            slot_s=time.perf_counter() - self._started_at,
            pending=self._queue.qsize() + self._running,
        )

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self.batch_timeout_s
            while len(batch) < self.max_batch_size:
                if not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                except TimeoutError:
                    break
            live = [(record, future) for record, future in batch if not future.done()]
            if not live:
                continue
            started = time.perf_counter()
            self._running = len(live)
            try:
                records = [record for record, _ in live]
                done: Sequence[R] | Awaitable[Sequence[R]]
                if self._is_async:
                    done = self._fn(records)
                else:
                    done = await loop.run_in_executor(self._executor, self._fn, records)
                results: Sequence[R] = await done if inspect.isawaitable(done) else done
            except Exception as exc:
                for _, future in live:
                    if not future.done():
                        future.set_exception(exc)
                continue
            finally:
                self._running = 0
                self._busy_s += time.perf_counter() - started
                self._batches += 1
                self._records += len(live)
            for (_, future), result in zip(live, results, strict=True):
                if not future.done():
                    future.set_result(result)
