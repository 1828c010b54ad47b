"""``batchline run --engine ray``: the offline job, its model replicas spread over a Ray cluster.

The layout::

    driver process (this one)                              Ray actors, one per replica
    ─────────────────────────                              ───────────────────────────
    open_source ──(skips committed_ranges())──> units ──inputs─> _Replica: loads the model once,
      │                                          │                its ModelBatcher -> the model
      │ bad records                  ray.wait <──┘<──results────
      ▼                                  │
    ChunkWriter + _manifest.json <───────┘   the single writer: every chunk committed exactly once

The driver runs the same dataset pipeline as ``batchline run`` (``batchline.datasets.pipeline``),
with :class:`RayAdapter` sending units to the replicas, so the output directory is the same as a
local run's (same chunks, same manifest settings): a job started locally can be resumed on Ray
and the other way round. Only the model runs remotely; records, ids and copied columns never
leave the driver.

Work units lie inside one output chunk (a whole chunk, several whole chunks, or an equal slice of
one), never across a chunk boundary: a resumed run skips whole committed chunks and re-sends the
rest. Each replica has at most ``units_per_replica`` units in flight, which bounds the driver's
memory. A replica whose process dies is restarted by Ray (``max_restarts``) and its unfinished
units are retried on it (``max_task_retries``); a unit whose replica is gone for good is sent to
another replica. Results are written only by the driver, once per unit, so no record is lost or
written twice whatever fails.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from batchline._errors import BatchlineError, InputError, ModelError
from batchline._stats import BatchStats, percentile
from batchline.datasets.outcomes import Outcome, Written
from batchline.datasets.pipeline import PipelineRun, Progress, run_pipeline
from batchline.datasets.sources import Record
from batchline.integrations.session import check_reachable, last_line, ray_session
from batchline.jobs.batch import process_block
from batchline.jobs.options import RunOptions
from batchline.jobs.run import RunSummary, load_job_model, open_job
from batchline.knobs import Knobs
from batchline.models.batching import ModelBatcher
from batchline.models.protocol import ModelInfo

__all__ = ["RayAdapter", "RaySummary", "UnitDone", "default_replica_knobs", "run_on_ray"]

logger = logging.getLogger(__name__)

#: Records per work unit when ``unit_records`` is not given: about 1-2 s of one replica's work
#: on a 2-core machine, so a lost unit costs little and the last units leave no replica idle long.
DEFAULT_UNIT_RECORDS = 256
_READ_BLOCK = 1024
# Object store of a Ray instance started here: units are small (256 x 384 float32 = 0.4 MB).

# Failures of the machinery, not of the unit's records: the unit is sent again.
_LOST = (
    ray.exceptions.RayActorError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.WorkerCrashedError,
)


# -- public types --------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnitDone:
    """One unit's results, just written by the driver (passed to ``run_on_ray(on_unit=...)``)."""

    first_index: int
    records: int
    replica: int
    node_id: str
    pid: int
    attempt: int
    round_trip_s: float


@dataclass(frozen=True)
class RaySummary(RunSummary):
    """``RunSummary`` plus where the work ran.

    ``records_by_node`` maps each Ray node id to the records its replicas embedded in this run;
    ``replica_restarts`` counts replica processes that Ray replaced (seen as a new pid);
    ``resubmitted_units`` counts units sent again after their replica was lost for good;
    ``replica_cpu_s`` is the CPU time the replica processes spent on this run's units
    (``replica_cpu_s / wall_s`` is the number of cores they got).
    """

    replicas: int = 0
    records_by_node: Mapping[str, int] = field(default_factory=dict)
    units: int = 0
    resubmitted_units: int = 0
    replica_restarts: int = 0
    startup_s: float = 0.0
    replica_cpu_s: float = 0.0

    @property
    def nodes(self) -> tuple[str, ...]:
        """Ids of the Ray nodes that embedded records in this run, sorted."""
        return tuple(sorted(self.records_by_node))

    @property
    def cores_used(self) -> float:
        """Cores the replicas kept busy on average: ``replica_cpu_s / wall_s``."""
        return self.replica_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def rows(self) -> list[tuple[str, str]]:
        rows = super().rows()
        by_node = ", ".join(f"{n[:8]}: {c:,}" for n, c in sorted(self.records_by_node.items()))
        return [
            *rows[:2],
            ("engine", f"ray: {self.replicas} replica(s) on {len(self.nodes)} node(s)"),
            ("records by node", by_node or "-"),
            ("units (resubmitted)", f"{self.units:,} ({self.resubmitted_units})"),
            ("replica restarts", str(self.replica_restarts)),
            ("ray start-up", f"{self.startup_s:.1f} s"),
            ("replica CPU", f"{self.replica_cpu_s:.1f} s ({self.cores_used:.1f} cores)"),
            *rows[2:],
        ]


