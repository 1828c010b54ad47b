"""The ``images`` job kind: a batch model over pictures (a folder, ``.tar`` shards, or a file
with ``--image-column``), its pictures decoded in worker processes, pipelined with the model's
batches; the kind is :data:`KIND`, at the end, and runs locally and on Ray replicas.

::

    records ──ImageRef──> reserve bytes ──> DecodePool (processes) ──pixels──> the model's
      (the reader waits here    │ (a picture's own failure:            engine (its bounded
       when the budget is full) │  a Failed, listed or fatal)          queue) ──> outcomes

:class:`ImageAdapter` starts one task per picture as soon as its bytes fit in the budget, so
the decode workers and the model overlap across blocks: a batch forms from whatever pictures
are ready, whichever block they came from. A picture whose bytes repeat a recent one's takes
that one's result (:class:`~batchline.jobs.batch.Seen`, keyed by content: the digest of its
bytes, taken by the worker that decodes it, so a duplicate's decode runs and its model call
does not). With ``--cache DIR`` the digest is taken here first, and a picture an earlier run
computed is neither decoded nor run.

After the first pictures it sets how many decode at once from what it measured
(:func:`~batchline.models.image.choose_workers`), unless ``--decode-workers`` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from batchline._errors import InputError
from batchline.datasets.outcomes import Failed, Outcome, describe
from batchline.datasets.sources import Record
from batchline.jobs.batch import Seen
from batchline.jobs.dataset import (
    ModelAdapter,
    dedupe_window,
    model_out_dir,
    open_job,
    plan_model_job,
    run_model_job,
)
from batchline.jobs.job import Job, JobKind, RayPlan
from batchline.models.batching import ModelBatcher
from batchline.models.image import DecodePool, ImagePreprocess, ImageRef, content_key

if TYPE_CHECKING:
    from batchline.datasets.pipeline import Progress
    from batchline.datasets.sinks import ChunkWriter
    from batchline.datasets.sources import Source
    from batchline.jobs.options import RunOptions
    from batchline.jobs.result_cache import ResultCache
    from batchline.jobs.summary import RunSummary
    from batchline.models.protocol import BatchModel, ModelInfo

__all__ = ["KIND", "ImageAdapter", "TimeSplit", "picture_key", "picture_ref"]

_Engine = ModelBatcher[object, object]


#: A URL's start (``https://``, ``s3://``...): a scheme, then ``//``.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def picture_ref(value: object, base: Path | None) -> ImageRef | str:
    """A record's picture as an :class:`ImageRef`, or why it has none: a folder's or a
    shard's reference as it is; a column's path (relative to the dataset file's folder
    ``base``), its bytes, or a ``{"bytes", "path"}`` struct (Hugging Face ``datasets``'
    Image feature in Parquet)."""
    if isinstance(value, ImageRef):
        return value
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        value = data if isinstance(data, bytes | bytearray) and data else path
    if isinstance(value, bytes | bytearray):
        return ImageRef(data=bytes(value)) if value else "the picture's bytes are empty"
    if isinstance(value, str) and _URL.match(value.strip()):
        # Path would read it as a relative path, its "//" collapsed: say what it is
        return f"{value.strip()} is a URL: run reads local files only (give the picture's path)"
    if isinstance(value, str) and value.strip():
        path = Path(value)
        if not path.is_absolute() and base is not None:
            path = base / path
        return ImageRef(path=str(path))
    if value is None or value == "":
        return "no picture (the column is empty or null)"
    return f"the picture column holds {type(value).__name__}, not a path or bytes"


def picture_key(value: object, base: Path | None, *, draft: bool) -> bytes | None:
    """A record's picture's content key (:func:`~batchline.models.image.content_key`, what
    duplicates and ``--cache`` compare), its bytes read here: the Ray driver finds an image
    job's duplicates with it, once per job. None for a record with no readable picture (the
    replica it is sent to says why). Sync: it reads the file."""
    ref = picture_ref(value, base)
    if isinstance(ref, str):
        return None
    try:
        data = ref.read()
    except InputError:
        return None
    return content_key(data, draft=draft)


@dataclass(frozen=True)
class TimeSplit:
    """Where a job's time went: the workers' seconds decoding, the model's seconds running
    batches, and its seconds idle while the job ran (waiting for pictures); the decode
    workers, and how many decoded at once at the end."""

    decode_s: float
    model_s: float
    wait_s: float
    workers: int
    active: int

    def text(self) -> str:
        """``decode 12.0 s (2 of 2 workers) / model 9.5 s / waiting 0.3 s``"""
        return (
            f"decode {self.decode_s:,.1f} s ({self.active} of {self.workers} workers) / "
            f"model {self.model_s:,.1f} s / waiting {self.wait_s:,.1f} s"
        )


class ImageAdapter:
    """:class:`~batchline.datasets.pipeline.Adapter` for a started image model's engine and
    a started :class:`DecodePool` (see the module docstring). ``base``: the folder relative
    picture paths in a column start from."""

    def __init__(
        self,
        engine: _Engine,
        pool: DecodePool,
        *,
        base: Path | None = None,
        dedupe_window: int = 0,
        cache: ResultCache | None = None,
        tune_workers: bool = True,
    ) -> None:
        self.engine = engine
        self.pool = pool
        self.base = base
        self.seen = Seen[asyncio.Future[Outcome]](dedupe_window) if dedupe_window > 0 else None
        self.cache = cache
        self._tune = tune_workers

    @property
    def duplicates(self) -> int:
        return 0 if self.seen is None else self.seen.duplicates

    def utilization(self) -> float:
        return self.engine.stats.utilization

    def split_text(self) -> str:
        """Where the job's time went, in a line (the summary's ``time split`` row)."""
        return self.time_split().text()

    def time_split(self) -> TimeSplit:
        stats = self.engine.stats
        decoding = self.pool.stats()
        return TimeSplit(
            decode_s=decoding.decode_s,
            model_s=stats.busy_time_s,
            wait_s=stats.idle_time_s,
            workers=decoding.workers,
            active=decoding.active,
        )

    async def submit(self, records: Sequence[Record]) -> asyncio.Future[list[Outcome]]:
        tasks: list[asyncio.Future[tuple[Outcome, bytes | None]]] = []
        try:
            for record in records:
                ref = picture_ref(record.input, self.base)
                if isinstance(ref, str):
                    failed = asyncio.get_running_loop().create_future()
                    failed.set_result((Failed(f"bad picture: {ref}"), None))
                    tasks.append(failed)
                    continue
                nbytes = self.pool.budget_of(ref)
                await self.pool.reserve(nbytes)  # the reader waits here while the budget is full
                tasks.append(asyncio.ensure_future(self._one(ref, nbytes)))
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        return asyncio.ensure_future(self._gather(tasks))

    async def _gather(
        self, tasks: list[asyncio.Future[tuple[Outcome, bytes | None]]]
    ) -> list[Outcome]:
        try:
            done = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        outcomes: list[Outcome] = []
        keep: dict[bytes, Outcome] = {}
        for got in done:
            if isinstance(got, BaseException):
                raise got  # not a picture's fault: a worker died, or the job is stopping
            outcome, cache_key = got
            outcomes.append(outcome)
            if cache_key is not None and not isinstance(outcome, Failed):
                keep[cache_key] = outcome
        if self.cache is not None and keep:
            await asyncio.to_thread(self.cache.put_many, keep)
        return outcomes

    async def _one(self, ref: ImageRef, nbytes: int) -> tuple[Outcome, bytes | None]:
        """One picture: decode, then its earlier duplicate's result, the cache's, or the
        model's; and the cache key to keep a newly computed result under."""
        mine: asyncio.Future[Outcome] | None = None
        try:
            cache_key = None
            if self.cache is not None:  # looked up before the decode: a hit skips it
                draft = self.pool.options.draft
                try:
                    key = await asyncio.to_thread(lambda: content_key(ref.read(), draft=draft))
                except InputError as exc:
                    return Failed(f"bad picture: {exc}"), None
                cache_key = self.cache.key(key)
                hits = await asyncio.to_thread(self.cache.get_many, [cache_key])
                if cache_key in hits:
                    return hits[cache_key], None
            try:
                decoded = await self.pool.decode(ref)
            except InputError as exc:
                return Failed(f"bad picture: {exc}"), None
            if self.seen is not None:
                found = self.seen.get(decoded.key)
                if found is not None:
                    return await asyncio.shield(found), None
                mine = asyncio.get_running_loop().create_future()
                self.seen.put(decoded.key, mine)
            queued = await self.engine.submit(decoded.pixels)
            del decoded  # the pixels are the batch's now
            try:
                result = await queued
            except Exception as exc:  # the batcher bisected its batch down to this picture
                return _settled(mine, Failed(f"model error: {describe(exc)}")), None
            outcome = _settled(mine, self.engine.model.encode(result))
            if self._tune:
                await self._maybe_tune()
            return outcome, cache_key
        except BaseException as exc:
            if mine is not None and not mine.done():
                if isinstance(exc, Exception):
                    mine.set_exception(exc)
                    mine.exception()  # retrieved: a duplicate may never ask
                else:
                    mine.cancel()
            raise
        finally:
            await self.pool.release(nbytes)

    async def _maybe_tune(self) -> None:
        """Once: decode at most as many pictures at once as keep up with the model."""
        if not self._tune:
            return
        slots = self.engine.knobs.max_concurrent_batches
        if await self.pool.size_from(self.engine.stats, slots):
            self._tune = False


