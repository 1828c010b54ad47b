"""Core batcher benchmark: batchline vs a classic timeout batcher vs Flyte (when installed).

Three scenarios, each measured for every implementation in the same run, printed as ratios:

1. overhead: N records, identity process_fn, 8 concurrent producers, max_batch_size=64.
2. idle latency: one record at a time, awaited, batch_timeout_s=0.05; process_fn sleeps 1 ms.
3. closed loop: 8 producers each awaiting their own result; process_fn sleeps
   0.002 + 0.00005*len(batch) s in a thread (a simulated device). The device bound is
   8 records per (0.002 + 0.00005*8) s.

    python benchmarks/bench_batcher.py            # full run (~1-2 min)
    python benchmarks/bench_batcher.py --quick    # smoke run

Flyte's batcher is used when ``import flyte.extras`` works (``pip install 'batchline[flyte]'``).

It drives the batchers in-process, not through ``batchline.bench``'s load generator: what it
compares is batcher implementations (Flyte's among them), not a model target.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from batchline import DynamicBatcher

Factory = Callable[..., Any]


class TimeoutBatcher:
    """The classic shape: collect up to N records or wait T seconds, then run the batch."""

    def __init__(
        self,
        process_fn: Callable[[list[Any]], Awaitable[Sequence[Any]]],
        *,
        max_batch_size: int = 64,
        batch_timeout_s: float = 0.05,
        max_queue_size: int = 5_000,
        **_: Any,
    ) -> None:
        self._fn = process_fn
        self._n = max_batch_size
        self._t = batch_timeout_s
        self._queue: asyncio.Queue[tuple[Any, asyncio.Future[Any]]] = asyncio.Queue(max_queue_size)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> TimeoutBatcher:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._queue.join()
        assert self._task is not None
        self._task.cancel()

    async def submit(self, record: Any, **_: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self._queue.put((record, fut))
        return fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self._t
            while len(batch) < self._n:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                except TimeoutError:
                    break
            results = await self._fn([r for r, _ in batch])
            for (_, fut), res in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(res)
                self._queue.task_done()


def implementations() -> dict[str, Factory]:
    impls: dict[str, Factory] = {"batchline": DynamicBatcher, "timeout": TimeoutBatcher}
    try:
        from flyte.extras import DynamicBatcher as FlyteBatcher

        impls["flyte"] = FlyteBatcher
    except ImportError:
        pass
    return impls


async def identity(batch: list[Any]) -> list[Any]:
    return batch


async def overhead(factory: Factory, n: int) -> float:
    """Records/s through an identity process_fn with 8 producers."""
    per = n // 8

    async def produce(b: Any) -> None:
        # submit everything, then collect: awaiting a finished future does not suspend, so
        # the harness adds almost nothing per record (a gather over every future would)
        futures = [await b.submit(i) for i in range(per)]
        for f in futures:
            await f

    async with factory(identity, max_batch_size=64, target_batch_cost=64) as b:
        start = time.perf_counter()
        await asyncio.gather(*(produce(b) for _ in range(8)))
        elapsed = time.perf_counter() - start
    return per * 8 / elapsed


async def idle_latency(factory: Factory, n: int) -> tuple[float, float]:
    """Median submit-to-result latency of lone records, and the process time alone."""
    process_s = 0.001

    async def sleepy(batch: list[Any]) -> list[Any]:
        await asyncio.sleep(process_s)
        return batch

    latencies = []
    bare = []
    async with factory(sleepy, batch_timeout_s=0.05, max_batch_size=64) as b:
        for i in range(n):
            t0 = time.perf_counter()
            await sleepy([i])
            bare.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await (await b.submit(i))
            latencies.append(time.perf_counter() - t0)
    return statistics.median(latencies), statistics.median(bare)


def device_time(n: int) -> float:
    return 0.002 + 0.00005 * n


def device(batch: list[Any]) -> list[Any]:
    time.sleep(device_time(len(batch)))
    return batch


async def in_thread(batch: list[Any]) -> list[Any]:
    return await asyncio.to_thread(device, batch)


async def closed_loop(factory: Factory, seconds: float, *, sync_fn: bool = False) -> float:
    """Records/s with 8 producers, each awaiting its own result before the next submit.

    The device runs in a thread: through ``asyncio.to_thread`` in an async process_fn (what
    Flyte needs), or, with ``sync_fn``, as a sync process_fn in batchline's own worker thread.
    """

    done = 0
    stop_at = 0.0

    async def produce(b: Any) -> None:
        nonlocal done
        i = 0
        while time.perf_counter() < stop_at:
            await (await b.submit(i))
            done += 1
            i += 1

    fn = device if sync_fn else in_thread
    async with factory(fn, max_batch_size=64, batch_timeout_s=0.05) as b:
        stop_at = time.perf_counter() + seconds
        start = time.perf_counter()
        await asyncio.gather(*(produce(b) for _ in range(8)))
        elapsed = time.perf_counter() - start
    return done / elapsed


async def bare_minimum_loop(seconds: float) -> float:
    """The closed loop through the least a batcher can do: a list, an event, one worker thread.

    No budget, no stats, no cancellation: a floor for what asyncio plus a worker thread costs
    per batch on this machine, so batchline's closed-loop figure can be read against it.
    """
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pending: list[asyncio.Future[None]] = []
    ready = asyncio.Event()
    done = 0
    stop_at = time.perf_counter() + seconds

    async def produce() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            fut = loop.create_future()
            pending.append(fut)
            ready.set()
            await fut
            done += 1

    async def dispatch() -> None:
        while True:
            await ready.wait()
            ready.clear()
            if not pending:
                continue
            batch = pending[:]
            pending.clear()
            await loop.run_in_executor(pool, device, batch)
            for fut in batch:
                fut.set_result(None)

    dispatcher = asyncio.create_task(dispatch())
    start = time.perf_counter()
    await asyncio.gather(*(produce() for _ in range(8)))
    elapsed = time.perf_counter() - start
    dispatcher.cancel()
    pool.shutdown()
    return done / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--records", type=int, default=200_000)
    args = parser.parse_args()
    n = 20_000 if args.quick else args.records
    lat_n = 30 if args.quick else 200
    loop_s = 1.0 if args.quick else 5.0
    impls = implementations()

    print(f"implementations: {', '.join(impls)}")
    print(f"\n1. overhead: {n} records, identity process_fn, 8 producers, max_batch_size=64")
    rates = {name: asyncio.run(overhead(f, n)) for name, f in impls.items()}
    for name, rate in rates.items():
        print(f"   {name:10s} {rate:12,.0f} records/s")
    for other in rates:
        if other != "batchline":
            print(f"   batchline / {other}: x{rates['batchline'] / rates[other]:.2f}")

    print(f"\n2. idle latency: {lat_n} lone records, batch_timeout_s=0.05, process time 1 ms")
    for name, f in impls.items():
        med, bare = asyncio.run(idle_latency(f, lat_n))
        print(
            f"   {name:10s} median {med * 1e3:7.2f} ms  process alone {bare * 1e3:.2f} ms"
            f"  overhead {(med - bare) * 1e3:+.2f} ms"
        )

    bound = 8 / device_time(8)
    print(f"\n3. closed loop: 8 producers, simulated device, {loop_s:.0f} s each")
    print(f"   device bound: {bound:,.0f} records/s")
    loop_rates = {name: asyncio.run(closed_loop(f, loop_s)) for name, f in impls.items()}
    loop_rates["batchline (sync fn)"] = asyncio.run(
        closed_loop(DynamicBatcher, loop_s, sync_fn=True)
    )
    loop_rates["bare minimum"] = asyncio.run(bare_minimum_loop(loop_s))
    for name, rate in loop_rates.items():
        print(f"   {name:20s} {rate:10,.0f} records/s  ({rate / bound:.2f} of the bound)")
    for other in ("timeout", "flyte"):
        if other in loop_rates:
            ratio = loop_rates["batchline"] / loop_rates[other]
            print(f"   batchline / {other}: x{ratio:.1f}")
    t0 = time.perf_counter()
    for _ in range(200):
        device([0] * 8)
    real = (time.perf_counter() - t0) / 200
    floor = loop_rates["bare minimum"]
    print(f"   batchline (sync fn) / bare minimum: {loop_rates['batchline (sync fn)'] / floor:.2f}")
    print(
        f"   (time.sleep overshoots here: a nominal {device_time(8) * 1e3:.2f} ms device call "
        f"takes {real * 1e3:.2f} ms, so the reachable bound is {8 / real / bound:.2f})"
    )


if __name__ == "__main__":
    main()
