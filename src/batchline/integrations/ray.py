"""``batchline run --engine ray``: the offline job, its model replicas spread over a Ray cluster.

The layout::

    driver process (this one)                              Ray actors, one per replica
    ─────────────────────────                              ───────────────────────────
    open_source ──(skips committed_ranges())──> units ──records─> Replica: loads the job's
      │                                          │                 models once, runs each unit
      │ bad records                  ray.wait <──┘<──outcomes───   through the local adapter
      ▼                                  │
    ChunkWriter + _manifest.json <───────┘   the single writer: every chunk committed exactly once

Every job kind with a Ray plan (``JobKind.plan_ray``, :mod:`batchline.jobs.kinds`) runs so:
a batch model's over a dataset or pictures (a batch model per replica), text generation (a
generator per replica, its own continuous batching, on the torch engine or vLLM) and OpenAI
batch files (each replica holds the file's models). The plan says what each replica loads,
how the output opens and how the driver dedupes; the driver itself never asks what kind of
job it runs. The driver runs the same
dataset pipeline as ``batchline run`` (``batchline.datasets.pipeline``) with
:class:`~batchline.integrations.ray_units.RayAdapter` sending units to the replicas, and
opens the output as a local run opens it (same chunks, same manifest settings): a job started
locally can be resumed on Ray and the other way round. Copied columns never leave the driver.

Work units lie inside one output chunk (a whole chunk, several whole chunks, or an equal slice
of one), never across a chunk boundary: a resumed run skips whole committed chunks and re-sends
the rest. A batch model's replica has ``units_per_replica`` units in flight; a generator's has
as many as keep its running batch and the queue behind it full (its in-flight cap, sized to
its KV budget). Faults (a replica that dies, a record that kills replicas) are handled as
:mod:`batchline.integrations.ray_units` says; results are written only by the driver, once
per record, so no record is lost or written twice whatever fails.

On CPU, each replica runs one session of as many threads as CPUs it reserves
(``--cpus-per-replica``, default 1): on a node of C cores, replicas x CPUs per replica = C.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from batchline._errors import InputError, ModelError
from batchline._stats import percentile
from batchline.datasets.pipeline import PipelineRun, Progress, run_pipeline
from batchline.integrations.ray_replica import Replica, ReplicaReady, knobs_for_cpus
from batchline.integrations.ray_units import RayAdapter, Tally, UnitDone, UnitPlan
from batchline.integrations.session import check_reachable, last_line, ray_session
from batchline.jobs.job import Job, RayPlan, ReplicaWork
from batchline.jobs.kinds import kind_of, resolve_job
from batchline.jobs.options import RunOptions
from batchline.jobs.summary import GenerateSummary, RunSummary
from batchline.models.config import Knobs

__all__ = [
    "RayGenerateSummary",
    "RaySummary",
    "UnitDone",
    "default_replica_knobs",
    "run_on_ray",
]

#: Records per work unit of a batch model when ``unit_records`` is not given: about 1-2 s of
#: one replica's work on a 2-core machine, so a lost unit costs little and the last units leave
#: no replica idle long.
DEFAULT_UNIT_RECORDS = 256
#: ... and of a generator: a unit is answered when its last completion is, so small units keep
#: the driver writing while long completions run.
GENERATE_UNIT_RECORDS = 8
_READ_BLOCK = 1024


# -- public types --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RayPlacement:
    """Where a Ray job's work ran (the summary fields every Ray job adds).

    ``records_by_node`` maps each Ray node id to the records its replicas answered in this
    run; ``replica_restarts`` counts replica processes that died and that Ray restarted (or was
    restarting when the job ended);
    ``resubmitted_units`` counts units sent again after their replica was lost;
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
    #: completion tokens each replica generated in this run (generation jobs)
    tokens_by_replica: tuple[int, ...] = ()

    @property
    def nodes(self) -> tuple[str, ...]:
        """Ids of the Ray nodes that answered records in this run, sorted."""
        return tuple(sorted(self.records_by_node))

    def _ray_rows(self, wall_s: float) -> list[tuple[str, str]]:
        by_node = ", ".join(f"{n[:8]}: {c:,}" for n, c in sorted(self.records_by_node.items()))
        cores = self.replica_cpu_s / wall_s if wall_s > 0 else 0.0
        rows = [
            ("engine", f"ray: {self.replicas} replica(s) on {len(self.nodes)} node(s)"),
            ("records by node", by_node or "-"),
            ("units (resubmitted)", f"{self.units:,} ({self.resubmitted_units})"),
            ("replica restarts", str(self.replica_restarts)),
            ("ray start-up", f"{self.startup_s:.1f} s"),
            ("replica CPU", f"{self.replica_cpu_s:.1f} s ({cores:.1f} cores)"),
        ]
        if self.tokens_by_replica and wall_s > 0:
            rates = ", ".join(f"{t / wall_s:,.1f}" for t in self.tokens_by_replica)
            rows.append(("tokens/s by replica", rates))
        return rows