def default_replica_knobs(knobs: Knobs) -> Knobs:
    """The default knobs of one replica: ``knobs`` with one session of one intra-op thread.

    Two such replicas fill a 2-core node; on bigger nodes, run more replicas (``--replicas``)
    rather than more threads per replica.
    """
    return knobs.replace(sessions=1, intra_op_threads=1, max_concurrent_batches=1)


# -- the replica (a Ray actor) -------------------------------------------------------------------


@dataclass(frozen=True)
class _UnitResult:
    outcomes: list[Outcome]  # one per record of the unit, in order
    node_id: str
    pid: int
    cpu_s: float  # the replica process's CPU time so far
    stats: BatchStats


@dataclass(frozen=True)
class _Ready:
    node_id: str
    pid: int
    cpu_s: float
    info: ModelInfo


class _Replica:
    """One model replica: loads the model once, then runs each unit it is sent through the
    engine's batcher (units in flight at once share its batches)."""

    def __init__(self, options: RunOptions, knobs: Knobs) -> None:
        self._engine: ModelBatcher[Any, Any] = ModelBatcher(load_job_model(options, knobs), knobs)
        self._node_id: str = ray.get_runtime_context().get_node_id()
        self._started: asyncio.Future[None] | None = None

    async def ready(self) -> _Ready:
        """Where it runs and what model it holds, once the model is loaded."""
        return _Ready(self._node_id, os.getpid(), time.process_time(), self._engine.model.info)

    async def process(self, inputs: list[object]) -> _UnitResult:
        if self._started is None:
            self._started = asyncio.ensure_future(self._engine.start())
        await self._started
        outcomes = await process_block(self._engine, inputs)
        stats = self._engine.stats
        return _UnitResult(outcomes, self._node_id, os.getpid(), time.process_time(), stats)


# -- the driver ----------------------------------------------------------------------------------


def run_from_args(
    options: RunOptions, args: argparse.Namespace, progress: Progress | None
) -> RunSummary:
    """``batchline run --engine ray``: :func:`run_on_ray` with the command's flags (explicit
    ``--sessions``/``--intra-op-threads``/``--config``/``--set`` set each replica's knobs,
    else :func:`default_replica_knobs`)."""
    own = args.config or args.set or args.sessions or args.intra_op_threads
    return run_on_ray(
        options,
        address=args.address,
        replicas=2 if args.replicas is None else args.replicas,
        replica_knobs=options.knobs if own else None,
        progress=progress,
    )


