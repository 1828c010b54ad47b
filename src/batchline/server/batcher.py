"""The server's batcher: one :class:`~batchline.models.batching.ModelBatcher` per served batch
model, whose records are :class:`Job` s, and the :class:`BatchHook` it calls around every model
call (the Prometheus metrics and the tracing marks, :class:`Metering`).

A job is an item the model prepared, with what the server wants to know of it once it runs: its
cost, when it was queued and at which priority (the queue-wait histogram), and the batch it went
in (tracing). The batcher takes the jobs' items out to call the model; the model never sees a
job, and the hook never touches the model. The core batcher (:mod:`batchline._batcher`) has no
callback of its own, and needs none: the hook is called here, by the process function this
wrapper hands it.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar, cast

from batchline._device import Device
from batchline.knobs import Knobs
from batchline.models.batching import ModelBatcher
from batchline.models.protocol import BatchModel, ModelInfo
from batchline.server.metrics import ModelMetrics
from batchline.server.tracing import mark_batch

if TYPE_CHECKING:
    import asyncio

    from batchline._batcher import DynamicBatcher
    from batchline._stats import BatchStats
    from batchline.server.tracing import BatchMark

__all__ = ["BatchHook", "Job", "Metering", "ServedBatcher"]

P = TypeVar("P")
R = TypeVar("R")


@dataclass(slots=True)
class Job(Generic[P]):
    """A queued item, its cost, when it was queued and at which priority (for the queue-wait
    histogram)."""

    item: P
    cost: int
    submitted: float
    priority: int = 0
    batch: BatchMark | None = None
    """The :class:`~batchline.server.tracing.BatchMark` of the batch it went in (tracing on)."""


class BatchHook(Protocol):
    """What :class:`ServedBatcher` calls around each model call, on the thread that makes it
    (a worker thread for a sync model: an implementation must be thread-safe)."""

    def batch_started(self, jobs: Sequence[Job[Any]]) -> float:
        """The batch is about to run; the start time that :meth:`batch_done` is given."""
        ...

    def batch_done(self, jobs: Sequence[Job[Any]], started: float) -> None:
        """The model call returned its results (not called when it raised)."""
        ...


class Metering:
    """The server's :class:`BatchHook`: per-model Prometheus metrics (queue wait by priority,
    batch duration, size and cost; prometheus-client metrics are thread-safe) and, with
    tracing on, each job stamped with its batch (:func:`batchline.server.tracing.mark_batch`)."""

    def __init__(self, metrics: ModelMetrics, *, padded: bool, traced: bool) -> None:
        self._metrics = metrics
        self._padded = padded
        self._traced = traced

    def batch_started(self, jobs: Sequence[Job[Any]]) -> float:
        started = time.perf_counter()
        wait = self._metrics.queue_wait
        for job in jobs:
            wait(job.priority).observe(started - job.submitted)
        return started

    def batch_done(self, jobs: Sequence[Job[Any]], started: float) -> None:
        costs = [j.cost for j in jobs]
        self.observe(started, costs)
        if self._traced:
            mark_batch(jobs, started, costs, padded=self._padded)

    def observe(self, started: float, costs: list[int]) -> None:
        """One model call's duration, size and cost (padded: rows x the costliest row); the
        baseline, which has no queue, calls this alone."""
        m = self._metrics
        m.batch_duration.observe(time.perf_counter() - started)
        m.batch_size.observe(len(costs))
        m.batch_cost.observe(len(costs) * max(costs) if self._padded else sum(costs))


class _Calls(NamedTuple):
    """What :class:`~batchline.models.batching.ModelBatcher` reads of the model it batches:
    its ``info``, each record's ``cost`` and the call on a batch (``run_batch``); here the
    records are jobs."""

    info: ModelInfo
    cost: Callable[[Job[Any]], int]
    run_batch: Callable[[list[Job[Any]]], Any]


def _job_cost(job: Job[Any]) -> int:
    return job.cost


class ServedBatcher(Generic[P, R]):
    """A served model's one batcher: jobs in, the model's results out, ``hook`` called around
    each model call. Every option but ``model`` and ``hook`` is
    :class:`~batchline.models.batching.ModelBatcher`'s."""

    def __init__(
        self,
        model: BatchModel[P, R],
        knobs: Knobs,
        hook: BatchHook,
        *,
        padding_slack: int,
        bucket_width: int,
        thread_nice: int,
        name: str,
        device: Device | None,
        weight: float,
    ) -> None:
        self._model = model
        self._hook = hook
        run = self._run_async if inspect.iscoroutinefunction(model.run_batch) else self._run
        calls = _Calls(model.info, _job_cost, run)
        self._engine: ModelBatcher[Job[P], R] = ModelBatcher(
            cast(BatchModel[Job[P], R], calls),  # it reads only info, cost and run_batch
            knobs,
            padding_slack=padding_slack,
            bucket_width=bucket_width,
            thread_nice=thread_nice,
            name=name,
            device=device,
            weight=weight,
        )

    def _run(self, jobs: list[Job[P]]) -> Sequence[R]:
        started = self._hook.batch_started(jobs)
        results = cast(Sequence[R], self._model.run_batch([j.item for j in jobs]))
        self._hook.batch_done(jobs, started)
        return results

    async def _run_async(self, jobs: list[Job[P]]) -> Sequence[R]:
        started = self._hook.batch_started(jobs)
        call = cast(Awaitable[Sequence[R]], self._model.run_batch([j.item for j in jobs]))
        results = await call
        self._hook.batch_done(jobs, started)
        return results

    @property
    def batcher(self) -> DynamicBatcher[Job[P], R]:
        return self._engine.batcher

    @property
    def stats(self) -> BatchStats:
        return self._engine.stats

    async def start(self) -> None:
        await self._engine.start()

    async def stop(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        await self._engine.stop(drain=drain, timeout_s=timeout_s)

    def submit_many_nowait(
        self, jobs: Sequence[Job[P]], *, priority: int = 0
    ) -> list[asyncio.Future[R]]:
        """Queue every job or none (``QueueFullError``), at ``priority``."""
        return self._engine.submit_many_nowait(jobs, priority=priority)
