"""What runs inside the engine process that :mod:`.engine_process` starts, and what crosses its
pipe.

The process loads the model itself (``load(*args)``, e.g. ``load_text_generator(spec, knobs)``),
so the weights, the step engine, the scheduler and its worker thread (the
:class:`~.continuous.ContinuousGenerator` over the torch engine, with its detokenizer and stop
strings) live there, under a GIL of their own. An event loop on its main thread answers the
parent's messages; the scheduler's deliveries go to the parent through the generator's
``outlet``, one message per delivery (one per engine step), never one per token or request.

Messages are tuples, pickled by ``multiprocessing.connection``. Parent to child:

- ``("submit", [(request_id, prompt_ids, params), ...])``: one request or several queued together
  (``TextGenerator.submit_many``); ``("abort", request_id)``, ``("stats",)``;
- ``("stop", drain, timeout_s)``: the generator's ``stop``; then the process exits.

Child to parent:

- ``("ready", Ready)`` once, when the generator has started; or ``("failed", error)`` when the
  load raised, and the process exits;
- ``("out", entries, stats)``: one delivery, ``entries`` of ``(request_id, delta, end)``, where
  ``delta`` is a :class:`~.stream.GenerationDelta` or ``None`` and ``end`` is ``None`` (still
  running), the :class:`~.stream.Completion` or an error (:func:`to_wire`); ``stats`` is a
  :class:`~.stats.GenerationStats` at most every :data:`STATS_EVERY_S` and whenever no request
  is left, else ``None``;
- ``("stats", GenerationStats)``: the answer to ``("stats",)``;
- ``("stopped", GenerationStats)``: the generator has stopped, every request has ended (their
  ``out`` came first).

The parent gone (its end of the pipe closed) stops the generator without draining: nobody is
left to read the outputs. SIGINT and SIGTERM are ignored: a Ctrl-C in a terminal, ``timeout``
and systemd (its default ``KillMode=control-group``) signal the whole process group, and the
parent, draining, still needs this process; it stops it once drained. (An exiting parent that
never stopped it kills it: ``engine_process``'s exit hook.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol, cast

from batchline._errors import (
    BatcherClosedError,
    ConstraintError,
    InputError,
    ModelError,
    QueueFullError,
    RecordTooLargeError,
)
from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import GenerationRequest, SamplingParams
from batchline.models.generation.engine_generator import Update
from batchline.models.generation.stream import GenerationStream, TextGenerator
from batchline.models.protocol import ModelInfo

__all__ = ["STATS_EVERY_S", "LoadedModel", "Ready", "from_wire", "run_engine_process", "to_wire"]

#: How often, at most, a delivery carries the generator's stats: the parent's ``stats`` are at
#: most this old while requests run (a scrape every 15 s needs no more), and a snapshot (its
#: percentiles sort up to 10,000 samples each) stays off most steps.
STATS_EVERY_S = 0.5

#: What an error may be rebuilt as on the other side: the same type and message.
_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        BatcherClosedError,
        ConstraintError,
        InputError,
        ModelError,
        QueueFullError,
        RecordTooLargeError,
        ValueError,
        RuntimeError,
    )
}


def to_wire(exc: BaseException) -> tuple[str, str]:
    """An error as the pipe carries it: its type's name and its message (a cause, which may
    hold a torch object, stays behind). A type :func:`from_wire` does not know travels as
    ``ModelError``."""
    for cls in type(exc).__mro__:  # the nearest known type (FixedBatchAxisError: ModelError)
        if _ERRORS.get(cls.__name__) is cls:
            return cls.__name__, str(exc)
    return "ModelError", f"{exc!r}"


def from_wire(error: tuple[str, str]) -> Exception:
    name, message = error
    return _ERRORS.get(name, ModelError)(message)


class LoadedModel(Protocol):
    """What the engine process needs of what ``load`` returns (``GenerationModel`` is one)."""

    @property
    def generator(self) -> TextGenerator: ...

    @property
    def info(self) -> ModelInfo: ...

    @property
    def max_context_tokens(self) -> int: ...

    @property
    def max_running(self) -> int: ...

    @property
    def max_waiting(self) -> int: ...

    @property
    def dtype(self) -> str: ...

    @property
    def weights(self) -> str: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Ready:
    """What the engine process says once its generator has started."""

    info: ModelInfo
    max_context_tokens: int
    kv_token_budget: int
    max_running: int
    max_waiting: int
    dtype: str
    weights: str
    #: seconds ``load(*args)`` took in the engine process
    load_s: float
    #: the token ids the model takes, ``[0, vocab_size)``, where its generator knows them
    vocab_size: int | None = None


def run_engine_process(
    conn: Connection, load: Callable[..., LoadedModel], args: tuple[object, ...], log_level: int
) -> None:
    """The engine process's main: load, start, serve the pipe until stopped, exit."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(levelname)s: [engine process %(process)d] %(message)s"
    )
    started = time.perf_counter()
    try:
        model = load(*args)
        generator = model.generator
        if not isinstance(generator, ContinuousGenerator):
            model.close()
            raise ModelError(
                f"the engine process runs the continuous generator, not {type(generator).__name__}"
            )
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(("failed", to_wire(exc)))
        conn.close()
        return
    try:
        asyncio.run(_Child(conn, model, generator).serve(time.perf_counter() - started))
    finally:
        model.close()
        conn.close()