@dataclass(frozen=True, kw_only=True)
class RaySummary(RunSummary, RayPlacement):
    """``RunSummary`` plus where the work ran (:class:`RayPlacement`)."""

    @property
    def cores_used(self) -> float:
        """Cores the replicas kept busy on average: ``replica_cpu_s / wall_s``."""
        return self.replica_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def rows(self) -> list[tuple[str, str]]:
        rows = super().rows()
        return [*rows[:2], *self._ray_rows(self.wall_s), *rows[2:]]


@dataclass(frozen=True, kw_only=True)
class RayGenerateSummary(GenerateSummary, RayPlacement):
    """``GenerateSummary`` of a generation job (or an OpenAI batch file with a generator) on
    Ray, plus where it ran. The generators' figures are over all replicas: running and waiting
    peaks, KV budget and the running cap are sums; TTFT and inter-token latency p50 the median
    of the replicas' p50s and p99 the worst replica's p99."""

    def rows(self) -> list[tuple[str, str]]:
        rows = super().rows()
        return [*rows[:2], *self._ray_rows(self.wall_s), *rows[2:]]


def default_replica_knobs(knobs: Knobs) -> Knobs:
    """The default knobs of one replica: ``knobs`` with one session of one intra-op thread.

    Two such replicas fill a 2-core node; on bigger nodes, run more replicas (``--replicas``)
    or give each more CPUs (``--cpus-per-replica``: its threads follow them).
    """
    return knobs_for_cpus(knobs, 1)


# -- the driver ----------------------------------------------------------------------------------


def run_from_args(
    options: RunOptions | Job, args: argparse.Namespace, progress: Progress | None
) -> RunSummary:
    """``batchline run --engine ray``: :func:`run_on_ray` with the command's flags (explicit
    ``--sessions``/``--intra-op-threads``/``--config``/``--set`` set each replica's knobs,
    else one session of ``--cpus-per-replica`` threads)."""
    own = args.config or args.set or args.sessions or args.intra_op_threads
    knobs = options.options.knobs if isinstance(options, Job) else options.knobs
    return run_on_ray(
        options,
        address=args.address,
        replicas=2 if args.replicas is None else args.replicas,
        replica_knobs=knobs if own else None,
        cpus_per_replica=args.cpus_per_replica,
        progress=progress,
    )


def _plan(options: RunOptions | Job) -> RayPlan:
    """How ``options``' job runs on Ray: its kind's plan (sync: reads the input's first rows)."""
    job = resolve_job(options)
    kind = kind_of(job)
    if kind.plan_ray is None:
        raise InputError(f"a {kind.name} job runs locally only; run it without --engine ray")
    return kind.plan_ray(job)


