"""The one loop of every job over a dataset: read, submit, write, whatever runs the records.

::

    read_blocks_ahead ──records──> adapter.submit(records) ──> awaitable outcomes, in order
        │ (skips committed chunks)       │ waits for room: the adapter's backpressure
        │ bad records                    ▼
        └────────> ChunkWriter <── write_outcomes: rows, or _skipped.jsonl, or stop the job

What differs between jobs is the :class:`Adapter`: a batch model (``jobs/run.py``), a text
generator (``jobs/generate.py``), HTTP replicas (``driver/drive.py``) and Ray replicas
(``integrations/ray.py``). The loop owns what they share: the bad-record skip, the cap on
blocks in flight, the failure latch (the first error stops reading, cancels what is in flight
and is raised), and ``finish`` once every record has a row or a skip.

Every record ends in the output (a row), or in ``_skipped.jsonl``, or stops the job with a
message naming it: none disappears. A killed job resumed with ``resume=True`` skips the
committed chunks and yields the same output as an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypedDict

from batchline._errors import InputError
from batchline.datasets.columns import prime_conversion
from batchline.datasets.outcomes import Outcome, Written, write_outcomes
from batchline.datasets.selection import DatasetSelection
from batchline.datasets.sinks import ChunkWriter
from batchline.datasets.sources import (
    BadRecord,
    Item,
    Record,
    Source,
    open_source,
    read_blocks_ahead,
)
from batchline.models.protocol import InputKind, ResultKind

__all__ = [
    "Adapter",
    "PipelineRun",
    "Progress",
    "RunCounts",
    "expected_records",
    "open_dataset_job",
    "run_pipeline",
]


class Progress(Protocol):
    """What a dataset job reports as it goes (the CLI draws its bar from it); every job takes
    one, or ``None`` for none."""

    def start(self, total: int | None, already_done: int) -> None:
        """The job starts; ``total`` records in all (resumed ones included), when known."""

    def advance(self, records: int, *, failed: int = 0, utilization: float = 0.0) -> None:
        """``records`` more records are done (written or skipped), ``failed`` of them failed on
        the way; ``utilization`` is how busy what runs them is (0..1)."""


class Adapter(Protocol):
    """What runs a job's records: the one part of the pipeline that differs between jobs."""

    async def submit(self, records: Sequence[Record]) -> Awaitable[Sequence[Outcome]]:
        """Start work on ``records``, waiting first for room (the adapter's own cap on work in
        flight); the awaitable gives one outcome per record, in order. Cancelling it
        withdraws whatever is still queued."""
        ...

    def utilization(self) -> float:
        """How busy what runs the records is (0..1), for the progress bar."""
        ...


class RunCounts(TypedDict):
    """The figures of a :class:`PipelineRun` every job's summary reports as they are."""

    records: int
    skipped: int
    already_done: int
    total_records: int
    wall_s: float
    empty_texts: int


@dataclass
class PipelineRun:
    """What one run of the loop did (this run's records only; ``already_done`` were committed
    by the run being resumed). ``latencies_s`` holds, per written record, the time from its
    block's submit to its outcomes. ``empty_texts`` counts the records whose text was empty
    or blank: run like any other (``on_bad_record="fail"``) or skipped and listed (``"skip"``,
    counted in ``skipped`` too)."""

    already_done: int
    total_records: int
    records: int = 0
    skipped: int = 0
    failed: int = 0
    wall_s: float = 0.0
    empty_texts: int = 0
    latencies_s: list[float] = field(default_factory=list)

    def counts(self) -> RunCounts:
        """What every job's summary (``RunSummary`` and its kin) takes from the run as it is."""
        return {
            "records": self.records,
            "skipped": self.skipped,
            "already_done": self.already_done,
            "total_records": self.total_records,
            "wall_s": self.wall_s,
            "empty_texts": self.empty_texts,
        }


def expected_records(source: Source, limit: int | None) -> int | None:
    """Records the job covers in all (resumed ones included); ``None`` while the input's size
    is unknown."""
    total = source.total_records
    return total if total is None or limit is None else min(total, limit)


