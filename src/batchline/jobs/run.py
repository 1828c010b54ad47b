"""``batchline run``: an offline embedding job over a dataset file, resumable, nothing lost.

The pipeline, all of it overlapping so the model never waits on I/O::

    reader thread ──blocks──> tokenizer thread ──records──> TokenBatcher ──> ONNX sessions
                                                              │ (bounded queue: backpressure
                                                              │  reaches the reader)
                                    ChunkWriter thread <──────┘ results, committed in chunks

Every record ends in the output (a row), or in ``_skipped.jsonl`` (with
``on_bad_record="skip"``), or stops the job with a message naming it: none disappears. A killed
job resumed with ``resume=True`` yields the same output as an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from batchline._errors import InputError
from batchline._stats import BatchStats, percentile
from batchline.datasets.outcomes import (
    Failed,
    cancel,
    collect,
    submit_block,
    write_outcomes,
)
from batchline.datasets.sinks import ChunkWriter, OutputFormat, ResultKind
from batchline.datasets.sources import (
    BadRecord,
    Format,
    Record,
    Source,
    open_source,
    read_blocks_ahead,
)
from batchline.knobs import Knobs
from batchline.models.batching import ModelBatcher
from batchline.models.protocol import BatchModel, InputKind, ModelInfo

__all__ = [
    "RunOptions",
    "RunSummary",
    "load_job_model",
    "open_dataset_job",
    "open_job",
    "run",
    "run_job",
]

BadRecordMode = Literal["fail", "skip"]

# Records in flight between the reader and the writer, beyond the batcher's own queue.
_BLOCK = 256
_MAX_BLOCKS_IN_FLIGHT = 8


@dataclass
class RunOptions:
    """What to run. ``input=None`` runs on the built-in demo corpus."""

    input: Path | None = None
    output: Path | None = None
    #: a model spec: ``default``, ``PATH.onnx``, ``module:factory`` (``batchline.models.specs``)
    model: str = "default"
    task: str | None = None
    tokenizer: Path | None = None
    labels: tuple[str, ...] | None = None
    pooling: str | None = None
    normalize: bool | None = None
    text_column: str = "text"
    #: columns (or the ``.npy`` input's name) holding a ``predict`` model's tensors
    input_columns: Sequence[str] = ()
    id_column: str | None = None
    input_format: Format | None = None
    output_format: OutputFormat = "parquet"
    copy_columns: Sequence[str] = ()
    resume: bool = False
    overwrite: bool = False
    on_bad_record: BadRecordMode = "fail"
    chunk_size: int = 10_000
    limit: int | None = None
    knobs: Knobs = field(default_factory=Knobs)


@dataclass(frozen=True)
class RunSummary:
    """What a run did; ``records`` counts only this run's records, not resumed ones."""

    output: Path
    batching: bool
    records: int
    skipped: int
    already_done: int
    total_records: int
    wall_s: float
    utilization: float
    avg_batch_size: float
    avg_batch_cost: float
    padding_waste: float
    latency_p50_s: float
    latency_p99_s: float
    #: whether batches were costed in padded tokens (text models); else in the model's units
    padded: bool = True

    @property
    def records_per_s(self) -> float:
        return self.records / self.wall_s if self.wall_s > 0 else 0.0

    def rows(self) -> list[tuple[str, str]]:
        """The summary as (label, value) rows, for a table."""
        return [
            ("output", str(self.output)),
            ("mode", "batching" if self.batching else "no batching (one shared session)"),
            ("records (this run)", f"{self.records:,}"),
            ("skipped", f"{self.skipped:,}"),
            ("resumed (already done)", f"{self.already_done:,}"),
            ("wall time", f"{self.wall_s:.1f} s"),
            ("records/s", f"{self.records_per_s:,.1f}"),
            ("utilization", f"{self.utilization:.0%}"),
            ("avg batch size", f"{self.avg_batch_size:.1f}"),
            *(
                [
                    ("avg batch cost (padded tokens)", f"{self.avg_batch_cost:.0f}"),
                    ("padding waste", f"{self.padding_waste:.1%}"),
                ]
                if self.padded
                else [("avg batch cost (model's units)", f"{self.avg_batch_cost:.0f}")]
            ),
            ("latency p50 / p99", f"{_ms(self.latency_p50_s)} / {_ms(self.latency_p99_s)}"),
        ]


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:.1f} ms"


class Progress(Protocol):
    """Hooks the job calls; the CLI draws a progress bar from them."""

    def start(self, total: int | None, already_done: int) -> None:
        """The job starts; ``total`` records in the input, when known."""

    def advance(self, records: int, utilization: float) -> None:
        """``records`` more records are done (written or skipped)."""


class _Silent:
    def start(self, total: int | None, already_done: int) -> None:
        pass

    def advance(self, records: int, utilization: float) -> None:
        pass


def load_job_model(options: RunOptions, knobs: Knobs) -> BatchModel[Any, Any]:
    """The job's model, from its spec and options, laid out as ``knobs`` say."""
    from batchline.models.loader import load_model

    spec = job_spec(options)
    return load_model(spec, knobs)


def job_spec(options: RunOptions) -> Any:
    """The job's one model spec (``ModelSpec``), validated."""
    from batchline.models.specs import parse_specs

    (spec,) = parse_specs(
        [options.model],
        tasks=[options.task] if options.task else [],
        tokenizer=options.tokenizer,
        labels=options.labels,
        pooling=options.pooling,
        normalize=options.normalize,
    )
    return spec


def default_output(input_path: Path | None, fmt: OutputFormat, info: ModelInfo) -> Path:
    """``STEM.embeddings`` (embed) or ``STEM.results`` (other tasks), in the current directory."""
    stem = "demo-corpus" if input_path is None else input_path.stem
    return Path(f"{stem}.{'embeddings' if info.task == 'embed' else 'results'}")


def run(options: RunOptions, progress: Progress | None = None) -> RunSummary:
    """Run the job to the end (sync). See :func:`run_job`."""
    return asyncio.run(run_job(options, progress))


async def run_job(options: RunOptions, progress: Progress | None = None) -> RunSummary:
    """Embed every record of ``options.input`` into ``options.output``.

    >>> summary = run(RunOptions(input=Path("docs.jsonl"), output=Path("docs.embeddings")))
    >>> summary.records_per_s

    A generation job (task ``generate``, or a model that generates) runs
    :func:`batchline.jobs.generate.run_generate_job` instead.
    """
    from batchline.jobs.generate import is_generate_job, run_generate_job

    if is_generate_job(options):
        return await run_generate_job(options, progress)
    progress = progress or _Silent()
    knobs = options.knobs if options.knobs.batching else _baseline(options.knobs)
    model = await asyncio.to_thread(load_job_model, options, knobs)
    try:
        source, writer = await asyncio.to_thread(open_job, options, model.info)
        with writer:
            if writer.manifest.complete:
                total = writer.manifest.total_records or 0
                progress.start(total, total)
                return _summary(
                    writer.out_dir, options.knobs.batching, 0, 0, total, total, 0.0, None, []
                )
            committed = writer.committed_ranges()
            already = sum(hi - lo for lo, hi in committed)
            progress.start(expected_records(source, options.limit), already)
            return await _pipeline(source, writer, model, options, knobs, committed, progress)
    finally:
        model.close()


def expected_records(source: Source, limit: int | None) -> int | None:
    """Records the job covers in all (resumed ones included); ``None`` while the input's size
    is unknown."""
    total = source.total_records
    return total if total is None or limit is None else min(total, limit)


async def finish_output(writer: ChunkWriter, source: Source, limit: int | None) -> int:
    """Mark the output complete and return the records it covers (``limit``, else 0, when the
    input's size is still unknown)."""
    expected = expected_records(source, limit)
    total = expected if expected is not None else (limit or 0)
    await asyncio.to_thread(writer.finish, total)
    return total


class DatasetOptions(Protocol):
    """What a job over a dataset file says about its input and output (``RunOptions``, the
    driver's ``DriveOptions``)."""

    @property
    def input(self) -> Path | None: ...
    @property
    def model(self) -> str | None: ...
    @property
    def text_column(self) -> str: ...
    @property
    def id_column(self) -> str | None: ...
    @property
    def copy_columns(self) -> Sequence[str]: ...
    @property
    def input_format(self) -> Format | None: ...
    @property
    def output_format(self) -> OutputFormat: ...
    @property
    def on_bad_record(self) -> str: ...
    @property
    def limit(self) -> int | None: ...
    @property
    def overwrite(self) -> bool: ...
    @property
    def resume(self) -> bool: ...


def open_dataset_job(
    options: DatasetOptions,
    *,
    output: Path,
    chunk_size: int,
    extra_settings: dict[str, object] | None = None,
    result_column: str = "embedding",
    result_kind: ResultKind = "vector",
    input_kind: InputKind = "text",
    default_input: str | None = None,
) -> tuple[Source, ChunkWriter]:
    """Open a job's input and output: the source, and the chunk writer with the job's settings.

    Every job over a dataset (``run`` on any engine, ``drive``) opens it this way, so the
    settings a resume must match are the same everywhere. Sync: the fingerprint reads the input.
    """
    input_path = options.input
    if input_path is None:
        from batchline.datasets.corpus import demo_corpus_path

        input_path = demo_corpus_path()
    if options.limit is not None and options.limit < 0:
        raise InputError(f"--limit must be >= 0, got {options.limit}")
    inputs: dict[str, Any] = {}
    if input_kind != "text":  # the text jobs' sources (and their resume settings) are unchanged
        columns = tuple(getattr(options, "input_columns", ()))
        if not columns and default_input is not None:
            columns = (default_input,)
        inputs = {"input_kind": input_kind, "input_columns": columns}
    source = open_source(
        input_path,
        text_column=options.text_column,
        id_column=options.id_column,
        extra_columns=tuple(options.copy_columns),
        fmt=options.input_format,
        on_bad_record="skip" if options.on_bad_record == "skip" else "raise",
        **inputs,
    )
    settings: dict[str, object] = {
        "input": str(input_path.resolve()),
        "input_fingerprint": source.fingerprint(),
        "model": options.model,
        "text_column": options.text_column,
        "id_column": source.id_column,
        "copy_columns": list(options.copy_columns),
        "limit": options.limit,
        **inputs,
        **(extra_settings or {}),
    }
    writer = ChunkWriter(
        output,
        fmt=options.output_format,
        chunk_size=chunk_size,
        overwrite=options.overwrite,
        resume=options.resume,
        meta=settings,
        result_column=result_column,
        result_kind=result_kind,
    )
    return source, writer


def open_job(options: RunOptions, info: ModelInfo) -> tuple[Source, ChunkWriter]:
    """``open_dataset_job`` for ``batchline run`` (local or Ray: either resumes the other).

    The output's result column and kind are the model's; a task other than ``embed`` is part
    of the settings a resume must match (embedding outputs keep their settings unchanged).
    """
    output = options.output or default_output(options.input, options.output_format, info)
    extra: dict[str, object] = {} if info.task == "embed" else {"task": info.task}
    return open_dataset_job(
        options,
        output=output,
        chunk_size=options.chunk_size,
        extra_settings=extra,
        result_column=info.result_column,
        result_kind="vector" if info.result_kind == "vector" else "json",
        input_kind=info.input_kind,
        default_input=_only_input(info),
    )


def _only_input(info: ModelInfo) -> str | None:
    """The name of a tensor model's one input (what a ``.npy`` file's rows feed)."""
    inputs = info.details.get("inputs")
    if isinstance(inputs, list) and len(inputs) == 1 and isinstance(inputs[0], dict):
        name = inputs[0].get("name")
        return name if isinstance(name, str) else None
    return None