def run_on_ray(
    options: RunOptions | Job,
    *,
    address: str | None = None,
    replicas: int = 2,
    replica_knobs: Knobs | None = None,
    cpus_per_replica: float | None = None,
    unit_records: int | None = None,
    units_per_replica: int = 2,
    max_restarts: int = 3,
    max_task_retries: int = 0,
    max_unit_attempts: int = 3,
    start_timeout_s: float = 300.0,
    progress: Progress | None = None,
    on_unit: Callable[[UnitDone], None] | None = None,
) -> RunSummary:
    """Run ``batchline run``'s job with ``replicas`` model replicas on a Ray cluster.

    The output is the same as :func:`batchline.jobs.run.run_job` would write for ``options``:
    exactly once, resumable (``options.resume``), and resumable by either engine. Every job
    kind runs: a batch model's (embed, classify, predict, score), text generation, an OpenAI
    batch file.

    Args:
        address: ``None`` starts a private local Ray instance for this run (and stops it at the
            end); ``"auto"`` or ``"HOST:PORT"`` connects to a running cluster. If Ray is already
            initialised in this process, that connection is used and left open.
        replicas: model replicas (Ray actors), spread over the cluster's nodes.
        replica_knobs: batching knobs of each replica; default ``options.knobs`` with one
            session of ``cpus_per_replica`` intra-op threads.
        cpus_per_replica: logical CPUs each replica reserves; default its sessions x threads
            (one, with the default knobs).
        unit_records: records per work unit (rounded so units never cross an output chunk);
            default 256 for a batch model, 8 for a generator.
        units_per_replica: a batch model's units in flight per replica, so it never waits on
            the driver (a generator's: as many as its in-flight cap holds).
        max_restarts: Ray restarts a dead replica this many times.
        max_task_retries: Ray retries a dead replica's units on it itself (default 0: the
            driver does, and so sees every loss).
        max_unit_attempts: a record lost this many times (the last times alone on a replica)
            is reported as failed.
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
    given, options = options, options.options if isinstance(options, Job) else options
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
    if cpus_per_replica is not None and not (
        math.isfinite(cpus_per_replica) and cpus_per_replica > 0
    ):
        raise InputError(f"--cpus-per-replica must be a number > 0, got {cpus_per_replica:g}")
    if replica_knobs is not None:
        knobs = replica_knobs
    else:
        knobs = default_replica_knobs(options.knobs)
        if cpus_per_replica is not None:
            knobs = knobs_for_cpus(knobs, cpus_per_replica)
    cpus = cpus_per_replica or float(knobs.sessions * knobs.intra_op_threads)
    if address is not None and not ray.is_initialized():
        check_reachable(address)  # before the output directory is created
    if options.input is not None and not options.input.exists():
        raise InputError(f"{options.input}: no such file")  # before Ray starts
    plan = _plan(given)

    t0 = time.perf_counter()
    local_cpus = max(os.cpu_count() or 1, math.ceil(replicas * cpus))
    with ray_session(address, local_cpus):
        actors = _start_replicas(
            plan.work, knobs, replicas, cpus, max_restarts, max_task_retries, start_timeout_s
        )
        try:
            summary = _drive(
                plan,
                actors,
                options,
                progress,
                on_unit,
                unit_records=unit_records,
                units_per_replica=units_per_replica,
                max_unit_attempts=max_unit_attempts,
                started=t0,
            )
        finally:
            _stop(actors)
    return plan.finish(summary)


def _drive(
    plan: RayPlan,
    actors: list[tuple[Any, ReplicaReady]],
    options: RunOptions,
    progress: Progress | None,
    on_unit: Callable[[UnitDone], None] | None,
    *,
    unit_records: int | None,
    units_per_replica: int,
    max_unit_attempts: int,
    started: float,
) -> RunSummary:
    """Run the pipeline over the started replicas; the job's summary."""
    # opened as a local run opens it, so either engine can resume the other's output
    source, writer = plan.open(actors[0][1].info)
    unit = unit_records or (GENERATE_UNIT_RECORDS if plan.generates else DEFAULT_UNIT_RECORDS)
    # a generator's replica takes as many units as keep its running batch full
    capacity = [_capacity(ready, unit, units_per_replica) for _, ready in actors]
    rate = _TokenRate(progress)
    with writer:
        adapter = RayAdapter(
            actors,
            capacity=capacity,
            max_unit_attempts=max_unit_attempts,
            on_unit=on_unit,
            on_tokens=rate.tokens,
            # every kind finds its duplicates once per job, as a local run does (not once per
            # replica), by its plan's key
            dedupe_window=plan.dedupe_window,
            key_of=plan.key_of,
        )
        units = UnitPlan(options.chunk_size, unit)
        done = asyncio.run(
            run_pipeline(
                adapter,
                source,
                writer,
                block_records=max(_READ_BLOCK, unit),
                max_blocks_in_flight=sum(capacity),
                limit=options.limit,
                on_bad_record=plan.on_bad_record,
                progress=progress,
                unit_of=units.key,
                on_written=adapter.written,
            )
        )
    startup = time.perf_counter() - started - done.wall_s
    return _summary(
        writer.out_dir,
        done,
        adapter.tally,
        startup,
        in_flight=sum(capacity) * unit,
        precision=_replica_precision([ready for _, ready in actors]),
    )