async def run_pipeline(
    adapter: Adapter,
    source: Source,
    writer: ChunkWriter,
    *,
    block_records: int,
    limit: int | None,
    on_bad_record: str,
    progress: Progress | None = None,
    max_blocks_in_flight: int = 8,
    unit_of: Callable[[int], int] | None = None,
    on_written: Callable[[Sequence[Record], Written], None] | None = None,
) -> PipelineRun:
    """Send every record of ``source`` not yet committed through ``adapter`` and write the
    outcomes; mark the output complete. A finished output is left as it is.

    ``block_records`` records are read and submitted at a time, at most
    ``max_blocks_in_flight`` blocks unwritten. ``unit_of(index)`` (optional) cuts blocks where
    its value changes, so a block never mixes two units (Ray's units never cross an output
    chunk). ``on_written(records, written)`` is called once a block's outcomes are handed to
    the writer; what it raises stops the job like any failure.
    """
    if writer.manifest.complete:
        total = writer.manifest.total_records or 0
        if progress is not None:
            progress.start(total, total)
        return PipelineRun(already_done=total, total_records=total)
    committed = writer.committed_ranges()
    run = PipelineRun(already_done=sum(hi - lo for lo, hi in committed), total_records=0)
    if progress is not None:
        progress.start(expected_records(source, limit), run.already_done)
    started = time.perf_counter()
    slots = asyncio.Semaphore(max_blocks_in_flight)
    writes: set[asyncio.Task[None]] = set()
    failure: list[BaseException] = []

    async def finish_block(
        records: Sequence[Record], outcomes: Awaitable[Sequence[Outcome]], t0: float
    ) -> None:
        try:
            got = await outcomes
            now = time.perf_counter()
            done = await asyncio.to_thread(
                write_outcomes, writer, records, got, on_bad_record=on_bad_record
            )
            run.latencies_s.extend([now - t0] * done.written)
            run.records += done.written
            run.skipped += done.skipped
            run.failed += done.failed
            if on_written is not None:
                on_written(records, done)
            if progress is not None:
                progress.advance(
                    len(records), failed=done.failed, utilization=adapter.utilization()
                )
        except BaseException as exc:
            failure.append(exc)
        finally:
            slots.release()

    blocks = read_blocks_ahead(source, block_records, skip=committed, limit=limit)
    try:
        async with contextlib.aclosing(blocks):
            # a text record may be empty; a picture record with none is its adapter's to say why
            empty: Literal["count", "skip"] | None = "skip" if on_bad_record == "skip" else "count"
            if source.input_kind != "text":
                empty = None
            texts = _records(blocks, writer, run, progress, adapter, unit_of, empty)
            async for records in texts:
                if failure:
                    break
                await slots.acquire()
                if failure:
                    slots.release()
                    break
                t0 = time.perf_counter()
                try:
                    outcomes = asyncio.ensure_future(await adapter.submit(records))
                except BaseException:
                    slots.release()
                    raise
                task = asyncio.create_task(finish_block(records, outcomes, t0))
                writes.add(task)
                task.add_done_callback(writes.discard)
        if failure:  # the job stops: what is still in flight is withdrawn, not waited for
            for task in writes:
                task.cancel()
        await asyncio.gather(*writes)
    except BaseException:
        for task in writes:
            task.cancel()
        await asyncio.gather(*writes, return_exceptions=True)
        raise
    if failure:
        raise failure[0]
    expected = expected_records(source, limit)
    run.total_records = expected if expected is not None else (limit or 0)
    await asyncio.to_thread(writer.finish, run.total_records)
    run.wall_s = time.perf_counter() - started
    return run


async def _records(
    blocks: AsyncIterator[list[Item]],
    writer: ChunkWriter,
    run: PipelineRun,
    progress: Progress | None,
    adapter: Adapter,
    unit_of: Callable[[int], int] | None,
    empty: Literal["count", "skip"] | None,
) -> AsyncIterator[list[Record]]:
    """The good records of each block (cut by ``unit_of``); bad ones are skipped here, and
    records of empty text counted (``empty="count"``) or skipped (``"skip"``); ``None``: the
    records are not texts (a picture record without one goes on, for its adapter to say so)."""
    held: list[Record] = []
    for_unit = -1
    async for block in blocks:
        bad = [item for item in block if isinstance(item, BadRecord)]
        records = []
        for item in block:
            if isinstance(item, Record):
                if empty is not None and item.value is None and not item.text.strip():
                    run.empty_texts += 1
                    if empty == "skip":
                        bad.append(BadRecord(item.index, item.id, _EMPTY_TEXT, ""))
                        continue
                records.append(item)
        if bad:
            await asyncio.to_thread(_skip_bad, writer, bad)
            run.skipped += len(bad)
            if progress is not None:
                progress.advance(len(bad), utilization=adapter.utilization())
        if unit_of is None:
            if records:
                yield records
            continue
        for record in records:
            unit = unit_of(record.index)
            if held and unit != for_unit:
                yield held
                held = []
            for_unit = unit
            held.append(record)
    if held:
        yield held


#: Why a record of empty or blank text is skipped (``on_bad_record="skip"``).
_EMPTY_TEXT = "empty text (nothing to run the model on)"


def _skip_bad(writer: ChunkWriter, bad: Sequence[BadRecord]) -> None:
    for item in bad:
        writer.skip_bad(item)


def open_dataset_job(
    options: DatasetSelection,
    *,
    model: str | None,
    output: Path,
    chunk_size: int,
    extra_settings: dict[str, object] | None = None,
    result_column: str = "embedding",
    result_kind: ResultKind = "vector",
    result_shapes: Mapping[str, Sequence[int] | None] | None = None,
    input_kind: InputKind = "text",
    input_columns: Sequence[str] = (),
) -> tuple[Source, ChunkWriter]:
    """Open a job's input and output (``options``; ``model``: what the job's results come
    from, as the settings record it): the source, and the chunk writer with the job's settings.

    Every job over a dataset (``run`` on any engine, ``drive``) opens it this way, so the
    settings a resume must match are the same everywhere. Sync: the fingerprint reads the input.
    """
    prime_conversion()  # while the input is read and the model starts
    input_path = options.input
    if input_path is None:
        from batchline.datasets.corpus import demo_corpus_path

        input_path = demo_corpus_path()
    if options.limit is not None and options.limit < 0:
        raise InputError(f"--limit must be >= 0, got {options.limit}")
    inputs: dict[str, Any] = {}
    if input_kind != "text":  # the text jobs' sources (and their resume settings) are unchanged
        inputs = {"input_kind": input_kind, "input_columns": tuple(input_columns)}
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
        "model": model,
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
        result_shapes=result_shapes,
        allow_empty=options.allow_empty,
        id_name=source.id_column or "id",
        flush_on_stop=True,  # Ctrl-C keeps what is done: --resume does not compute it again
    )
    return source, writer
