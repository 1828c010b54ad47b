"""Per-record outcomes of a job over a dataset, handled once for every engine.

A block of records is prepared and batched by :func:`process_block` (where the model runs: this
process, or a Ray replica), which turns each record's fate into an :data:`Outcome`: its encoded
result, or a :class:`Failed`. :func:`write_outcomes` (where the output is written) hands the
results to the chunk writer and the failures to ``_skipped.jsonl`` or stops the job, by the
job's ``on_bad_record`` rule. Outcomes are plain picklable values, so they cross a Ray boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchline._errors import InputError
from batchline.datasets.sinks import ChunkWriter
from batchline.datasets.sources import Record
from batchline.models.batching import ModelBatcher

__all__ = [
    "Failed",
    "Outcome",
    "cancel",
    "collect",
    "describe",
    "process_block",
    "submit_block",
    "write_outcomes",
]


@dataclass(frozen=True, slots=True)
class Failed:
    """A record the model could not take (bad input) or failed on (its own exception)."""

    message: str


Outcome = object  # an encoded result, or a Failed


async def submit_block(
    engine: ModelBatcher[Any, Any], inputs: Sequence[object]
) -> list[asyncio.Future[Any] | Failed]:
    """Prepare ``inputs`` off the event loop and queue them (waiting for room in the queue);
    a record that ``prepare`` refuses is its :class:`Failed` at once."""
    model = engine.model
    prepared = await asyncio.to_thread(model.prepare, list(inputs))
    if len(prepared) != len(inputs):
        raise InputError(
            f"model {model.info.name!r}: prepare() returned {len(prepared)} items for "
            f"{len(inputs)} inputs"
        )
    pending: list[asyncio.Future[Any] | Failed] = []
    try:
        for item in prepared:
            if isinstance(item, BaseException):
                pending.append(Failed(f"bad input: {describe(item)}"))
            else:
                pending.append(await engine.submit(item))
    except BaseException:
        cancel(pending)
        raise
    return pending


async def collect(
    engine: ModelBatcher[Any, Any], pending: Sequence[asyncio.Future[Any] | Failed]
) -> list[Outcome]:
    """Wait for every queued record and encode its result; one record's exception (the batcher
    has bisected its batch down to it) is that record's :class:`Failed`, in order."""
    futures = [f for f in pending if not isinstance(f, Failed)]
    try:
        await asyncio.gather(*futures, return_exceptions=True)
    except BaseException:
        cancel(pending)
        raise
    encode = engine.model.encode
    outcomes: list[Outcome] = []
    for f in pending:
        if isinstance(f, Failed):
            outcomes.append(f)
            continue
        exc = f.exception()
        if exc is None:
            outcomes.append(encode(f.result()))
        elif isinstance(exc, Exception):
            outcomes.append(Failed(f"model error: {describe(exc)}"))
        else:  # KeyboardInterrupt and the like are not a record's fault
            raise exc
    return outcomes


async def process_block(engine: ModelBatcher[Any, Any], inputs: Sequence[object]) -> list[Outcome]:
    """:func:`submit_block` then :func:`collect`: every input's outcome, in order."""
    return await collect(engine, await submit_block(engine, inputs))


def cancel(pending: Sequence[asyncio.Future[Any] | Failed]) -> None:
    """Withdraw whatever is still queued (a stopping job)."""
    for f in pending:
        if not isinstance(f, Failed):
            f.cancel()


def write_outcomes(
    writer: ChunkWriter,
    records: Sequence[Record],
    outcomes: Sequence[Outcome],
    *,
    on_bad_record: str,
) -> tuple[int, int]:
    """Write the results and list the failures; ``(written, skipped)``.

    With ``on_bad_record="fail"`` the first failure stops the job (``InputError`` naming the
    record) before anything of this block is written. Sync: call it in a worker thread.
    """
    if len(records) != len(outcomes):
        raise ValueError(f"got {len(outcomes)} outcomes for {len(records)} records")
    failed = [(r, o) for r, o in zip(records, outcomes, strict=True) if isinstance(o, Failed)]
    if failed and on_bad_record == "fail":
        record, outcome = failed[0]
        raise InputError(
            f"record {record.index} (id {record.id!r}) failed: {outcome.message}; pass "
            "--on-bad-record skip to list such records in _skipped.jsonl and go on"
        )
    for record, outcome in failed:
        writer.skip(record.index, record.id, outcome.message)
    good = [(r, o) for r, o in zip(records, outcomes, strict=True) if not isinstance(o, Failed)]
    if good:
        writer.write_batch([r for r, _ in good], [o for _, o in good])
    return len(good), len(failed)


def describe(exc: BaseException) -> str:
    """An exception as ``Type: message`` (just ``Type`` when it has no message)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
