"""A batch model as the dataset pipeline's adapter (``batchline run`` of an embed, classify or
predict model; each Ray replica runs the same functions).

A block of records is prepared off the event loop and queued in the model's engine
(:func:`submit_block`; the engine's bounded queue is the backpressure), then each record's
result is encoded, or its failure named (:func:`collect`).

A record whose input is the same as one of the last ``dedupe_window`` distinct inputs (a text,
or a score pair of texts) is not computed again: it takes that input's result, the same
object, when it is ready (:class:`Seen`). The models this runs are functions of their input
(a user's Python model may not be: ``run`` turns this off for it).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from batchline._errors import InputError
from batchline.datasets.outcomes import Failed, Outcome, describe, told
from batchline.datasets.sources import Record
from batchline.models.batching import ModelBatcher

if TYPE_CHECKING:
    from batchline.jobs.result_cache import ResultCache

__all__ = [
    "DEDUPE_WINDOW",
    "BatchAdapter",
    "Seen",
    "cancel",
    "collect",
    "prepare_block",
    "queue_block",
    "settle",
    "submit_block",
]


class Cached:
    """A record's encoded result, taken from an earlier run (``--cache``)."""

    __slots__ = ("outcome",)

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome


#: What a queued record waits on: its future, or its outcome already known (its failure, or
#: its cached result).
Pending = asyncio.Future[object] | Failed | Cached
#: A started batch model, whatever its prepared items and results are.
_Engine = ModelBatcher[object, object]
W = TypeVar("W")  # what a seen input waits on: a Pending (or a generation's own)


def input_key(value: object) -> bytes | None:
    """What identifies an input for :class:`Seen` and the result cache: a 16-byte digest of a
    text, or of a mapping of texts (a score pair, in key order); None for anything else
    (tensors are not compared). A digest, not the text: the window holds 16,384 of them
    whatever the texts' length."""
    if isinstance(value, str):
        data = b"t" + value.encode("utf-8", "surrogatepass")
    elif isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        data = b"p" + json.dumps(value, sort_keys=True, ensure_ascii=False).encode(
            "utf-8", "surrogatepass"
        )
    else:
        return None
    return hashlib.blake2b(data, digest_size=16).digest()


#: Distinct inputs a job keeps to answer their duplicates from (texts and their results: ~2
#: KiB each for a 384-float embedding, ~35 MiB in all).
DEDUPE_WINDOW = 16_384


