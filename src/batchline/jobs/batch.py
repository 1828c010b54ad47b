"""A batch model as the dataset pipeline's adapter (``batchline run`` of an embed, classify or
predict model; each Ray replica runs the same functions).

A block of records is prepared off the event loop and queued in the model's engine
(:func:`submit_block`; the engine's bounded queue is the backpressure), then each record's
result is encoded, or its failure named (:func:`collect`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from batchline._errors import InputError
from batchline.datasets.outcomes import Failed, Outcome, describe
from batchline.datasets.sources import Record
from batchline.models.batching import ModelBatcher

__all__ = [
    "BatchAdapter",
    "cancel",
    "collect",
    "prepare_block",
    "process_block",
    "queue_block",
    "settle",
    "submit_block",
]


class BatchAdapter:
    """:class:`~batchline.datasets.pipeline.Adapter` for a started :class:`ModelBatcher`;
    ``take`` is what the model is given of a record (default: its input, as read)."""

    def __init__(
        self, engine: ModelBatcher[Any, Any], take: Callable[[Record], object] | None = None
    ) -> None:
        self.engine = engine
        self.take = take

    async def submit(self, records: Sequence[Record]) -> asyncio.Future[list[Outcome]]:
        take = self.take
        inputs = [r.input for r in records] if take is None else [take(r) for r in records]
        pending = await submit_block(self.engine, inputs)
        return asyncio.ensure_future(collect(self.engine, pending))

    def utilization(self) -> float:
        return self.engine.stats.utilization


async def submit_block(
    engine: ModelBatcher[Any, Any], inputs: Sequence[object]
) -> list[asyncio.Future[Any] | Failed]:
    """Prepare ``inputs`` off the event loop and queue them (waiting for room in the queue);
    a record that ``prepare`` refuses is its :class:`Failed` at once."""
    prepared = await asyncio.to_thread(prepare_block, engine, inputs)
    return await queue_block(engine, prepared)


def prepare_block(engine: ModelBatcher[Any, Any], inputs: Sequence[object]) -> list[object]:
    """The engine model's ``prepare`` of ``inputs``: one item or exception per input (sync:
    call it in a worker thread)."""
    model = engine.model
    prepared = model.prepare(list(inputs))
    if len(prepared) != len(inputs):
        raise InputError(
            f"model {model.info.name!r}: prepare() returned {len(prepared)} items for "
            f"{len(inputs)} inputs"
        )
    return list(prepared)


async def queue_block(
    engine: ModelBatcher[Any, Any], prepared: Sequence[object]
) -> list[asyncio.Future[Any] | Failed]:
    """Queue prepared items (waiting for room in the queue); an exception ``prepare`` gave for
    an input is its :class:`Failed`."""
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
    await settle(pending)
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


async def settle(pending: Sequence[asyncio.Future[Any] | Failed]) -> None:
    """Wait until every record of ``pending`` has its result or its exception (read them from
    the futures); cancelled meanwhile, withdraw them all."""
    try:
        await asyncio.gather(
            *(f for f in pending if not isinstance(f, Failed)), return_exceptions=True
        )
    except BaseException:
        cancel(pending)
        raise


def cancel(pending: Sequence[asyncio.Future[Any] | Failed]) -> None:
    """Withdraw whatever is still queued (a stopping job)."""
    for f in pending:
        if not isinstance(f, Failed):
            f.cancel()