def _settled(mine: asyncio.Future[Outcome] | None, outcome: Outcome) -> Outcome:
    """``outcome``, also given to the duplicates waiting on this picture."""
    if mine is not None and not mine.done():
        mine.set_result(outcome)
    return outcome


# -- the images kind -------------------------------------------------------------------------


def _reads_pictures(options: RunOptions) -> bool:
    """A job over pictures: a folder or ``.tar`` shards, or ``--image-column``."""
    return options.reads_pictures()


@contextlib.asynccontextmanager
async def _image_adapter(
    job: Job,
    model: BatchModel[object, object],
    engine: _Engine,
    cache: ResultCache | None,
) -> AsyncIterator[ModelAdapter]:
    """The model's decode workers (its ``preprocess`` in worker processes), and the pictures
    fed through them (:class:`ImageAdapter`)."""
    preprocess = getattr(model, "preprocess", None)
    if not isinstance(preprocess, ImagePreprocess):
        raise InputError(
            f"model {model.info.name!r} reads pictures but has no preprocess (an "
            "ImagePreprocess attribute): the decode workers need it"
        )
    options = job.options
    async with DecodePool(preprocess, options.decode) as pool:
        yield ImageAdapter(
            engine,
            pool,
            base=options.input.parent if options.input is not None else None,
            dedupe_window=dedupe_window(options),
            cache=cache,
            tune_workers=options.decode.workers is None,
        )