class _Child:
    """The engine process's side of the pipe, on its event loop."""

    def __init__(
        self, conn: Connection, model: LoadedModel, generator: ContinuousGenerator
    ) -> None:
        self._conn = conn
        self._model = model
        self._gen = generator
        self._streams: dict[str, GenerationStream] = {}
        self._stats_at = 0.0
        self._stopping: asyncio.Task[None] | None = None
        self._stopped: asyncio.Future[None] | None = None

    async def serve(self, load_s: float) -> None:
        gen, model = self._gen, self._model
        gen.outlet = self._out
        await gen.start()
        self._send(
            (
                "ready",
                Ready(
                    model.info,
                    model.max_context_tokens,
                    gen.kv_token_budget,
                    model.max_running,
                    model.max_waiting,
                    model.dtype,
                    model.weights,
                    load_s,
                    gen.vocab_size,
                ),
            )
        )
        loop = asyncio.get_running_loop()
        self._stopped = loop.create_future()
        fd = self._conn.fileno()
        loop.add_reader(fd, self._on_readable)
        try:
            await self._stopped
        finally:
            loop.remove_reader(fd)

    def _send(self, message: tuple[object, ...]) -> None:
        # the parent gone: its reader has seen the pipe close, nobody is left to tell
        with contextlib.suppress(OSError):
            self._conn.send(message)

    def _out(self, updates: list[Update]) -> None:
        """The generator's delivery (one per step): one message to the parent."""
        entries: list[tuple[str, object, object]] = []
        for seq, update in updates:
            rid = seq.request_id
            if isinstance(update, BaseException):
                self._streams.pop(rid, None)
                entries.append((rid, None, to_wire(update)))
                continue
            if update.completion is not None:
                self._streams.pop(rid, None)
            entries.append((rid, update.delta, update.completion))
        now = time.monotonic()
        stats = None
        if not self._streams or now - self._stats_at >= STATS_EVERY_S:
            stats, self._stats_at = self._gen.stats, now
        self._send(("out", entries, stats))

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                self._on_message(self._conn.recv())
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            logging.getLogger("batchline.generation").warning(
                "engine process %d: its parent is gone; stopping", os.getpid()
            )
            self._stop(drain=False, timeout_s=None)

    def _on_message(self, message: tuple[object, ...]) -> None:
        kind = message[0]
        if kind == "submit":
            wire = cast(list[tuple[str, tuple[int, ...], SamplingParams]], message[1])
            try:
                requests = [GenerationRequest(*request) for request in wire]
                made = self._gen.submit_many(requests)
            except Exception as exc:  # the parent checked what it could: tell it the rest
                error = to_wire(exc)
                self._send(("out", [(request[0], None, error) for request in wire], None))
            else:
                for request, made_stream in zip(requests, made, strict=True):
                    self._streams[request.request_id] = made_stream
        elif kind == "abort":
            stream = self._streams.get(str(message[1]))
            if stream is not None:
                stream.abort()
        elif kind == "stats":
            self._send(("stats", self._gen.stats))
        elif kind == "stop":
            _, drain, timeout_s = message
            self._stop(drain=bool(drain), timeout_s=timeout_s)  # type: ignore[arg-type]
        else:
            raise ValueError(f"engine process: unknown message {kind!r}")

    def _stop(self, *, drain: bool, timeout_s: float | None) -> None:
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._do_stop(drain, timeout_s))

    async def _do_stop(self, drain: bool, timeout_s: float | None) -> None:
        assert self._stopped is not None
        try:
            await self._gen.stop(drain=drain, timeout_s=timeout_s)
            self._send(("stopped", self._gen.stats))
        except Exception as exc:  # serve() raises it: the process exits with its traceback
            self._stopped.set_exception(exc)
            return
        self._stopped.set_result(None)
