"""What a ``batchline run`` job is, and what a kind of job supplies.

A job is resolved once (:func:`batchline.jobs.kinds.resolve_job`): its options resolved
(:func:`batchline.jobs.options.resolve`: the model spec parsed once, generation options for a
job that generates), then the first registered :class:`JobKind` that claims them names its
kind. Everything after dispatches on that kind: the local run
(:func:`batchline.jobs.run.run_job`), the CLI, the Ray driver and its replicas.

A kind is one module that builds one :class:`JobKind` (how to add one: docs/ARCHITECTURE.md,
"How to add a job kind"):

- ``claims``: whether a job's resolved options are this kind's, and what it found out
  deciding (an OpenAI batch job's files), kept on the job as :attr:`Job.claim`;
- ``run_local``: the job, run in this process to its summary;
- ``plan_ray``: how ``--engine ray`` runs it (:class:`RayPlan`), or None where it does not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from batchline.jobs.options import GenerateOptions, RunOptions

if TYPE_CHECKING:
    from batchline._stats import BatchStats
    from batchline.datasets.pipeline import Adapter, Progress
    from batchline.datasets.sinks import ChunkWriter
    from batchline.datasets.sources import Record, Source
    from batchline.jobs.summary import RunSummary
    from batchline.models.config import Knobs
    from batchline.models.generation import GenerationStats
    from batchline.models.protocol import ModelInfo

__all__ = ["Job", "JobKind", "RayPlan", "ReplicaWork", "WorkFigures"]


@dataclass(frozen=True)
class Job:
    """A resolved job: its kind's name, its resolved options, and what its kind's ``claims``
    found deciding (``True`` where it found nothing more)."""

    kind: str
    options: RunOptions
    claim: object = True

    @property
    def generates(self) -> bool:
        """Whether the job's options are a generation job's (:class:`GenerateOptions`): its
        progress counts prompts and tokens."""
        return isinstance(self.options, GenerateOptions)


@dataclass(frozen=True)
class JobKind:
    """One kind of ``batchline run`` job (see the module docstring). ``out_dir``: the folder
    its chunks are committed to (what an interrupted run's message counts), None where it
    cannot be told."""

    name: str
    claims: Callable[[RunOptions], object]
    run_local: Callable[[Job, Progress | None], Awaitable[RunSummary]]
    plan_ray: Callable[[Job], RayPlan] | None = None
    out_dir: Callable[[Job], Path | None] | None = None


def _same(summary: RunSummary) -> RunSummary:
    return summary


@dataclass(frozen=True)
class RayPlan:
    """How a job runs on Ray (``batchline.integrations.ray``): what each replica is sent, how
    the driver opens the output, and what the driver does with the records and the end.

    - ``work``: sent to each replica (pickled by Ray) and called there with its knobs: it loads
      the job's models (:class:`ReplicaWork`);
    - ``open``: the job's source and chunk writer, opened as a local run opens them (so either
      engine resumes the other's output), given the first replica's model info;
    - ``generates``: a generator's job (small units: a unit is answered when its last
      completion is);
    - ``dedupe_window``: distinct records the driver answers duplicates from, once per job;
      ``key_of``: what it compares records by (None: the record's input);
    - ``finish``: what happens after the last chunk (an OpenAI batch file's output file).
    """

    work: Callable[[Knobs], ReplicaWork]
    open: Callable[[ModelInfo], tuple[Source, ChunkWriter]]
    on_bad_record: str
    generates: bool = False
    dedupe_window: int = 0
    key_of: Callable[[Record], bytes | None] | None = None
    finish: Callable[[RunSummary], RunSummary] = _same


@dataclass(frozen=True)
class WorkFigures:
    """What a replica's work reports after each unit, for the driver's summary: its batch
    model's batcher stats and the duplicates it answered, and a generator's stats, settings
    and peaks (cumulative, per process)."""

    stats: BatchStats | None = None
    duplicates: int = 0
    generation: GenerationStats | None = None
    max_running: int = 0
    in_flight: int = 0
    batching: str = ""
    dtype: str = ""
    weights: str = ""
    running_peak: int = 0
    waiting_peak: int = 0
    kv_reserved_peak: int = 0
    tokens: int = 0


class ReplicaWork(Protocol):
    """A job's models on one Ray replica: loaded when it is made, started on the first unit.

    ``info`` is the batch model's (a generator's has task ``generate``); ``max_running`` and
    ``in_flight`` a generator's running cap and the records it takes in flight (0 for a batch
    model); ``precision`` what the batch model computes in and why ("" where it does not
    apply)."""

    info: ModelInfo
    max_running: int
    in_flight: int
    precision: str

    async def start(self, stack: contextlib.AsyncExitStack) -> Adapter:
        """Start the models (their batchers, generator, decode workers: each entered on
        ``stack``, which the replica closes when it stops); the adapter units run through."""
        ...

    def figures(self) -> WorkFigures:
        """What it reports after a unit."""
        ...

    def close(self) -> None:
        """Free the models (after ``stack`` closed)."""
        ...