def run_on_ray(
    options: RunOptions,
    *,
    address: str | None = None,
    replicas: int = 2,
    replica_knobs: Knobs | None = None,
    cpus_per_replica: float | None = None,
    unit_records: int | None = None,
    units_per_replica: int = 2,
    max_restarts: int = 3,
    max_task_retries: int = 3,
    max_unit_attempts: int = 3,
    start_timeout_s: float = 300.0,
    progress: Progress | None = None,
    on_unit: Callable[[UnitDone], None] | None = None,
) -> RaySummary:
    """Run ``batchline run``'s job with ``replicas`` model replicas on a Ray cluster.

    The output is the same as :func:`batchline.jobs.run.run` would write for ``options``:
    exactly once, resumable (``options.resume``), and resumable by either engine.

    Args:
        address: ``None`` starts a private local Ray instance for this run (and stops it at the
            end); ``"auto"`` or ``"HOST:PORT"`` connects to a running cluster. If Ray is already
            initialised in this process, that connection is used and left open.
        replicas: model replicas (Ray actors), spread over the cluster's nodes.
        replica_knobs: batching knobs of each replica; default
            ``default_replica_knobs(options.knobs)``, one session of one intra-op thread.
        cpus_per_replica: logical CPUs each replica reserves; default its sessions x threads.
        unit_records: records per work unit (rounded so units never cross an output chunk).
        units_per_replica: units in flight per replica, so it never waits on the driver.
        max_restarts, max_task_retries: Ray restarts a dead replica and retries its units.
        max_unit_attempts: a unit whose replica is lost for good is sent to another replica, at
            most this many times in all.
        start_timeout_s: how long the replicas may take to be placed and load the model.
        progress: the job's progress hooks (the CLI's progress bar).
        on_unit: called in the driver after each unit's results are handed to the writer.

    Example::

        from batchline.jobs.run import RunOptions
        from batchline.integrations.ray import run_on_ray

        summary = run_on_ray(RunOptions(input=Path("docs.jsonl"), output=Path("out")),
                             address="auto", replicas=8)
        print(summary.records_per_s, summary.nodes)
    """
    if replicas < 1:
        raise InputError(f"--replicas must be >= 1, got {replicas}")
    if units_per_replica < 1:
        raise ValueError(f"units_per_replica must be >= 1, got {units_per_replica}")
    if max_unit_attempts < 1:
        raise ValueError(f"max_unit_attempts must be >= 1, got {max_unit_attempts}")
    if unit_records is not None and unit_records < 1:
        raise ValueError(f"unit_records must be >= 1, got {unit_records}")
    if not options.knobs.batching:
        raise InputError(
            "--no-batching is the local baseline; run it without --engine ray to compare"
        )
    if options.limit is not None and options.limit < 0:
        raise InputError(f"--limit must be >= 0, got {options.limit}")
    knobs = replica_knobs or default_replica_knobs(options.knobs)
    if cpus_per_replica is None:
        cpus_per_replica = float(knobs.sessions * knobs.intra_op_threads)
    if cpus_per_replica <= 0:
        raise ValueError(f"cpus_per_replica must be > 0, got {cpus_per_replica}")
    cpus = cpus_per_replica
    if address is not None and not ray.is_initialized():
        check_reachable(address)  # before the output directory is created
    if options.input is not None and not options.input.exists():
        raise InputError(f"{options.input}: no such file")  # before Ray starts

    t0 = time.perf_counter()
    local_cpus = max(os.cpu_count() or 1, math.ceil(replicas * cpus))
    with ray_session(address, local_cpus):
        actors = _start_replicas(
            options, knobs, replicas, cpus, max_restarts, max_task_retries, start_timeout_s
        )
        try:
            # opened as a local run opens it (the replicas say what the model writes), so
            # either engine can resume the other's output
            source, writer = open_job(options, actors[0][1].info)
            with writer:
                adapter = RayAdapter(
                    actors,
                    units_per_replica=units_per_replica,
                    max_unit_attempts=max_unit_attempts,
                    on_unit=on_unit,
                )
                plan = _UnitPlan(options.chunk_size, unit_records or DEFAULT_UNIT_RECORDS)
                done = asyncio.run(
                    run_pipeline(
                        adapter,
                        source,
                        writer,
                        block_records=_READ_BLOCK,
                        max_blocks_in_flight=replicas * units_per_replica,
                        limit=options.limit,
                        on_bad_record=options.on_bad_record,
                        progress=progress,
                        unit_of=plan.key,
                        on_written=adapter.written,
                    )
                )
                startup = time.perf_counter() - t0 - done.wall_s
                return adapter.tally.summary(writer.out_dir, done, startup)
        finally:
            for actor, _ in actors:
                ray.kill(actor, no_restart=True)


def _start_replicas(
    options: RunOptions,
    knobs: Knobs,
    replicas: int,
    cpus: float,
    max_restarts: int,
    max_task_retries: int,
    timeout_s: float,
) -> list[tuple[Any, _Ready]]:
    """Create the replicas and wait until each has loaded the model: (actor, ready())."""
    replica_class = ray.remote(_Replica).options(
        num_cpus=cpus,
        # a replica on a GPU device (knobs.device cuda[:N]) reserves one, so Ray places it on
        # a node that has one and never puts two replicas on the same GPU
        num_gpus=1 if knobs.is_gpu else 0,
        max_restarts=max_restarts,
        max_task_retries=max_task_retries,
        # One replica per node before two on any: a node's cores are what a replica uses.
        scheduling_strategy="SPREAD",
    )
    actors: list[Any] = [replica_class.remote(options, knobs) for _ in range(replicas)]
    try:
        refs = [actor.ready.remote() for actor in actors]
        _, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if waiting:
            resources = ray.cluster_resources()  # type: ignore[no-untyped-call]
            need = f"{cpus:g} CPU(s)" + (" and 1 GPU" if knobs.is_gpu else "")
            have = f"{resources.get('CPU', 0):g} CPU(s)"
            if knobs.is_gpu:
                have += f" and {resources.get('GPU', 0):g} GPU(s)"
            raise ModelError(
                f"{len(waiting)} of {replicas} replica(s) did not start within "
                f"{timeout_s:.0f} s; each needs {need} and the Ray cluster has {have} "
                "in all: lower --replicas, or add nodes"
            )
        where: list[_Ready] = ray.get(refs)
    except BaseException as exc:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if isinstance(exc, ray.exceptions.RayActorError):
            raise ModelError(f"a replica could not load the model: {last_line(exc)}") from None
        raise
    return list(zip(actors, where, strict=True))


