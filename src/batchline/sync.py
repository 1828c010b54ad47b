"""Use a batcher from ordinary threads.

``SyncBatcher`` runs a ``DynamicBatcher`` (or ``TokenBatcher``) on an event loop in a
background thread; any number of threads may submit to it at once and get
``concurrent.futures.Future`` objects back.

>>> def square(batch: list[int]) -> list[int]:
...     return [x * x for x in batch]
>>> with SyncBatcher(DynamicBatcher(square, max_batch_size=32)) as batcher:
...     batcher.run(7)
49
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from batchline._batcher import DynamicBatcher, chain_future
from batchline._stats import BatchStats

__all__ = ["SyncBatcher"]

T = TypeVar("T")
R = TypeVar("R")


class SyncBatcher(Generic[T, R]):
    """A thread-side facade over a batcher running on its own event-loop thread."""

    def __init__(self, batcher: DynamicBatcher[T, R]) -> None:
        self.batcher = batcher
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the loop thread and the batcher; returns once the batcher is running."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("SyncBatcher is already started")
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            thread = threading.Thread(target=serve, name="batchline-sync-loop", daemon=True)
            thread.start()
            ready.wait()
            self._loop, self._thread = loop, thread
            asyncio.run_coroutine_threadsafe(self.batcher.start(), loop).result()

    def stop(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop the batcher (see ``DynamicBatcher.stop``) and end the loop thread."""
        with self._lock:
            loop, thread = self._loop, self._thread
            if loop is None or thread is None:
                return
            try:
                asyncio.run_coroutine_threadsafe(
                    self.batcher.stop(drain=drain, timeout_s=timeout_s), loop
                ).result()
            finally:
                loop.call_soon_threadsafe(loop.stop)
                thread.join()
                loop.close()
                self._loop = self._thread = None

    def __enter__(self) -> SyncBatcher[T, R]:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            raise RuntimeError("SyncBatcher is not started; call start() or use 'with'")
        return loop

    def submit(
        self,
        record: T,
        *,
        estimated_cost: int | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> concurrent.futures.Future[R]:
        """Queue ``record``; blocks the calling thread while the queue is full."""
        loop = self._require_loop()
        inner = asyncio.run_coroutine_threadsafe(
            self.batcher.submit(
                record, estimated_cost=estimated_cost, priority=priority, timeout_s=timeout_s
            ),
            loop,
        ).result()
        return self._mirror(inner, loop)

    @staticmethod
    def _mirror(
        inner: asyncio.Future[R], loop: asyncio.AbstractEventLoop
    ) -> concurrent.futures.Future[R]:
        outer: concurrent.futures.Future[R] = concurrent.futures.Future()
        loop.call_soon_threadsafe(chain_future, inner, outer, loop)
        return outer

    def submit_nowait(
        self,
        record: T,
        *,
        estimated_cost: int | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> concurrent.futures.Future[R]:
        """Queue ``record``; raises ``QueueFullError`` at once when the queue is full."""
        loop = self._require_loop()

        async def enqueue() -> asyncio.Future[R]:
            return self.batcher.submit_nowait(
                record, estimated_cost=estimated_cost, priority=priority, timeout_s=timeout_s
            )

        inner = asyncio.run_coroutine_threadsafe(enqueue(), loop).result()
        return self._mirror(inner, loop)

    def submit_many_nowait(
        self,
        records: Sequence[T],
        *,
        estimated_costs: Sequence[int | None] | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> list[concurrent.futures.Future[R]]:
        """Queue every record or none; raises ``QueueFullError`` (nothing queued) when the
        queue has no room for all of them (see ``DynamicBatcher.submit_many_nowait``)."""
        loop = self._require_loop()
        records = list(records)

        async def enqueue() -> list[asyncio.Future[R]]:
            return self.batcher.submit_many_nowait(
                records, estimated_costs=estimated_costs, priority=priority, timeout_s=timeout_s
            )

        inners = asyncio.run_coroutine_threadsafe(enqueue(), loop).result()
        return [self._mirror(inner, loop) for inner in inners]

    def run(self, record: T, *, estimated_cost: int | None = None) -> R:
        """Submit ``record`` and block until its result is ready."""
        return self.submit(record, estimated_cost=estimated_cost).result()

    def map(self, records: Iterable[T]) -> list[R]:
        """Submit every record, then return their results in order (errors raise)."""
        futures = [self.submit(r) for r in records]
        return [f.result() for f in futures]

    @property
    def stats(self) -> BatchStats:
        return self.batcher.stats