def _baseline(knobs: Knobs) -> Knobs:
    return knobs.baseline()


async def _pipeline(
    source: Source,
    writer: ChunkWriter,
    model: BatchModel[Any, Any],
    options: RunOptions,
    knobs: Knobs,
    committed: list[tuple[int, int]],
    progress: Progress,
) -> RunSummary:
    started = time.perf_counter()
    latencies: list[float] = []
    counts = {"records": 0, "skipped": 0}
    blocks_in_flight = asyncio.Semaphore(_MAX_BLOCKS_IN_FLIGHT)
    writes: set[asyncio.Task[None]] = set()
    failure: list[BaseException] = []

    async with ModelBatcher(model, knobs) as engine:

        async def finish_block(
            records: list[Record], pending: list[asyncio.Future[Any] | Failed], t0: float
        ) -> None:
            try:
                outcomes = await collect(engine, pending)
                now = time.perf_counter()
                written, skipped = await asyncio.to_thread(
                    write_outcomes, writer, records, outcomes, on_bad_record=options.on_bad_record
                )
                latencies.extend([now - t0] * written)
                counts["records"] += written
                counts["skipped"] += skipped
                progress.advance(len(records), engine.stats.utilization)
            except BaseException as exc:
                cancel(pending)
                failure.append(exc)
            finally:
                blocks_in_flight.release()

        blocks = read_blocks_ahead(source, _BLOCK, skip=committed, limit=options.limit)
        try:
            async with contextlib.aclosing(blocks):
                async for block in blocks:
                    if failure:
                        break
                    bad = [item for item in block if isinstance(item, BadRecord)]
                    for item in bad:
                        await asyncio.to_thread(writer.skip_bad, item)
                    counts["skipped"] += len(bad)
                    if bad:
                        progress.advance(len(bad), engine.stats.utilization)
                    records = [item for item in block if isinstance(item, Record)]
                    if not records:
                        continue
                    await blocks_in_flight.acquire()
                    t0 = time.perf_counter()
                    try:
                        pending = await submit_block(engine, [r.input for r in records])
                    except BaseException:
                        blocks_in_flight.release()
                        raise
                    task = asyncio.create_task(finish_block(records, pending, t0))
                    writes.add(task)
                    task.add_done_callback(writes.discard)
            await asyncio.gather(*writes)
        except BaseException:
            for task in writes:
                task.cancel()
            await asyncio.gather(*writes, return_exceptions=True)
            raise
        if failure:
            raise failure[0]
        final_stats = engine.stats

    total = await finish_output(writer, source, options.limit)
    wall = time.perf_counter() - started
    already = sum(hi - lo for lo, hi in committed)
    return _summary(
        writer.out_dir,
        knobs.batching,
        counts["records"],
        counts["skipped"],
        already,
        total,
        wall,
        final_stats,
        latencies,
        padded=knobs.batching and model.info.cost_kind == "padded",
    )


def _summary(
    output: Path,
    batching: bool,
    records: int,
    skipped: int,
    already: int,
    total: int,
    wall: float,
    stats: BatchStats | None,
    latencies: list[float],
    *,
    padded: bool = True,
) -> RunSummary:
    return RunSummary(
        padded=padded,
        output=output,
        batching=batching,
        records=records,
        skipped=skipped,
        already_done=already,
        total_records=total,
        wall_s=wall,
        utilization=stats.utilization if stats is not None else 0.0,
        avg_batch_size=stats.avg_batch_size if stats is not None else 0.0,
        avg_batch_cost=stats.avg_batch_cost if stats is not None else 0.0,
        padding_waste=stats.padding_waste if stats is not None else 0.0,
        latency_p50_s=percentile(latencies, 50),
        latency_p99_s=percentile(latencies, 99),
    )