class _UnitPlan:
    """Which unit a record index belongs to: units never cross an output chunk's boundary."""

    def __init__(self, chunk_size: int, target: int) -> None:
        self.chunk_size = chunk_size
        if target >= chunk_size:
            self._span = (target // chunk_size) * chunk_size  # whole chunks
            self._parts = 0
        else:
            self._parts = -(-chunk_size // target)  # equal slices of one chunk
            self._span = -(-chunk_size // self._parts)

    def key(self, index: int) -> int:
        if not self._parts:
            return index // self._span
        chunk, offset = divmod(index, self.chunk_size)
        return chunk * self._parts + offset // self._span


class _Tally:
    """Where the work ran, for the summary."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.units = 0
        self.resubmitted = 0
        self.latencies: list[float] = []
        self.by_node: Counter[str] = Counter()
        self.pids: list[set[int]] = [set() for _ in range(replicas)]
        # CPU time of each replica process: when it was ready (0 for a restarted one), and lately.
        self.cpu_from: dict[tuple[int, int], float] = {}
        self.cpu_to: dict[tuple[int, int], float] = {}
        # Each replica process's latest stats (they are cumulative, per process).
        self.stats: dict[tuple[int, int], BatchStats] = {}

    def merged(self) -> dict[str, float]:
        snaps = list(self.stats.values())
        busy = sum(s.busy_time_s for s in snaps)
        idle = sum(s.idle_time_s for s in snaps)
        batches = sum(s.total_batches for s in snaps)
        cost = sum(s.total_batch_cost for s in snaps)
        rows = sum(s.avg_batch_size * s.total_batches for s in snaps)
        waste = sum(s.padding_waste * s.total_batch_cost for s in snaps)
        return {
            "utilization": busy / (busy + idle) if busy + idle > 0 else 0.0,
            "avg_batch_size": rows / batches if batches else 0.0,
            "avg_batch_cost": cost / batches if batches else 0.0,
            "padding_waste": waste / cost if cost else 0.0,
        }

    def summary(self, out_dir: Path, done: PipelineRun, startup: float) -> RaySummary:
        merged = self.merged()
        return RaySummary(
            output=out_dir,
            batching=True,
            **done.counts(),
            utilization=merged["utilization"],
            avg_batch_size=merged["avg_batch_size"],
            avg_batch_cost=merged["avg_batch_cost"],
            padding_waste=merged["padding_waste"],
            latency_p50_s=percentile(self.latencies, 50),
            latency_p99_s=percentile(self.latencies, 99),
            replicas=self.replicas,
            records_by_node=dict(self.by_node),
            units=self.units,
            resubmitted_units=self.resubmitted,
            replica_restarts=sum(max(len(p) - 1, 0) for p in self.pids),
            startup_s=startup,
            replica_cpu_s=sum(t - self.cpu_from.get(k, 0.0) for k, t in self.cpu_to.items()),
        )


@dataclass(frozen=True)
class _Landed:
    """A unit's answer, until the pipeline has written it."""

    replica: int
    attempt: int
    round_trip_s: float
    result: _UnitResult


class RayAdapter:
    """:class:`~batchline.datasets.pipeline.Adapter` for model replicas on Ray: each block is
    one unit, sent to the live replica with the fewest units in flight (at most
    ``units_per_replica`` each). A unit whose replica is lost (Ray has already restarted and
    retried it up to its limits) is sent to another replica, at most ``max_unit_attempts``
    times in all."""

    def __init__(
        self,
        actors: Sequence[tuple[Any, _Ready]],
        *,
        units_per_replica: int,
        max_unit_attempts: int,
        on_unit: Callable[[UnitDone], None] | None = None,
    ) -> None:
        self.actors = [actor for actor, _ in actors]
        self.units_per_replica = units_per_replica
        self.max_unit_attempts = max_unit_attempts
        self.on_unit = on_unit
        self.tally = _Tally(len(self.actors))
        for i, (_, ready) in enumerate(actors):
            self.tally.pids[i].add(ready.pid)
            self.tally.cpu_from[(i, ready.pid)] = ready.cpu_s
        self.alive = [True] * len(self.actors)
        self.load = [0] * len(self.actors)
        self._freed = asyncio.Condition()
        self._landed: dict[int, _Landed] = {}  # by the unit's first record index

    async def submit(self, records: Sequence[Record]) -> asyncio.Future[list[Outcome]]:
        replica = await self._acquire()
        return asyncio.ensure_future(self._unit(records, replica))

    def utilization(self) -> float:
        return self.tally.merged()["utilization"]

    def written(self, records: Sequence[Record], done: Written) -> None:
        """After the pipeline wrote a unit: count it where it ran, and call ``on_unit``."""
        landed = self._landed.pop(records[0].index)
        result, tally = landed.result, self.tally
        tally.units += 1
        tally.latencies.extend([landed.round_trip_s] * done.written)
        tally.by_node[result.node_id] += done.written
        if self.on_unit is not None:
            self.on_unit(
                UnitDone(
                    first_index=records[0].index,
                    records=len(records),
                    replica=landed.replica,
                    node_id=result.node_id,
                    pid=result.pid,
                    attempt=landed.attempt,
                    round_trip_s=landed.round_trip_s,
                )
            )

    async def _acquire(self) -> int:
        """The live replica with the fewest units in flight, once one can take another."""
        async with self._freed:
            while True:
                if not any(self.alive):
                    raise ModelError(
                        "every replica is gone (see the Ray logs for why); committed chunks "
                        "are kept: rerun with --resume to continue"
                    )
                free = [
                    i
                    for i, alive in enumerate(self.alive)
                    if alive and self.load[i] < self.units_per_replica
                ]
                if free:
                    best = min(free, key=lambda i: self.load[i])
                    self.load[best] += 1
                    return best
                await self._freed.wait()

    async def _release(self, replica: int) -> None:
        async with self._freed:
            self.load[replica] -= 1
            self._freed.notify_all()

    async def _unit(self, records: Sequence[Record], replica: int) -> list[Outcome]:
        inputs = [r.input for r in records]
        attempt = 0
        while True:
            attempt += 1
            if attempt > 1:
                replica = await self._acquire()  # the last one lost the unit
            sent = time.perf_counter()
            try:
                result: _UnitResult = await self.actors[replica].process.remote(inputs)
            except _LOST as exc:
                self._lost(records, replica, attempt, exc)  # raises once the unit is given up
                continue
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, BatchlineError):
                    raise cause from None
                raise
            finally:
                await self._release(replica)
            tally = self.tally
            tally.pids[replica].add(result.pid)
            tally.cpu_to[(replica, result.pid)] = result.cpu_s
            tally.stats[(replica, result.pid)] = result.stats
            round_trip = time.perf_counter() - sent
            self._landed[records[0].index] = _Landed(replica, attempt, round_trip, result)
            return result.outcomes

    def _lost(self, records: Sequence[Record], replica: int, attempt: int, exc: Exception) -> None:
        lo, hi = records[0].index, records[-1].index
        if isinstance(exc, ray.exceptions.RayActorError) and exc.actor_init_failed:
            raise ModelError(f"a replica could not load the model: {last_line(exc)}") from None
        if isinstance(exc, ray.exceptions.ActorDiedError):
            # Ray has already restarted it and retried up to its limits: it is gone for good.
            self.alive[replica] = False
        if attempt >= self.max_unit_attempts:
            raise ModelError(
                f"records {lo}..{hi} were lost {attempt} times, last: {last_line(exc)}; "
                "committed chunks are kept: rerun with --resume to continue"
            ) from None
        logger.warning(
            "replica %d lost records %d..%d (%s); sending them again",
            replica,
            lo,
            hi,
            type(exc).__name__,
        )
        self.tally.resubmitted += 1
