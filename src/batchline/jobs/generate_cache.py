"""The completions a generation job takes instead of generating a request
(:class:`~batchline.jobs.generate.GeneratorAdapter`): those of an identical recent request of
the job (dedupe), and with ``batchline run --cache DIR`` those an earlier run kept.

Both go by :func:`request_key`: the prompt's token ids and every sampling setting (stop
strings and constraints included); a request sampled without a seed has none, and is always
generated (and never kept). The cache is the job's
:class:`~batchline.jobs.result_cache.ResultCache`, opened under the generator's identity
(:func:`batchline.models.identity.model_identity` with the job's knobs: its files, backend,
dtype and kind of device). A completion is kept as JSON (no pickle): what its output row holds,
its text and its other columns (finish reason, token counts), so a record answered from there
is written as the computed one was; one that JSON cannot give back exactly is not kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from batchline.datasets.outcomes import Outcome, Result
from batchline.jobs.batch import Cached, Seen
from batchline.jobs.requests import deterministic
from batchline.jobs.result_cache import ResultCache
from batchline.models.generation import SamplingParams

if TYPE_CHECKING:
    from batchline.models.generation import Completion

__all__ = ["Answers", "CompletionCache", "request_key"]


def request_key(ids: Sequence[int], params: SamplingParams) -> bytes | None:
    """What identifies a request whose completion does not depend on chance: a 16-byte digest
    of its prompt's token ids and its settings; None for sampling without a seed (each
    request a draw of its own). Greedy decoding (temperature 0) ignores the seed, so greedy
    requests that differ only in their seed (a job's ``--seed`` gives each record its own)
    share a key, and so do requests that differ only in their priority (it orders admission,
    never the tokens). Every other field of ``SamplingParams`` is in the key (its repr): the
    key is also the result cache's, across runs."""
    if not deterministic(params):
        return None
    params = dataclasses.replace(params, priority=0)
    if params.temperature == 0:
        params = dataclasses.replace(params, seed=None, top_p=1.0)
    data = array("q", ids).tobytes() + repr(params).encode()
    return hashlib.blake2b(data, digest_size=16).digest()


class CompletionCache:
    """Completions kept across runs in ``store``, looked up and kept a block at a time (the
    SQLite work in a worker thread)."""

    def __init__(self, store: ResultCache) -> None:
        self.store = store

    async def lookup(self, keys: Iterable[bytes]) -> dict[bytes, Cached]:
        """The kept completions of these request keys (those the cache holds), as outcomes."""
        wanted = {self.store.key(k): k for k in keys}
        if not wanted:
            return {}
        found = await asyncio.to_thread(self.store.get_many, wanted)
        hits: dict[bytes, Cached] = {}
        for stored_as, value in found.items():
            outcome = _outcome(value)
            if outcome is not None:
                hits[wanted[stored_as]] = Cached(outcome)
        return hits

    async def keep(self, outcomes: Sequence[Outcome], keys: Mapping[int, bytes]) -> None:
        """Keep the completions of a block's computed records (a record's place in
        ``outcomes`` -> its request key); failures are not kept."""
        values = {
            self.store.key(key): _value(outcome)
            for place, key in keys.items()
            if isinstance(outcome := outcomes[place], Result)
        }
        if values:
            await asyncio.to_thread(self.store.put_many, values)

    def close(self) -> None:
        self.store.close()


class Answers:
    """Where a job's requests are answered from without generating: a duplicate of one of its
    last ``dedupe_window`` requests (:class:`~batchline.jobs.batch.Seen`; 0: none) waits on
    that one's completion; one an earlier run kept (``cache``) takes it, and so do its
    duplicates. ``duplicates`` and ``cached`` count the records answered each way."""

    def __init__(self, dedupe_window: int, cache: CompletionCache | None) -> None:
        self.seen: Seen[asyncio.Future[Completion] | Cached] | None = (
            Seen(dedupe_window) if dedupe_window > 0 else None
        )
        self.cache = cache
        self.cached = 0

    @property
    def keyed(self) -> bool:
        """Whether requests are looked up at all (their :func:`request_key` is needed)."""
        return self.seen is not None or self.cache is not None

    @property
    def duplicates(self) -> int:
        return 0 if self.seen is None else self.seen.duplicates

    async def kept(self, keys: Iterable[bytes | None]) -> dict[bytes, Cached]:
        """What an earlier run kept for a block's requests (call once a block, then
        :meth:`answer` each)."""
        if self.cache is None:
            return {}
        return await self.cache.lookup(k for k in keys if k is not None)

    def answer(
        self, key: bytes, kept: Mapping[bytes, Cached]
    ) -> asyncio.Future[Completion] | Cached | None:
        """The request's completion (or what it waits on), or None: generate it, then
        :meth:`generating`."""
        if self.seen is not None:
            first = self.seen.get(key)
            if isinstance(first, asyncio.Future | Cached):
                return first
        hit = kept.get(key)
        if hit is not None:
            self.cached += 1
            if self.seen is not None:
                self.seen.put(key, hit)
        return hit

    def generating(self, key: bytes, completion: asyncio.Future[Completion]) -> None:
        """``key``'s request is being generated: its duplicates wait on ``completion``."""
        if self.seen is not None:
            self.seen.put(key, completion)

    async def keep(self, outcomes: Sequence[Outcome], keys: Mapping[int, bytes]) -> None:
        """Keep a block's generated completions for later runs (:meth:`CompletionCache.keep`)."""
        if self.cache is not None and keys:
            await self.cache.keep(outcomes, keys)


def _value(outcome: Result) -> dict[str, object]:
    return {"text": outcome.value, "columns": dict(outcome.columns)}


def _outcome(value: object) -> Result | None:
    """A kept completion as the computed record's outcome; None for a value of another shape
    (not one this module wrote)."""
    if not isinstance(value, dict) or not isinstance(value.get("text"), str):
        return None
    columns = value.get("columns")
    return Result(value["text"], columns) if isinstance(columns, dict) else None
