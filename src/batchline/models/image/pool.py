"""Decode and preprocess pictures in worker processes, off the model's path.

:class:`DecodePool` runs ``preprocess(decode_image(bytes))`` (:func:`decode_one`) in a pool of
processes, not threads: Pillow holds the GIL for parts of its work, and the model's batches
run in this process. Work is admitted under a budget of bytes in flight (a picture's file
bytes and its float32 input, until the model has run it: :meth:`DecodePool.reserve`), so a
reader that runs ahead waits, and memory stays flat whatever the dataset's size. At most
:attr:`DecodePool.active` processes decode at once: the caller may lower it once it has
measured decode against the model (:func:`choose_workers`), so decode takes no more of the
CPU than the model can use.

    >>> async with DecodePool(preprocess, DecodeOptions(workers=2)) as pool:
    ...     await pool.reserve(ref.nbytes + pool.output_bytes)
    ...     decoded = await pool.decode(ref)      # a Decoded: key, pixels, decode_s
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from batchline._errors import ModelError
from batchline.models.image.decode import DEFAULT_MAX_PIXELS, ImageRef, decode_image
from batchline.models.image.preprocess import ImagePreprocess

if TYPE_CHECKING:
    import numpy as np

    from batchline._stats import BatchStats

__all__ = [
    "DEFAULT_BYTES_IN_FLIGHT",
    "DecodeOptions",
    "DecodePool",
    "DecodeStats",
    "Decoded",
    "choose_workers",
    "content_key",
    "decode_one",
]

#: Bytes of pictures in flight by default: files being decoded and inputs waiting for the model.
DEFAULT_BYTES_IN_FLIGHT = 256 << 20
#: A file of unknown size (a path in a column) is counted as this many bytes in flight.
_UNKNOWN_FILE_BYTES = 1 << 20
#: Pictures decoded, and batches run, before a pool is sized from measured costs.
_TUNE_AFTER_PICTURES = 32
_TUNE_AFTER_BATCHES = 2


@dataclass(frozen=True)
class DecodeOptions:
    """How pictures are decoded (``run``'s ``--decode-workers``, ``--no-draft``,
    ``--max-image-pixels``, ``--decode-memory``).

    ``workers=None``: as many processes as cores, of which as many decode at once as the
    measured cost of decode against the model's asks for (:func:`choose_workers`). ``draft``:
    decode a JPEG at reduced scale when the model's input is much smaller.
    """

    workers: int | None = None
    draft: bool = True
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_bytes_in_flight: int = DEFAULT_BYTES_IN_FLIGHT

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"decode workers must be >= 1, got {self.workers}")
        if self.max_pixels < 1:
            raise ValueError(f"the pixel limit must be >= 1, got {self.max_pixels}")
        if self.max_bytes_in_flight < 1:
            raise ValueError(f"the bytes in flight must be >= 1, got {self.max_bytes_in_flight}")


@dataclass(frozen=True, slots=True)
class Decoded:
    """One picture, ready for the model: ``key`` identifies its bytes (and the decode
    settings that change its pixels), ``pixels`` is the model's float32 ``(3, H, W)`` input,
    ``decode_s`` the seconds its worker spent on it."""

    key: bytes
    pixels: np.ndarray
    decode_s: float


@dataclass(frozen=True)
class DecodeStats:
    """A snapshot of what a pool did: pictures decoded (or refused), the workers' seconds on
    them, the processes and how many decode at once now."""

    decoded: int
    failed: int
    decode_s: float
    workers: int
    active: int

    @property
    def decode_s_per_image(self) -> float:
        done = self.decoded + self.failed
        return self.decode_s / done if done else math.nan


def content_key(data: bytes, *, draft: bool) -> bytes:
    """A 16-byte digest of a picture's bytes, with whether it was decoded in draft (which
    moves its pixels a little): what duplicates and the result cache compare."""
    return hashlib.blake2b(b"i" + (b"d" if draft else b"f") + data, digest_size=16).digest()


def decode_one(
    ref: ImageRef, preprocess: ImagePreprocess, *, draft: bool, max_pixels: int
) -> Decoded:
    """Read, decode and preprocess one picture (what a worker process runs)."""
    started = time.perf_counter()
    data = ref.read()
    key = content_key(data, draft=draft)
    image = decode_image(
        data, draft=preprocess.draft_size() if draft else None, max_pixels=max_pixels
    )
    pixels = preprocess(image)
    return Decoded(key, pixels, time.perf_counter() - started)


def choose_workers(decode_s: float, model_s: float, cores: int) -> int:
    """How many pictures to decode at once so that decode keeps up with the model: decode
    seconds per picture against the model's seconds per picture (at the rate it sustains),
    with a fifth more for the spread of sizes; at least one, at most ``cores``.

    >>> choose_workers(0.020, 0.010, cores=4)   # decode is twice as slow: 3 at once
    3
    """
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    if not decode_s > 0 or not math.isfinite(decode_s):
        return cores
    if not model_s > 0 or not math.isfinite(model_s):
        return cores
    return max(1, min(cores, math.ceil(1.2 * decode_s / model_s)))


# -- the worker processes' side --------------------------------------------------------------

_worker: tuple[ImagePreprocess, bool, int] | None = None


def _start_worker(preprocess: ImagePreprocess, draft: bool, max_pixels: int, owner: int) -> None:
    global _worker
    import threading

    from PIL import Image

    Image.MAX_IMAGE_PIXELS = None  # the limit is max_pixels, checked by decode_image
    _worker = (preprocess, draft, max_pixels)
    threading.Thread(target=_end_with, args=(owner,), daemon=True).start()


def _end_with(owner: int) -> None:
    """End this worker once the job's process is gone: killed (``kill -9``), it never says so,
    and a worker holds its own queue's both ends, so it would wait for work forever."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:  # the pid was taken by another user's process: ours is gone
            os._exit(0)


