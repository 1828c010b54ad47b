"""The model replicas of ``batchline run --engine ray``: Ray actors that run a job's records.

A replica holds the job's models and runs each unit of records it is sent through the same
adapter a local run uses (``batchline.jobs``), so a record's outcome does not depend on the
engine:

- ``batch`` (embed, classify, predict, score): a :class:`~batchline.jobs.batch.BatchAdapter`
  over the model's batcher (duplicates inside the replica's window are computed once); for an
  image model, a :class:`~batchline.jobs.images.ImageAdapter` whose decode processes run on
  the replica (a unit carries where its pictures are, never their pixels);
- ``generate``: the model's text generator, continuous batching (or vLLM), each record its own
  request (:class:`~batchline.jobs.generate.GeneratorAdapter`);
- ``openai-batch``: the lines of an OpenAI batch file, each to the model its ``body.model``
  picks (:class:`~batchline.jobs.openai_batch.LinesAdapter`).

Units in flight on one replica share its batches (its running batch, for a generator). What
it answers besides the outcomes (where it runs, its CPU time, its batcher's or generator's
stats) is for the driver's summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import ray

from batchline._stats import BatchStats
from batchline.datasets.outcomes import Outcome
from batchline.datasets.pipeline import Adapter
from batchline.datasets.sources import Record
from batchline.jobs.options import GenerateOptions, RunOptions
from batchline.knobs import Knobs
from batchline.models.protocol import ModelInfo

if TYPE_CHECKING:
    from batchline.jobs.batch import BatchAdapter
    from batchline.jobs.generate import GeneratorAdapter
    from batchline.jobs.images import ImageAdapter
    from batchline.jobs.openai_batch import BatchJobModels
    from batchline.jobs.requests import RecordRequests
    from batchline.models.batching import ModelBatcher
    from batchline.models.generation import GenerationModel, GenerationStats
    from batchline.models.protocol import BatchModel
    from batchline.models.specs import ModelSpec

__all__ = ["RemoteJob", "Replica", "ReplicaReady", "UnitResult", "knobs_for_cpus"]


class _Closable(Protocol):
    def close(self) -> None: ...


@dataclass(frozen=True)
class RemoteJob:
    """What every replica of a job runs (sent to each actor once, when it starts).

    ``kind`` is the job's (:func:`batchline.jobs.job.resolve_job`); ``options`` its resolved
    options: ``RunOptions`` for a batch model's (``dataset``, ``images``), a
    ``GenerateOptions`` for the others (an OpenAI batch file's job options); ``requests`` how a
    ``generate`` job reads its records; ``specs`` an OpenAI batch job's models."""

    kind: str
    options: RunOptions
    requests: RecordRequests | None = None
    specs: tuple[ModelSpec, ...] = ()


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
    stats: BatchStats | None = None  # its batch model's batcher (cumulative, per process)
    generation: GenerationStats | None = None  # its generator's (cumulative, per process)
    # its generator's settings and the peaks seen in its stats
    max_running: int = 0
    in_flight: int = 0
    batching: str = ""
    dtype: str = ""
    running_peak: int = 0
    waiting_peak: int = 0
    kv_reserved_peak: int = 0
    duplicates: int = 0
    tokens: int = 0  # completion tokens its generator computed (cumulative, per process)


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
    """One replica (the class a Ray actor runs): loads the job's models when created, starts
    their batchers or generator on its first unit, and runs each unit it is sent."""

    def __init__(self, job: RemoteJob, knobs: Knobs) -> None:
        self._job = job
        self._knobs = knobs
        self._node_id: str = ray.get_runtime_context().get_node_id()
        self._stack = contextlib.AsyncExitStack()
        self._started: asyncio.Future[Adapter] | None = None
        # what runs the units, once started: a batch job's adapter, a generator's, the
        # batchers of an OpenAI batch job's batch models
        self._batch: BatchAdapter | ImageAdapter | None = None
        self._generator: GeneratorAdapter | None = None
        self._engines: dict[str, ModelBatcher[object, object]] = {}
        self._closers: list[_Closable] = []
        self._precision = ""
        self._info, self._max_running, self._in_flight = self._load()

    def _load(self) -> tuple[ModelInfo, int, int]:
        job, knobs = self._job, self._knobs
        if job.kind in ("dataset", "images"):
            from batchline.jobs.run import load_job_model

            model, self._precision = load_job_model(job.options, knobs.for_loading())
            self._model: BatchModel[object, object] = model
            self._closers.append(self._model)
            return self._model.info, 0, 0
        from batchline.jobs.generate import in_flight_limit

        options = job.options
        assert isinstance(options, GenerateOptions)
        info = ModelInfo(name=options.model, task="generate")
        if job.kind == "generate":
            from batchline.models.generation import load_text_generator

            assert options.spec is not None
            self._generation: GenerationModel = load_text_generator(options.spec, knobs)
            self._closers.append(self._generation)
            return info, self._generation.max_running, in_flight_limit(self._generation)
        from batchline.jobs.openai_batch import load_batch_models

        self._models: BatchJobModels = load_batch_models(job.specs, knobs)
        self._closers.append(self._models)
        generator = self._models.generator
        if generator is None:
            return info, 0, 0
        return info, generator.max_running, in_flight_limit(generator)

    async def ready(self) -> ReplicaReady:
        """Where it runs and what it holds, once its models are loaded."""
        return ReplicaReady(
            self._node_id,
            os.getpid(),
            time.process_time(),
            self._info,
            self._max_running,
            self._in_flight,
            self._precision,
        )

    async def process(self, records: list[Record]) -> UnitResult:
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        adapter = await self._started
        outcomes = await (await adapter.submit(records))
        return self._result(list(outcomes))

    async def _start(self) -> Adapter:
        job, stack = self._job, self._stack
        if job.kind in ("dataset", "images"):
            from batchline.jobs.job import Job
            from batchline.jobs.run import job_adapter
            from batchline.models.batching import ModelBatcher

            engine = await stack.enter_async_context(
                ModelBatcher(self._model, self._knobs.for_loading())
            )
            # an image job's pictures are read and decoded here, on the replica that runs the
            # model (in its own decode processes, as a local run's): decoded pixels never
            # cross the network
            self._batch = await stack.enter_async_context(
                job_adapter(Job(job.kind, job.options), self._model, engine)
            )
            return self._batch
        from batchline.jobs.batch import DEDUPE_WINDOW
        from batchline.jobs.generate import running_generator

        options = job.options
        assert isinstance(options, GenerateOptions)
        if job.kind == "generate":
            assert job.requests is not None
            self._generator = await stack.enter_async_context(
                running_generator(
                    self._generation,
                    job.requests,
                    None,
                    dedupe_window=DEDUPE_WINDOW if options.dedupe else 0,
                )
            )
            return self._generator
        from batchline.jobs.openai_batch import LinesAdapter, started_batch_models

        self._generator, engines = await stack.enter_async_context(
            started_batch_models(self._models, options, None)
        )
        self._engines = dict(engines)
        return LinesAdapter(self._models.names, self._generator, engines)

    def _result(self, outcomes: list[Outcome]) -> UnitResult:
        where = (outcomes, self._node_id, os.getpid(), time.process_time())
        batch = self._batch
        engine = (
            batch.engine
            if batch is not None
            else self._engines.get("embed", self._engines.get("score"))
        )
        stats = engine.stats if engine is not None else None
        duplicates = batch.duplicates if batch is not None else 0
        gen = self._generator
        if gen is None:
            return UnitResult(*where, stats=stats, duplicates=duplicates)
        gen.sample()
        return UnitResult(
            *where,
            stats=stats,
            generation=gen.gen.stats,
            max_running=gen.model.max_running,
            in_flight=gen.limit,
            batching=gen.model.batching,
            dtype=gen.model.dtype,
            running_peak=gen.peaks.running,
            waiting_peak=gen.peaks.waiting,
            kv_reserved_peak=gen.peaks.kv_reserved,
            duplicates=duplicates + gen.duplicates,
            tokens=gen.tokens,
        )

    async def stop(self) -> None:
        """Stop the batchers and generator (draining), then free the models."""
        await self._stack.aclose()
        for model in self._closers:
            model.close()
