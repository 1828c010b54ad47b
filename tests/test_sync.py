from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from batchline import BatcherClosedError, DynamicBatcher, QueueFullError, SyncBatcher


def square(batch: list[int]) -> list[int]:
    return [x * x for x in batch]


def test_many_threads_submit_at_once() -> None:
    with SyncBatcher(DynamicBatcher(square, max_batch_size=32)) as batcher:

        def work(offset: int) -> list[int]:
            futures = [batcher.submit(offset + i) for i in range(200)]
            return [f.result(timeout=30) for f in futures]

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(work, range(0, 8000, 1000)))
        stats = batcher.stats
    for offset, got in zip(range(0, 8000, 1000), results, strict=True):
        assert got == [(offset + i) ** 2 for i in range(200)]
    assert stats.total_completed == 1600
    assert stats.avg_batch_size > 1


def test_run_and_map() -> None:
    with SyncBatcher(DynamicBatcher(square)) as batcher:
        assert batcher.run(9) == 81
        assert batcher.map(range(5)) == [0, 1, 4, 9, 16]


def test_errors_reach_the_calling_thread() -> None:
    def picky(batch: list[int]) -> list[int]:
        if 13 in batch:
            raise ValueError("13 is unlucky")
        return batch

    with SyncBatcher(DynamicBatcher(picky)) as batcher:
        bad = batcher.submit(13)
        good = batcher.submit(12)
        with pytest.raises(ValueError, match="unlucky"):
            bad.result(timeout=30)
        assert good.result(timeout=30) == 12


@contextlib.contextmanager
def one_batch_held(
    first: int, *, max_queue_size: int
) -> Iterator[tuple[SyncBatcher[int, int], Future[int], threading.Event]]:
    """A ``SyncBatcher`` of one-record batches, none prefetched, whose batch of ``first`` is
    running and held until the event is set: ``(batcher, first's future, event)``."""
    release = threading.Event()

    def blocked(batch: list[int]) -> list[int]:
        release.wait(30)
        return batch

    inner = DynamicBatcher(
        blocked, max_queue_size=max_queue_size, max_batch_size=1, prefetch_batches=0
    )
    with SyncBatcher(inner) as batcher:
        running = batcher.submit(first)
        deadline = time.monotonic() + 30
        while batcher.stats.in_flight_batches == 0:
            assert time.monotonic() < deadline, "the first batch never started"
            release.wait(0.001)
        try:
            yield batcher, running, release
        finally:
            release.set()  # a failed assertion must not leave the batch held for 30 s


def test_submit_nowait_raises_when_full_and_cancel_withdraws() -> None:
    with one_batch_held(1, max_queue_size=1) as (batcher, running, release):
        queued = batcher.submit(2)
        also_queued = batcher.submit(3)  # queue_capacity 2 = 1 + (0 + 1) x 1
        with pytest.raises(QueueFullError):
            batcher.submit_nowait(4)
        assert queued.cancel()
        release.set()
        assert running.result(timeout=30) == 1
        assert also_queued.result(timeout=30) == 3
    assert batcher.stats.total_cancelled == 1


def test_submit_after_stop_is_refused() -> None:
    batcher = SyncBatcher(DynamicBatcher(square))
    batcher.start()
    batcher.stop()
    with pytest.raises(RuntimeError, match="not started"):
        batcher.submit(1)
    inner = DynamicBatcher(square)
    sync = SyncBatcher(inner)
    sync.start()
    loop = sync._loop
    assert loop is not None
    sync.stop()
    with pytest.raises(BatcherClosedError):
        inner.submit_threadsafe(1)


def test_submit_many_nowait_from_a_thread_is_all_or_nothing() -> None:
    with one_batch_held(0, max_queue_size=2) as (batcher, running, release):
        with pytest.raises(QueueFullError, match="room for 3"):
            batcher.submit_many_nowait([1, 2, 3, 4])
        assert batcher.stats.queue_depth == 0
        futures = batcher.submit_many_nowait([1, 2, 3])
        release.set()
        assert [f.result(timeout=30) for f in [running, *futures]] == [0, 1, 2, 3]