def _ready() -> bool:
    time.sleep(0.05)  # held a moment, so that each of the first calls starts a process
    return _worker is not None


def _decode_in_worker(ref: ImageRef) -> Decoded:
    assert _worker is not None, "the decode worker was not started"
    preprocess, draft, max_pixels = _worker
    return decode_one(ref, preprocess, draft=draft, max_pixels=max_pixels)


# -- this side -------------------------------------------------------------------------------


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[None]:
    """Start processes without them importing the caller's ``__main__`` again: they need
    only this module, and a script that calls ``run()`` without an ``if __name__ ==
    "__main__"`` guard would otherwise run its job again in every worker (and fail there)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    names: tuple[str, ...] = ("__file__", "__spec__")
    saved: dict[str, object] = {n: main.__dict__[n] for n in names if n in main.__dict__}
    try:
        main.__dict__.pop("__file__", None)
        main.__dict__["__spec__"] = None
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class DecodePool:
    """Worker processes decoding pictures for one model's ``preprocess`` (see the module
    docstring). Use it as an async context manager; its methods are called on one loop."""

    def __init__(
        self,
        preprocess: ImagePreprocess,
        options: DecodeOptions | None = None,
        *,
        cores: int | None = None,
    ) -> None:
        self.preprocess = preprocess
        self.options = options or DecodeOptions()
        machine = cores if cores is not None else (os.cpu_count() or 1)
        self.workers = self.options.workers or max(1, machine)
        #: processes decoding now: all the workers until set from measured costs
        self.active = self.workers
        self._executor: ProcessPoolExecutor | None = None
        self._retired: list[ProcessPoolExecutor] = []
        self._in_flight = 0
        self._changed: asyncio.Condition | None = None
        self._decoded = 0
        self._failed = 0
        self._decode_s = 0.0
        self._sized = False

    @property
    def output_bytes(self) -> int:
        """The bytes of one picture's model input (float32 ``(3, H, W)``), or a guess at them
        when the size depends on the picture (twice the square of the shortest edge)."""
        size = self.preprocess.output_size
        if size is not None:
            return 3 * size[0] * size[1] * 4
        edge = self.preprocess.shortest_edge or 224
        return 3 * edge * edge * 4 * 2

    def budget_of(self, ref: ImageRef) -> int:
        """What one picture counts against the bytes in flight: its file and its input."""
        return (ref.nbytes or _UNKNOWN_FILE_BYTES) + self.output_bytes

    async def __aenter__(self) -> DecodePool:
        self.start()
        await self.warm_up()
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.close)

    def start(self) -> None:
        """Start the worker processes (forked from a clean server process, not from this
        one, which runs threads)."""
        import PIL.Image  # noqa: F401  (here: a missing Pillow names its install, once)

        if self._executor is None:
            self._executor = self._new_executor(self.active)

    def _new_executor(self, workers: int) -> ProcessPoolExecutor:
        import multiprocessing

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["batchline.models.image.pool", "PIL.Image", "numpy"])
        options = self.options
        return ProcessPoolExecutor(
            max_workers=workers,
            mp_context=context,
            initializer=_start_worker,
            initargs=(self.preprocess, options.draft, options.max_pixels, os.getpid()),
        )

    async def warm_up(
        self, executor: ProcessPoolExecutor | None = None, count: int | None = None
    ) -> None:
        """Start every worker process now (they start on demand otherwise): the first
        pictures then wait for a decode, not for a process to import Pillow."""
        executor = executor or self._executor
        if executor is None:
            raise RuntimeError("the decode pool is not started")
        count = count or self.active
        with _main_not_reimported():  # each submit here starts one process
            ready = [executor.submit(_ready) for _ in range(count)]
        await asyncio.gather(*(asyncio.wrap_future(f) for f in ready))

    def close(self) -> None:
        """Stop the workers (pictures still waiting for one are dropped)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        for old in self._retired:
            old.shutdown(wait=True, cancel_futures=True)
        self._retired.clear()

    def stats(self) -> DecodeStats:
        return DecodeStats(self._decoded, self._failed, self._decode_s, self.workers, self.active)

    async def set_active(self, active: int) -> None:
        """Decode with ``active`` processes from now on (1 .. workers): a pool of that size
        is started and warmed, then takes the pictures submitted after it; the old one
        finishes what it holds and ends."""
        active = max(1, min(self.workers, active))
        if active == self.active or self._executor is None:
            self.active = active
            return
        fresh = self._new_executor(active)
        await self.warm_up(fresh, active)
        old, self._executor, self.active = self._executor, fresh, active
        old.shutdown(wait=False)  # what it holds still runs; then its processes end
        self._retired.append(old)

    @property
    def sized(self) -> bool:
        """Whether :meth:`size_from` has set the processes decoding from measured costs."""
        return self._sized

    async def size_from(self, model: BatchStats, slots: int) -> bool:
        """Once enough is measured (``_TUNE_AFTER_PICTURES`` decoded, ``_TUNE_AFTER_BATCHES``
        batches run), decode with as many processes as keep up with the model (``model``: its
        batcher's stats, ``slots`` batches at once; :func:`choose_workers`). True once done
        (``run``'s image job and a served image model both size their pools so); False while
        there is too little to go on."""
        if self._sized:
            return True
        decoding = self.stats()
        if decoding.decoded < _TUNE_AFTER_PICTURES or model.total_batches < _TUNE_AFTER_BATCHES:
            return False
        self._sized = True  # before the await: concurrent callers do not size it twice
        per_picture = model.busy_time_s / max(1, model.total_completed) / max(1, slots)
        if math.isfinite(per_picture):
            await self.set_active(
                choose_workers(decoding.decode_s_per_image, per_picture, self.workers)
            )
        return True

    async def reserve(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more fit in the bytes in flight (one picture larger than the
        whole budget goes alone), then count them: the reader's backpressure."""
        changed = self._condition()
        cap = self.options.max_bytes_in_flight
        async with changed:
            await changed.wait_for(lambda: self._in_flight == 0 or self._in_flight + nbytes <= cap)
            self._in_flight += nbytes

    async def release(self, nbytes: int) -> None:
        """``nbytes`` of :meth:`reserve` are no longer held."""
        self._in_flight = max(0, self._in_flight - nbytes)
        changed = self._condition()
        async with changed:  # the reader is its one waiter: no herd to wake
            changed.notify_all()

    @property
    def bytes_in_flight(self) -> int:
        return self._in_flight

    async def decode(self, ref: ImageRef) -> Decoded:
        """Decode one picture in a worker (queued behind the others: the budget of bytes
        bounds how many wait); the picture's own failure is raised (an ``InputError``)."""
        executor = self._executor
        if executor is None:
            raise RuntimeError("the decode pool is not started: use it as `async with`")
        try:
            decoded: Decoded = await asyncio.wrap_future(executor.submit(_decode_in_worker, ref))
        except BrokenProcessPool:
            raise ModelError(
                "a decode worker process died (a picture that crashes the decoder, or the "
                "machine ran out of memory); the committed records are kept: go on with "
                "--resume, with --decode-memory lower if memory ran short"
            ) from None
        except BaseException:
            self._failed += 1
            raise
        self._decoded += 1
        self._decode_s += decoded.decode_s
        return decoded

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed
