"""The model replicas of ``batchline run --engine ray``: Ray actors that run a job's records.

A replica is sent its job's work (:attr:`batchline.jobs.job.RayPlan.work`, from the job's
kind) and calls it once, with its knobs, to load the job's models there
(:class:`~batchline.jobs.job.ReplicaWork`); on its first unit it starts them and runs each
unit through the adapter they give, the same adapter a local run uses (``batchline.jobs``),
so a record's outcome does not depend on the engine. What a kind's work holds:

- ``dataset`` and ``images``: a batch model's batcher, through a
  :class:`~batchline.jobs.batch.BatchAdapter`, or for pictures an
  :class:`~batchline.jobs.images.ImageAdapter` whose decode processes run on the replica (a
  unit carries where its pictures are, never their pixels);
- ``generate``: the model's text generator, continuous batching (or vLLM), each record its own
  request (:class:`~batchline.jobs.generate.GeneratorAdapter`);
- ``openai-batch``: the lines of an OpenAI batch file, each to the model its ``body.model``
  picks (:class:`~batchline.jobs.openai_batch.LinesAdapter`).

Units in flight on one replica share its batches (its running batch, for a generator). What
it answers besides the outcomes (where it runs, its CPU time, its work's figures) is for the
driver's summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from batchline.datasets.outcomes import Outcome
from batchline.datasets.pipeline import Adapter
from batchline.datasets.sources import Record
from batchline.jobs.job import ReplicaWork, WorkFigures
from batchline.models.config import Knobs
from batchline.models.protocol import ModelInfo

__all__ = ["Replica", "ReplicaReady", "UnitResult", "knobs_for_cpus"]


@dataclass(frozen=True)
class ReplicaReady:
    """A replica that has loaded its models: where it runs, and what it can take."""

    node_id: str
    pid: int
    cpu_s: float
    #: the batch model's info (``batch`` jobs); a generator's has task ``generate``
    info: ModelInfo
    #: a generator's running cap (sequences decoded at once, within its KV budget) and the
    #: records it takes in flight (its waiting queue included); 0 for a batch model
    max_running: int = 0
    in_flight: int = 0
    #: what its batch model computes in and why (``Knobs.precision``; "" where it does not apply)
    precision: str = ""


@dataclass(frozen=True)
class UnitResult:
    """One unit's outcomes (one per record, in order) and the replica's state after it."""

    outcomes: list[Outcome]
    node_id: str
    pid: int
    cpu_s: float  # the replica process's CPU time so far
    #: its work's figures: batcher and generator stats (cumulative, per process), settings
    figures: WorkFigures = field(default_factory=WorkFigures)


def knobs_for_cpus(knobs: Knobs, cpus: float) -> Knobs:
    """A replica's knobs: on CPU, its threads follow the CPUs Ray reserved for it (one session
    of ``cpus`` intra-op threads) unless ``knobs`` already split them."""
    if knobs.is_gpu:
        return knobs.replace(max_concurrent_batches=1)
    threads = max(1, int(cpus))
    if knobs.sessions * knobs.intra_op_threads == threads:
        return knobs
    return knobs.replace(sessions=1, intra_op_threads=threads, max_concurrent_batches=1)


class Replica:
    """One replica (the class a Ray actor runs): loads the job's models when created (its
    kind's ``work``), starts them on its first unit, and runs each unit it is sent."""

    def __init__(self, work: Callable[[Knobs], ReplicaWork], knobs: Knobs) -> None:
        self._node_id: str = ray.get_runtime_context().get_node_id()
        self._stack = contextlib.AsyncExitStack()
        self._started: asyncio.Future[Adapter] | None = None
        self._work = work(knobs)

    async def ready(self) -> ReplicaReady:
        """Where it runs and what it holds, once its models are loaded."""
        work = self._work
        return ReplicaReady(
            self._node_id,
            os.getpid(),
            time.process_time(),
            work.info,
            work.max_running,
            work.in_flight,
            work.precision,
        )

    async def process(self, records: list[Record]) -> UnitResult:
        if self._started is None:
            self._started = asyncio.ensure_future(self._work.start(self._stack))
        adapter = await self._started
        outcomes = await (await adapter.submit(records))
        return UnitResult(
            list(outcomes),
            self._node_id,
            os.getpid(),
            time.process_time(),
            self._work.figures(),
        )

    async def stop(self) -> None:
        """Stop the batchers and generator (draining), then free the models."""
        await self._stack.aclose()
        self._work.close()
