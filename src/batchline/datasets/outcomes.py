"""Per-record outcomes of a job over a dataset, handled once for every engine.

Whatever runs the records (a batch model here, a generator, a Ray replica, an HTTP replica)
turns each record's fate into an :data:`Outcome`: its result (with extra output columns, a
:class:`Result`), or a :class:`Failed`. :func:`write_outcomes` (where the output is written)
hands the results to the chunk writer and the failures to ``_skipped.jsonl`` or stops the job,
by the job's ``on_bad_record`` rule. Outcomes are plain picklable values, so they cross a Ray
boundary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from batchline._errors import BatchlineError, InputError

if TYPE_CHECKING:
    from batchline.datasets.sinks import ChunkWriter
    from batchline.datasets.sources import Record

__all__ = ["Failed", "Outcome", "Result", "Written", "describe", "told", "write_outcomes"]


@dataclass(frozen=True, slots=True)
class Failed:
    """A record the model could not take (bad input) or failed on (its own exception).

    ``record_fault=False`` marks a failure on the way (an HTTP request that failed for good):
    the record is always listed in ``_skipped.jsonl`` and counted as failed, and the job goes
    on whatever ``on_bad_record`` says.
    """

    message: str
    record_fault: bool = True


@dataclass(frozen=True, slots=True)
class Result:
    """A result with more output columns than the result column (a completion's
    ``finish_reason`` and token counts)."""

    value: object
    columns: Mapping[str, object]


Outcome = object  # an encoded result, a Result, or a Failed


class Written(NamedTuple):
    """What :func:`write_outcomes` did with a block: rows written, records skipped, and of
    those the ones that failed on the way (``Failed.record_fault`` false)."""

    written: int
    skipped: int
    failed: int


def write_outcomes(
    writer: ChunkWriter,
    records: Sequence[Record],
    outcomes: Sequence[Outcome],
    *,
    on_bad_record: str,
) -> Written:
    """Write the results and list the failures.

    With ``on_bad_record="fail"`` the first failure that is the record's fault stops the job
    (``InputError`` naming the record) before anything of this block is written. Sync: call it
    in a worker thread.
    """
    if len(records) != len(outcomes):
        raise ValueError(f"got {len(outcomes)} outcomes for {len(records)} records")
    pairs = list(zip(records, outcomes, strict=True))
    failed = [(r, o) for r, o in pairs if isinstance(o, Failed)]
    if on_bad_record == "fail":
        for record, outcome in failed:
            if outcome.record_fault:
                raise InputError(
                    f"record {record.index} (id {record.id!r}) failed: {outcome.message}; pass "
                    "--on-bad-record skip to list such records in _skipped.jsonl and go on"
                )
    for record, outcome in failed:
        writer.skip(record.index, record.id, outcome.message)
    rows: list[Record] = []
    values: list[object] = []
    for record, got in pairs:
        if isinstance(got, Result):
            rows.append(dataclasses.replace(record, extra={**record.extra, **got.columns}))
            values.append(got.value)
        elif not isinstance(got, Failed):
            rows.append(record)
            values.append(got)
    if rows:
        writer.write_batch(rows, values)
    on_the_way = sum(not o.record_fault for _, o in failed)
    return Written(len(rows), len(failed), on_the_way)


def describe(exc: BaseException) -> str:
    """An exception as ``Type: message`` (just ``Type`` when it has no message)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def told(exc: BaseException) -> str:
    """A record's input error as its user reads it: the message alone where it is a check's
    own words (a ``ValueError``, or an error batchline raises, which name the fix), else as
    :func:`describe` gives it (a ``TypeError`` deep in a model's ``prepare``)."""
    text = str(exc).strip()
    if text and isinstance(exc, ValueError | BatchlineError):
        return text
    return describe(exc)