def _open(job: Job, info: ModelInfo) -> tuple[Source, ChunkWriter]:
    return open_job(job.options, info)  # a text model given pictures: the source says so


#: Pictures read and submitted at a time. A block is written once all its pictures are in, and
#: a stop keeps what is written: at a few pictures a second, blocks of 256 had a stop (or a
#: dead decode worker) drop a minute of the model's work per block in flight. Records in
#: flight stay as many (the decode budget bounds the pictures).
_PICTURE_BLOCK = 32


async def _run_local(job: Job, progress: Progress | None) -> RunSummary:
    return await run_model_job(
        job, progress, opener=_open, adapter=_image_adapter, block_records=_PICTURE_BLOCK
    )


def _plan_ray(job: Job) -> RayPlan:
    """On Ray, each unit's pictures are read and decoded on the replica that runs the model
    (in its own decode processes, as a local run's): decoded pixels never cross the network.
    The driver finds duplicates by each picture's content, its bytes read there."""
    options = job.options
    folder = options.input.parent if options.input is not None else None
    draft = options.decode.draft
    return plan_model_job(
        job,
        opener=_open,
        adapter=_image_adapter,
        key_of=lambda record: picture_key(record.input, folder, draft=draft),
    )


#: A batch model over pictures.
KIND = JobKind(
    "images",
    claims=_reads_pictures,
    run_local=_run_local,
    plan_ray=_plan_ray,
    out_dir=model_out_dir,
)
