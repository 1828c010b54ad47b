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
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from batchline._batcher import DynamicBatcher
from batchline._errors import BatchlineError, InputError
from batchline._stats import percentile
from batchline.jobs.sinks import ChunkWriter, OutputFormat, ResultKind
from batchline.jobs.sources import (
    BadRecord,
    Format,
    Record,
    Source,
    open_source,
    read_blocks_ahead,
)
from batchline.knobs import BASELINE, Knobs

__all__ = [
    "RunOptions",
    "RunSummary",
    "embedding_engine",
    "load_embedder",
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
    model: str = "default"
    tokenizer: Path | None = None
    text_column: str = "text"
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
            ("avg batch cost (padded tokens)", f"{self.avg_batch_cost:.0f}"),
            ("padding waste", f"{self.padding_waste:.1%}"),
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


def load_embedder(model: str, tokenizer: Path | None, knobs: Knobs) -> Any:
    """The ``Embedder`` for ``--model default`` or ``--model PATH.onnx`` (needs ``tokenizer``)."""
    from batchline.models import Embedder

    options = knobs.embedder_options()
    if model == "default":
        if tokenizer is not None:
            raise InputError("--tokenizer goes with --model PATH.onnx, not the default model")
        return Embedder.default(**options)
    path = Path(model)
    if path.suffix.lower() != ".onnx":
        raise InputError(f"--model must be 'default' or a path to an .onnx file, got {model!r}")
    if not path.is_file():
        raise InputError(f"{path}: no such model file")
    if tokenizer is None:
        raise InputError(f"--model {path} needs --tokenizer PATH/tokenizer.json")
    if not tokenizer.is_file():
        raise InputError(f"{tokenizer}: no such tokenizer file")
    return Embedder.from_onnx(path, tokenizer, **options)


def default_output(input_path: Path | None, fmt: OutputFormat) -> Path:
    stem = "demo-corpus" if input_path is None else input_path.stem
    return Path(f"{stem}.embeddings")


def run(options: RunOptions, progress: Progress | None = None) -> RunSummary:
    """Run the job to the end (sync). See :func:`run_job`."""
    return asyncio.run(run_job(options, progress))


async def run_job(options: RunOptions, progress: Progress | None = None) -> RunSummary:
    """Embed every record of ``options.input`` into ``options.output``.

    >>> summary = run(RunOptions(input=Path("docs.jsonl"), output=Path("docs.embeddings")))
    >>> summary.records_per_s
    """
    progress = progress or _Silent()
    source, writer = await asyncio.to_thread(open_job, options)
    with writer:
        if writer.manifest.complete:
            total = writer.manifest.total_records or 0
            progress.start(total, total)
            return _summary(
                writer.out_dir, options.knobs.batching, 0, 0, total, total, 0.0, None, []
            )
        committed = writer.committed_ranges()
        already = sum(hi - lo for lo, hi in committed)
        knobs = options.knobs if options.knobs.batching else _baseline(options.knobs)
        embedder = await asyncio.to_thread(load_embedder, options.model, options.tokenizer, knobs)
        expected: int | None = source.total_records
        if expected is not None and options.limit is not None:
            expected = min(expected, options.limit)
        progress.start(expected, already)
        return await _pipeline(source, writer, embedder, options, knobs, committed, progress)


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
) -> tuple[Source, ChunkWriter]:
    """Open a job's input and output: the source, and the chunk writer with the job's settings.

    Every job over a dataset (``run`` on any engine, ``drive``) opens it this way, so the
    settings a resume must match are the same everywhere. Sync: the fingerprint reads the input.
    """
    input_path = options.input
    if input_path is None:
        from batchline.jobs.corpus import demo_corpus_path

        input_path = demo_corpus_path()
    if options.limit is not None and options.limit < 0:
        raise InputError(f"--limit must be >= 0, got {options.limit}")
    source = open_source(
        input_path,
        text_column=options.text_column,
        id_column=options.id_column,
        extra_columns=tuple(options.copy_columns),
        fmt=options.input_format,
        on_bad_record="skip" if options.on_bad_record == "skip" else "raise",
    )
    settings: dict[str, object] = {
        "input": str(input_path.resolve()),
        "input_fingerprint": source.fingerprint(),
        "model": options.model,
        "text_column": options.text_column,
        "id_column": source.id_column,
        "copy_columns": list(options.copy_columns),
        "limit": options.limit,
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


def open_job(options: RunOptions) -> tuple[Source, ChunkWriter]:
    """``open_dataset_job`` for ``batchline run`` (local or Ray: either resumes the other)."""
    output = options.output or default_output(options.input, options.output_format)
    return open_dataset_job(options, output=output, chunk_size=options.chunk_size)


def _baseline(knobs: Knobs) -> Knobs:
    return BASELINE.replace(max_queue_size=knobs.max_queue_size)


async def _pipeline(
    source: Source,
    writer: ChunkWriter,
    embedder: Any,
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

    async with embedding_engine(embedder, knobs) as batcher:

        async def finish_block(
            records: list[Record], futures: list[asyncio.Future[Any]], t0: float
        ) -> None:
            try:
                outcomes = await asyncio.gather(*futures, return_exceptions=True)
                now = time.perf_counter()
                good: list[Record] = []
                vectors: list[Any] = []
                for record, outcome in zip(records, outcomes, strict=True):
                    if isinstance(outcome, BaseException):
                        if options.on_bad_record == "fail" or not isinstance(
                            outcome, BatchlineError | ValueError
                        ):
                            raise InputError(
                                f"record {record.index} (id {record.id!r}) failed: {outcome}; "
                                "pass --on-bad-record skip to list such records in "
                                "_skipped.jsonl and go on"
                            ) from outcome
                        await asyncio.to_thread(
                            writer.skip, record.index, record.id, f"model error: {outcome}"
                        )
                        counts["skipped"] += 1
                        continue
                    good.append(record)
                    vectors.append(outcome)
                    latencies.append(now - t0)
                if good:
                    await asyncio.to_thread(writer.write_batch, good, np.stack(vectors))
                counts["records"] += len(good)
                progress.advance(len(records), batcher.stats.utilization)
            except BaseException as exc:
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
                        progress.advance(len(bad), batcher.stats.utilization)
                    records = [item for item in block if isinstance(item, Record)]
                    if not records:
                        continue
                    await blocks_in_flight.acquire()
                    t0 = time.perf_counter()
                    toks = await asyncio.to_thread(embedder.tokenize, [r.text for r in records])
                    futures = [await batcher.submit(tok) for tok in toks]
                    task = asyncio.create_task(finish_block(records, futures, t0))
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
        final_stats = batcher.stats

    total = source.total_records or 0
    if options.limit is not None:
        total = min(total, options.limit) if source.total_records is not None else options.limit
    await asyncio.to_thread(writer.finish, total)
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
    )


def _summary(
    output: Path,
    batching: bool,
    records: int,
    skipped: int,
    already: int,
    total: int,
    wall: float,
    stats: Any,
    latencies: list[float],
) -> RunSummary:
    return RunSummary(
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


@contextlib.asynccontextmanager
async def embedding_engine(embedder: Any, knobs: Knobs) -> AsyncIterator[DynamicBatcher[Any, Any]]:
    """The running batcher to submit tokenized texts to: the embedder's own ``TokenBatcher``, or
    for the no-batching baseline a batcher of one record per call, with as many callers at once
    as the knobs allow on the (shared) session. ``run``, the Ray replicas and ``bench`` use it."""
    if knobs.batching:
        async with embedder:
            yield embedder.batcher
        return

    def one_at_a_time(batch: list[Any]) -> list[Any]:
        return list(embedder.embed_tokens(batch))

    baseline: DynamicBatcher[Any, Any] = DynamicBatcher(
        one_at_a_time,
        max_batch_size=1,
        max_concurrent_batches=knobs.max_concurrent_batches,
        max_queue_size=knobs.max_queue_size,
        name="no-batching",
    )
    async with baseline:
        yield baseline