class Seen(Generic[W]):
    """The last ``window`` distinct inputs of a job and what each waits on (its result, once
    done), least recently used first out; ``duplicates`` counts the records answered from
    here."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"the dedupe window must be >= 1, got {window}")
        self.window = window
        self.duplicates = 0
        self._pending: OrderedDict[bytes, W] = OrderedDict()

    def get(self, key: bytes) -> W | None:
        found = self._pending.get(key)
        if found is not None:
            self._pending.move_to_end(key)
            self.duplicates += 1
        return found

    def put(self, key: bytes, pending: W) -> None:
        self._pending[key] = pending
        if len(self._pending) > self.window:
            self._pending.popitem(last=False)


class BatchAdapter:
    """:class:`~batchline.datasets.pipeline.Adapter` for a started :class:`ModelBatcher`;
    ``take`` is what the model is given of a record (default: its input, as read);
    ``dedupe_window``: inputs kept to answer duplicates from (:class:`Seen`; 0: none)."""

    def __init__(
        self,
        engine: _Engine,
        take: Callable[[Record], object] | None = None,
        *,
        dedupe_window: int = 0,
        cache: ResultCache | None = None,
    ) -> None:
        self.engine = engine
        self.take = take
        self.seen = Seen[Pending](dedupe_window) if dedupe_window > 0 else None
        self.cache = cache

    @property
    def duplicates(self) -> int:
        """Records answered from an earlier identical input's computation."""
        return 0 if self.seen is None else self.seen.duplicates

    def split_text(self) -> str:
        """Where the job's time went ("": a batch model's job says it in its batch figures)."""
        return ""

    async def submit(self, records: Sequence[Record]) -> asyncio.Future[list[Outcome]]:
        take = self.take
        inputs = [r.input for r in records] if take is None else [take(r) for r in records]
        if self.seen is None and self.cache is None:
            queued = await submit_block(self.engine, inputs)
            return asyncio.ensure_future(collect(self.engine, queued))
        pending, store = await self._submit_new(inputs)
        return asyncio.ensure_future(self._collect(pending, store))

    async def _submit_new(self, inputs: Sequence[object]) -> tuple[list[Pending], dict[int, bytes]]:
        """Queue the inputs neither seen before in this job (:class:`Seen`) nor cached by an
        earlier run, once each; the others wait on the first, or take the cached result.
        Also: where each newly computed result will be (a record's place), under its cache
        key, to keep it once done."""
        seen, cache = self.seen, self.cache
        slots: list[int | Pending] = []  # an int: the place of the input among ``new``
        new: list[object] = []
        keys: list[bytes | None] = []
        first: dict[bytes, int] = {}  # this block's new inputs
        for value in inputs:
            key = input_key(value)
            if seen is not None and key is not None:
                if key in first:
                    seen.duplicates += 1
                    slots.append(first[key])
                    continue
                found = seen.get(key)
                if found is not None:
                    slots.append(found)
                    continue
                first[key] = len(new)
            slots.append(len(new))
            new.append(value)
            keys.append(key)
        at: dict[int, Pending] = {}
        cache_keys: dict[int, bytes] = {}
        if cache is not None:
            cache_keys = {i: cache.key(k) for i, k in enumerate(keys) if k is not None}
            hits = await asyncio.to_thread(cache.get_many, cache_keys.values())
            at = {i: Cached(hits[c]) for i, c in cache_keys.items() if c in hits}
        compute = [i for i in range(len(new)) if i not in at]
        queued = await submit_block(self.engine, [new[i] for i in compute]) if compute else []
        at.update(zip(compute, queued, strict=True))
        if seen is not None:
            for key, place in first.items():
                seen.put(key, at[place])
        store: dict[int, bytes] = {}  # a record's place -> its computed result's cache key
        for record, slot in enumerate(slots):
            if isinstance(slot, int) and not isinstance(at[slot], Cached):
                key_of_slot = cache_keys.pop(slot, None)  # the first record of that input
                if key_of_slot is not None:
                    store[record] = key_of_slot
        return [at[s] if isinstance(s, int) else s for s in slots], store

    async def _collect(self, pending: list[Pending], store: Mapping[int, bytes]) -> list[Outcome]:
        outcomes = await collect(self.engine, pending)
        if self.cache is not None and store:
            results = {
                key: outcomes[place]
                for place, key in store.items()
                if not isinstance(outcomes[place], Failed)
            }
            await asyncio.to_thread(self.cache.put_many, results)
        return outcomes

    def utilization(self) -> float:
        return self.engine.stats.utilization


async def submit_block(
    engine: _Engine, inputs: Sequence[object]
) -> list[asyncio.Future[object] | Failed]:
    """Prepare ``inputs`` off the event loop and queue them (waiting for room in the queue);
    a record that ``prepare`` refuses is its :class:`Failed` at once."""
    prepared = await asyncio.to_thread(prepare_block, engine, inputs)
    return await queue_block(engine, prepared)


def prepare_block(engine: _Engine, inputs: Sequence[object]) -> list[object]:
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
    engine: _Engine, prepared: Sequence[object]
) -> list[asyncio.Future[object] | Failed]:
    """Queue prepared items (waiting for room in the queue); an exception ``prepare`` gave for
    an input is its :class:`Failed`."""
    pending: list[asyncio.Future[object] | Failed] = []
    try:
        for item in prepared:
            if isinstance(item, BaseException):
                pending.append(Failed(f"bad input: {told(item)}"))
            else:
                pending.append(await engine.submit(item))
    except BaseException:
        cancel(pending)
        raise
    return pending


async def collect(engine: _Engine, pending: Sequence[Pending]) -> list[Outcome]:
    """Wait for every queued record and encode its result; one record's exception (the batcher
    has bisected its batch down to it) is that record's :class:`Failed`, in order."""
    await settle(pending)
    encode = engine.model.encode
    outcomes: list[Outcome] = []
    for f in pending:
        if isinstance(f, Failed):
            outcomes.append(f)
            continue
        if isinstance(f, Cached):
            outcomes.append(f.outcome)
            continue
        exc = f.exception()
        if exc is None:
            outcomes.append(encode(f.result()))
        elif isinstance(exc, Exception):
            outcomes.append(Failed(f"model error: {describe(exc)}"))
        else:  # KeyboardInterrupt and the like are not a record's fault
            raise exc
    return outcomes


async def settle(pending: Sequence[object]) -> None:
    """Wait until every record of ``pending`` has its result or its exception (read them from
    the futures); cancelled meanwhile, withdraw them all."""
    try:
        await asyncio.gather(
            *(f for f in pending if isinstance(f, asyncio.Future)), return_exceptions=True
        )
    except BaseException:
        cancel(pending)
        raise


def cancel(pending: Sequence[object]) -> None:
    """Withdraw whatever is still queued (a stopping job)."""
    for f in pending:
        if isinstance(f, asyncio.Future):
            f.cancel()