def _replica_precision(replicas: Sequence[ReplicaReady]) -> str:
    """The summary's ``precision`` row: what the replicas' batch model computes in and why
    (each replica chose on its own host: where they differ, each choice and how many made it)."""
    said = collections.Counter(r.precision for r in replicas if r.precision)
    if len(said) <= 1:
        return next(iter(said), "")
    return "; ".join(f"{n} replica{'s' * (n > 1)}: {line}" for line, n in said.items())


def _capacity(ready: ReplicaReady, unit: int, units_per_replica: int) -> int:
    """Units a replica has in flight: a batch model's ``units_per_replica``; a generator's
    enough to fill its running batch and two more (its queue, refilling the batch as the
    sequences of a unit end), within what it takes in flight. More would sit in one replica's
    queue at the end of the job while another has nothing left."""
    if not ready.max_running:
        return units_per_replica
    wanted = -(-ready.max_running // unit) + 2
    return max(1, min(wanted, ready.in_flight // unit))


class _TokenRate:
    """The progress bar's tokens/s, when the bar shows one (a generation job's)."""

    def __init__(self, progress: Progress | None) -> None:
        from batchline.jobs.generate import TokenRate

        shown: object = progress
        self._rate = shown if isinstance(shown, TokenRate) else None
        self._t0 = time.perf_counter()

    def tokens(self, total: int) -> None:
        if self._rate is not None:
            elapsed = time.perf_counter() - self._t0
            self._rate.tokens(total, total / elapsed if elapsed > 0 else 0.0)


def _summary(
    out_dir: Path,
    done: PipelineRun,
    tally: Tally,
    startup: float,
    *,
    in_flight: int,
    precision: str = "",
) -> RunSummary:
    """The job's summary: ``RaySummary``, or ``RayGenerateSummary`` when its replicas
    generate (``in_flight``: the records the driver keeps in flight over all replicas)."""
    merged = tally.merged()
    common: dict[str, Any] = {
        "output": out_dir,
        "batching": True,
        **done.counts(),
        "latency_p50_s": percentile(tally.latencies, 50),
        "latency_p99_s": percentile(tally.latencies, 99),
        "duplicates": tally.duplicates,
        # where the work ran (RayPlacement)
        "replicas": tally.replicas,
        "records_by_node": dict(tally.by_node),
        "units": tally.units,
        "resubmitted_units": tally.resubmitted,
        "replica_restarts": tally.restarts,
        "startup_s": startup,
        "replica_cpu_s": tally.cpu_s,
    }
    generation = [r for r in tally.latest.values() if r.figures.generation is not None]
    if not generation:
        return RaySummary(
            **common,
            utilization=merged["utilization"],
            avg_batch_size=merged["avg_batch_size"],
            avg_batch_cost=merged["avg_batch_cost"],
            padding_waste=merged["padding_waste"],
            precision=precision,
        )
    stats = [r.figures.generation for r in generation if r.figures.generation is not None]
    cap = sum(r.figures.max_running for r in generation)
    steps = sum(s.steps for s in stats)
    running = sum(s.avg_running_per_step * s.steps for s in stats)
    per_step = running / steps if steps else 0.0  # per replica's step
    first = generation[0].figures
    return RayGenerateSummary(
        **common,
        utilization=per_step / first.max_running if first.max_running else 0.0,
        avg_batch_size=per_step,
        avg_batch_cost=0.0,
        padding_waste=0.0,
        generation_batching=first.batching,
        dtype=first.dtype,
        weights=first.weights,
        generated_tokens=tally.tokens,
        prompt_tokens=sum(s.prompt_tokens_total for s in stats),
        ttft_p50_s=_median([s.ttft_p50_s for s in stats]),
        ttft_p99_s=max(s.ttft_p99_s for s in stats),
        itl_p50_s=_median([s.itl_p50_s for s in stats]),
        itl_p99_s=max(s.itl_p99_s for s in stats),
        max_running=cap,
        running_peak=sum(r.figures.running_peak for r in generation),
        waiting_peak=sum(r.figures.waiting_peak for r in generation),
        in_flight_limit=in_flight,
        avg_running_per_step=per_step,
        kv_token_budget=sum(s.kv_token_budget for s in stats),
        kv_reserved_peak=sum(r.figures.kv_reserved_peak for r in generation),
        aborted=sum(s.requests_aborted for s in stats),
        preempted=sum(s.preempted for s in stats),
        failed=sum(s.requests_failed for s in stats),
        prefix_cache_tokens=sum(s.prefix_cache_tokens for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        prefix_tokens_reused=sum(s.prefix_tokens_reused for s in stats),
        prompt_tokens_computed=sum(s.prompt_tokens_computed for s in stats),
        prompts_shared=sum(s.prompts_shared for s in stats),
        tokens_by_replica=tuple(tally.tokens_by_replica),
    )


def _median(values: Sequence[float]) -> float:
    real = sorted(v for v in values if not math.isnan(v))
    return real[len(real) // 2] if real else math.nan


def _start_replicas(
    work: Callable[[Knobs], ReplicaWork],
    knobs: Knobs,
    replicas: int,
    cpus: float,
    max_restarts: int,
    max_task_retries: int,
    timeout_s: float,
) -> list[tuple[Any, ReplicaReady]]:
    """Create the replicas and wait until each has loaded its models: (actor, ready())."""
    replica_class = ray.remote(Replica).options(
        num_cpus=cpus,
        # a replica on a GPU device (knobs.device cuda[:N]) reserves one, so Ray places it on
        # a node that has one and never puts two replicas on the same GPU
        num_gpus=1 if knobs.is_gpu else 0,
        max_restarts=max_restarts,
        max_task_retries=max_task_retries,
        # One replica per node before two on any: a node's cores are what a replica uses.
        scheduling_strategy="SPREAD",
    )
    actors: list[Any] = [replica_class.remote(work, knobs) for _ in range(replicas)]
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
        where: list[ReplicaReady] = ray.get(refs)
    except BaseException as exc:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if isinstance(exc, ray.exceptions.RayActorError):
            raise ModelError(f"a replica could not load the model: {last_line(exc)}") from None
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = getattr(exc, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
        raise
    return list(zip(actors, where, strict=True))


def _stop(actors: Sequence[tuple[Any, ReplicaReady]]) -> None:
    """Stop the replicas: their generators and batchers first (briefly), then the actors."""
    refs = [actor.stop.remote() for actor, _ in actors]
    ray.wait(refs, num_returns=len(refs), timeout=10)
    for actor, _ in actors:
        ray.kill(actor, no_restart=True)
