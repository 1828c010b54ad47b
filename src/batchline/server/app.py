"""``create_app``: one model and one shared batcher per replica, behind a FastAPI app.

Every request's texts are tokenized, then submitted one record each to the model's
``TokenBatcher`` with ``submit_nowait``, so records from concurrent requests share batches and
a full queue is seen at once (429, ``Retry-After``). Model and batcher are loaded once, in
the app's lifespan, and live on ``app.state`` (``app.state.models``, ``app.state.batchers``).

Where a request can end:

==========================  ===========================================================
429 + ``Retry-After``        the queue cannot take all of the request's texts: none are queued
504                          ``request_timeout_s`` elapsed: its queued records are withdrawn
(no response)                the client disconnected: its queued records are withdrawn
503 + ``Retry-After``        the server is draining (SIGTERM) or the model is not loaded yet
400 / 413 / 422 / 401        empty input / too large / wrong types / missing or wrong API key
==========================  ===========================================================

Tokenizing: a request whose texts total at most ``tokenize_inline_max_chars`` characters is
tokenized on the event loop, a longer one in a worker thread. Measured on the 2-core machine
(MiniLM's tokenizer, one 14-token sentence): inline 35 us wall / 25 us CPU; through
``asyncio.to_thread`` 140 us wall / 95 us CPU one at a time, 65-77 us wall / 55-60 us CPU
per call with 32 in flight. The hop costs more than the work for short texts, and 1,024
characters keep the loop blocked for well under a millisecond.

``batching=False`` serves the baseline instead: one ONNX Runtime session with
``baseline_intra_op_threads`` threads shared by every request, each request's texts run in
chunks of ``baseline_batch_size`` through ``asyncio.to_thread``, no queue.

Example::

    from batchline.server import ServerSettings, create_app, serve

    app = create_app(ServerSettings(port=8000))   # an ASGI app: run it with any server
    serve(ServerSettings(port=8000))              # or let batchline run uvicorn (SIGTERM-safe)
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchline._errors import InputError, ModelError, QueueFullError
from batchline._stats import BatchStats
from batchline._tokens import TokenBatcher
from batchline.server.metrics import ModelMetrics, ServerMetrics
from batchline.server.settings import ServerSettings

if TYPE_CHECKING:
    from batchline.models import TokenizedText

__all__ = [
    "ApiError",
    "BatchedModel",
    "DirectModel",
    "EmbeddingModel",
    "ServedModel",
    "ServerState",
    "SoloWideEmbedder",
    "create_app",
    "load_embedder",
    "serve",
]

logger = logging.getLogger("batchline.server")

Vector = np.ndarray[Any, np.dtype[np.float32]]

# Paths that never need the API key nor count as work (probes and scrapes).
_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
# A request still running after this long starts watching for its client's disconnect.
_WATCH_AFTER_S = 0.02


class EmbeddingModel(Protocol):
    """What the server needs from a model; :class:`batchline.models.Embedder` is one."""

    @property
    def dim(self) -> int: ...

    def tokenize(self, texts: list[str]) -> list[TokenizedText]: ...

    def embed_tokens(self, texts: Sequence[TokenizedText]) -> npt.NDArray[np.float32]: ...


class ApiError(Exception):
    """An error that becomes an HTTP response: ``{"detail": ..., "error": {...}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        *,
        headers: dict[str, str] | None = None,
        detail: Any = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.headers = headers
        self.detail = detail

    def response(self) -> JSONResponse:
        return error_response(
            self.status, self.message, self.kind, headers=self.headers, detail=self.detail
        )


def error_response(
    status: int,
    message: str,
    kind: str,
    *,
    headers: dict[str, str] | None = None,
    detail: Any = None,
) -> JSONResponse:
    """The server's error body: FastAPI's ``detail`` plus OpenAI's ``error`` object."""
    body = {
        "detail": message if detail is None else detail,
        "error": {"message": message, "type": kind, "code": status},
    }
    return JSONResponse(body, status_code=status, headers=headers)


# -- models ---------------------------------------------------------------------------------


class ServedModel:
    """One model as the routes see it: ``await embed(texts)`` gives vectors and a token count.

    Subclasses decide how the texts reach the model (:class:`BatchedModel`,
    :class:`DirectModel`).
    """

    def __init__(
        self, name: str, embedder: EmbeddingModel, settings: ServerSettings, metrics: ModelMetrics
    ) -> None:
        self.name = name
        self.embedder = embedder
        self.settings = settings
        self.metrics = metrics
        self.dim = embedder.dim
        self.max_tokens = _token_limit(embedder)
        self.created = int(time.time())

    @property
    def batcher(self) -> TokenBatcher[Any, Vector] | None:
        return None

    def stats(self) -> BatchStats | None:
        """The batcher's stats snapshot (``None`` without a batcher)."""
        return None

    async def start(self) -> None:
        """Start serving (start the batcher)."""

    async def stop(self, *, timeout_s: float | None = None) -> None:
        """Finish the work in hand, for at most ``timeout_s``."""

    async def embed(self, texts: list[str]) -> tuple[Sequence[Vector], int]:
        """Embed ``texts``; return the vectors in order and the number of tokens used."""
        raise NotImplementedError

    async def tokenize(self, texts: list[str]) -> list[TokenizedText]:
        """Tokenize on the loop when short (cheaper than a thread hop), else in a thread."""
        limit = self.settings.tokenize_inline_max_chars
        total = 0
        for t in texts:
            total += len(t)
            if total > limit:
                return await asyncio.to_thread(self._tokenize, texts)
        return self._tokenize(texts)

    def _tokenize(self, texts: list[str]) -> list[TokenizedText]:
        toks = self.embedder.tokenize(texts)
        if not self.settings.truncate and self.max_tokens is not None:
            limit = self.max_tokens
            for i, tok in enumerate(toks):
                if len(tok) >= limit and _overflows(self.embedder, texts[i]):
                    raise ApiError(
                        413,
                        f"input {i} is longer than this model's limit of {limit} tokens; "
                        "shorten it (the server is configured not to truncate)",
                        "input_too_long",
                    )
        return toks


@dataclass(slots=True)
class _Job:
    """A queued text: its tokens and when it was submitted (for the queue-wait histogram)."""

    tok: TokenizedText
    submitted: float


class BatchedModel(ServedModel):
    """Every request's texts go, one record each, through one shared ``TokenBatcher``."""

    def __init__(
        self, name: str, embedder: EmbeddingModel, settings: ServerSettings, metrics: ModelMetrics
    ) -> None:
        super().__init__(name, embedder, settings, metrics)
        slots = settings.max_concurrent_batches
        if slots is None:  # one batch in flight per session
            slots = getattr(getattr(embedder, "model", None), "sessions", settings.sessions)
        self._batcher: TokenBatcher[_Job, Vector] = TokenBatcher(
            self._process,
            target_batch_tokens=settings.target_batch_tokens,
            max_batch_size=settings.max_batch_size,
            max_queue_size=settings.max_queue_size,
            max_concurrent_batches=int(slots),
            min_batch_size=min(settings.min_batch_size, settings.max_batch_size),
            batch_timeout_s=settings.batch_timeout_s,
            bucket_width=settings.bucket_width,
            padding_slack=settings.padding_slack,
            name=f"serve-{name}",
        )

    @property
    def batcher(self) -> TokenBatcher[_Job, Vector]:
        return self._batcher

    def stats(self) -> BatchStats | None:
        return self._batcher.stats

    async def start(self) -> None:
        await self._batcher.start()

    async def stop(self, *, timeout_s: float | None = None) -> None:
        await self._batcher.stop(drain=True, timeout_s=timeout_s)

    def _process(self, batch: list[_Job]) -> list[Vector]:
        # runs in the batcher's worker thread; prometheus-client metrics are thread-safe
        if self.settings.model_thread_nice and not getattr(_thread_state, "niced", False):
            _lower_thread_priority(self.settings.model_thread_nice)
        m = self.metrics
        started = time.perf_counter()
        observe_wait = m.queue_wait.observe
        longest = 0
        toks = []
        for job in batch:
            observe_wait(started - job.submitted)
            toks.append(job.tok)
            n = len(job.tok)
            if n > longest:
                longest = n
        vectors = self.embedder.embed_tokens(toks)
        m.batch_duration.observe(time.perf_counter() - started)
        m.batch_size.observe(len(batch))
        m.batch_cost.observe(len(batch) * longest)
        return list(vectors)

    async def embed(self, texts: list[str]) -> tuple[Sequence[Vector], int]:
        toks = await self.tokenize(texts)
        batcher = self._batcher
        if batcher.queue_depth + len(toks) > batcher.max_queue_size:
            raise QueueFullError(f"{batcher.name}: queue is full")
        now = time.perf_counter()
        futures: list[asyncio.Future[Vector]] = []
        tokens = 0
        try:
            for tok in toks:
                n = len(tok)
                tokens += n
                futures.append(batcher.submit_nowait(_Job(tok, now), estimated_tokens=n))
            if len(futures) == 1:
                return [await futures[0]], tokens
            return await asyncio.gather(*futures), tokens
        except BaseException:
            # 429, timeout, disconnect, shutdown: withdraw whatever is still queued
            for f in futures:
                f.cancel()
            raise


_thread_state = threading.local()


def _lower_thread_priority(delta: int) -> None:
    """Raise this thread's nice value by ``delta`` (Linux: nice is per thread).

    The model's threads then yield the CPU to the event loop, which parses requests and
    forms the next batch, instead of starving it while they compute.
    """
    _thread_state.niced = True
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + delta)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass


class DirectModel(ServedModel):
    """The baseline: each request runs its own texts on one shared session, no queue."""

    async def embed(self, texts: list[str]) -> tuple[Sequence[Vector], int]:
        toks = await self.tokenize(texts)
        size = self.settings.baseline_batch_size
        out: list[Vector] = []
        for start in range(0, len(toks), size):
            out.extend(await asyncio.to_thread(self._run, toks[start : start + size]))
        return out, sum(len(t) for t in toks)

    def _run(self, toks: list[TokenizedText]) -> list[Vector]:
        m = self.metrics
        started = time.perf_counter()
        vectors = self.embedder.embed_tokens(toks)
        m.batch_duration.observe(time.perf_counter() - started)
        m.batch_size.observe(len(toks))
        m.batch_cost.observe(len(toks) * max(len(t) for t in toks))
        return list(vectors)


def _token_limit(embedder: object) -> int | None:
    tokenizer = getattr(embedder, "tokenizer", None)
    trunc = getattr(tokenizer, "truncation", None)
    if isinstance(trunc, dict) and isinstance(trunc.get("max_length"), int):
        return int(trunc["max_length"])
    return None


def _overflows(embedder: object, text: str) -> bool:
    tokenizer: Any = getattr(embedder, "tokenizer", None)
    clean = text.encode("utf-8", "replace").decode("utf-8")
    return bool(tokenizer.encode(clean).overflowing)


def load_embedder(settings: ServerSettings) -> EmbeddingModel:
    """Load the model ``settings`` name, laid out for batching or for the baseline.

    Batching: ``sessions`` sessions of ``intra_op_threads`` threads, one per batch in
    flight, plus one of ``solo_intra_op_threads`` threads for a batch that runs alone (see
    :class:`SoloWideEmbedder`). Baseline: one session of ``baseline_intra_op_threads``
    threads that every request calls directly and concurrently.
    """
    from batchline.models import Embedder, OnnxModel, load_tokenizer, minilm

    max_length: int | None
    if settings.model == "default":
        model_path = minilm.default_model_path()
        tokenizer_path = (
            Path(settings.tokenizer)
            if settings.tokenizer
            else minilm.weights_dir() / "tokenizer.json"
        )
        max_length = settings.max_text_tokens or minilm.MAX_LENGTH
    else:
        model_path = Path(settings.model)
        tokenizer_path = tokenizer_file(settings)
        max_length = settings.max_text_tokens
    if settings.batching:
        model = OnnxModel.load(
            model_path,
            sessions=settings.sessions,
            intra_op_threads=settings.intra_op_threads,
            spinning=settings.spinning,
        )
    else:
        # one session that every request calls at once, none waiting for another
        model = OnnxModel.load(
            model_path,
            sessions=1,
            intra_op_threads=settings.baseline_intra_op_threads,
            spinning=settings.spinning,
            shared=True,
        )
    tokenizer, pad_id = load_tokenizer(tokenizer_path, max_length=max_length)
    embedder = Embedder(model, tokenizer, pad_id=pad_id)
    solo = settings.solo_intra_op_threads
    if settings.batching and solo is not None and solo > settings.intra_op_threads:
        wide = OnnxModel.load(
            model_path, sessions=1, intra_op_threads=solo, spinning=settings.spinning
        )
        return SoloWideEmbedder(embedder, Embedder(wide, tokenizer, pad_id=pad_id))
    return embedder


class SoloWideEmbedder:
    """Runs a batch on a wide session when no other batch is running, else on a narrow one.

    On a 2-core CPU two one-thread sessions give the most throughput when two batches run at
    once, but a batch running alone (low traffic: one request at a time) is faster on one
    two-thread session -- the baseline's layout. So the first batch after an idle spell takes
    the wide session, and batches that start while another runs take a narrow one. Costs one
    more session in memory.
    """

    def __init__(self, narrow: Any, wide: Any) -> None:
        self.narrow = narrow
        self.wide = wide
        self.tokenizer = getattr(narrow, "tokenizer", None)
        self.model = getattr(narrow, "model", None)  # its ``sessions`` set the batcher's slots
        self.solo_batches = 0
        self.shared_batches = 0
        self._lock = threading.Lock()
        self._running = 0

    @property
    def dim(self) -> int:
        return int(self.narrow.dim)

    def tokenize(self, texts: list[str]) -> list[TokenizedText]:
        toks: list[TokenizedText] = self.narrow.tokenize(texts)
        return toks

    def embed_tokens(self, texts: Sequence[TokenizedText]) -> npt.NDArray[np.float32]:
        with self._lock:
            alone = self._running == 0
            self._running += 1
            if alone:
                self.solo_batches += 1
            else:
                self.shared_batches += 1
        try:
            target = self.wide if alone else self.narrow
            vectors: npt.NDArray[np.float32] = target.embed_tokens(texts)
            return vectors
        finally:
            with self._lock:
                self._running -= 1


def tokenizer_file(settings: ServerSettings) -> Path:
    """The tokenizer of a ``.onnx`` model: ``--tokenizer`` or ``tokenizer.json`` beside it."""
    if settings.tokenizer:
        return Path(settings.tokenizer)
    guess = Path(settings.model).with_name("tokenizer.json")
    if not guess.is_file():
        raise InputError(
            f"no tokenizer for {settings.model}: pass --tokenizer PATH/tokenizer.json "
            f"(looked for {guess})"
        )
    return guess


# -- state ----------------------------------------------------------------------------------


@dataclass
class ServerState:
    """What the app knows about itself; ``app.state.server``."""

    settings: ServerSettings
    metrics: ServerMetrics
    models: dict[str, ServedModel] = field(default_factory=dict)
    ready: bool = False
    draining: bool = False
    in_flight: int = 0
    api_key: bytes | None = None
    _idle: asyncio.Event | None = None

    @property
    def default_model(self) -> ServedModel:
        return next(iter(self.models.values()))

    def begin_drain(self) -> None:
        """Stop taking work: ``/ready`` turns false, new model requests get 503."""
        if not self.draining:
            logger.info("draining: %d request(s) in flight", self.in_flight)
        self.draining = True
        self.ready = False

    async def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait until no request is in flight (at most ``timeout_s``); True if idle."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            logger.warning(
                "drain timed out after %ss with %d request(s) in flight", timeout_s, self.in_flight
            )
            return False
        return True

    def _enter(self) -> None:
        self.in_flight += 1

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()


# -- the gate: auth, draining, body size, disconnects ---------------------------------------


class _Gatekeeper:
    """Pure ASGI middleware in front of the model routes.

    In order: API key (401), draining or not loaded (503), body size (413, on Content-Length
    and on the bytes actually read). It reads the body itself and hands it to the app in one
    piece, then (once the request has lasted ``_WATCH_AFTER_S``) watches the connection: a
    client that disconnects has its request task cancelled, which withdraws the request's
    queued records.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        st = self.state
        if st.api_key is not None and not _authorized(scope, st.api_key):
            await _reply(
                scope,
                receive,
                send,
                error_response(
                    401,
                    "missing or invalid API key; send 'Authorization: Bearer <key>'",
                    "authentication_error",
                    headers={"WWW-Authenticate": "Bearer"},
                ),
            )
            return
        if st.draining or not st.ready:
            why = "the server is shutting down" if st.draining else "the model is not loaded yet"
            if st.draining and st.models:
                st.default_model.metrics.rejected("draining")
            await _reply(
                scope,
                receive,
                send,
                error_response(
                    503,
                    f"{why}; retry on another replica or later",
                    "service_unavailable",
                    headers={"Retry-After": str(st.settings.retry_after_s), "Connection": "close"},
                ),
            )
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            st._enter()
            try:
                await self.app(scope, receive, send)
            finally:
                st._leave()
            return
        st._enter()
        try:
            await self._with_body(scope, receive, send)
        finally:
            st._leave()

    async def _with_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.state.settings.max_body_bytes
        too_large = error_response(
            413,
            f"request body is larger than max_body_bytes={limit}; send fewer or shorter texts",
            "request_too_large",
            headers={"Connection": "close"},
        )
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0:
                    bad = error_response(400, "invalid Content-Length", "invalid_request_error")
                    await _reply(scope, receive, send, bad)
                    return
                if declared > limit:
                    await _reply(scope, receive, send, too_large)
                    return
        first = await receive()
        if first["type"] == "http.disconnect":
            return  # the client left before sending its body
        body = first.get("body", b"")
        if len(body) > limit:
            await _reply(scope, receive, send, too_large)
            return
        if first.get("more_body", False):
            # a body in pieces: read the rest, bounded in size and in time (a client that
            # trickles its body must not hold a slot forever)
            try:
                async with asyncio.timeout(self.state.settings.request_timeout_s):
                    rest = await _read_rest(receive, limit - len(body))
            except TimeoutError:
                slow = error_response(
                    408,
                    "the request body did not arrive within request_timeout_s",
                    "request_timeout",
                    headers={"Connection": "close"},
                )
                await _reply(scope, receive, send, slow)
                return
            if rest is None:
                return
            if isinstance(rest, int):
                await _reply(scope, receive, send, too_large)
                return
            body += rest
        scope["batchline.body"] = body

        delivered = False
        finished = False
        disconnected = False
        response_started = False
        task = asyncio.current_task()

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def tracked_send(message: Message) -> None:
            nonlocal response_started
            response_started = True
            await send(message)

        async def watch() -> None:
            nonlocal disconnected
            message = await receive()
            if message["type"] == "http.disconnect" and not finished and not response_started:
                disconnected = True
                assert task is not None
                task.cancel()

        loop = asyncio.get_running_loop()
        watcher: asyncio.Task[None] | None = None

        def start_watching() -> None:
            nonlocal watcher
            if not finished:
                watcher = loop.create_task(watch())

        # Most requests are answered within milliseconds; watching them from the start would
        # cost a task each. A timer is cheaper; the watch starts only if the request lasts.
        timer = loop.call_later(_WATCH_AFTER_S, start_watching)
        try:
            await self.app(scope, replay, tracked_send)
        except asyncio.CancelledError:
            assert task is not None
            if disconnected and task.uncancel() == 0:
                if self.state.models:
                    self.state.default_model.metrics.cancelled("disconnect")
                return  # nobody is listening: no response
            raise
        finally:
            finished = True
            timer.cancel()
            if watcher is not None:
                watcher.cancel()


async def _read_rest(receive: Receive, room: int) -> bytes | int | None:
    """The rest of a body: bytes, or ``-1`` past ``room`` bytes, or ``None`` on disconnect."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        room -= len(chunk)
        if room < 0:
            return -1
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _authorized(scope: Scope, key: bytes) -> bool:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() != b"bearer":
                return False
            return hmac.compare_digest(token.strip(), key)
    return False


async def _reply(scope: Scope, receive: Receive, send: Send, response: Response) -> None:
    await response(scope, receive, send)


# -- the app --------------------------------------------------------------------------------


def create_app(
    settings: ServerSettings | None = None,
    *,
    load_model: Callable[[ServerSettings], EmbeddingModel] | None = None,
) -> FastAPI:
    """Build the ASGI app; its lifespan loads the model and starts the batcher.

    Args:
        settings: the knobs (default: ``ServerSettings()``, the default model on
            127.0.0.1:8000, API key from ``$BATCHLINE_API_KEY``).
        load_model: ``f(settings) -> model`` with ``dim``, ``tokenize`` and ``embed_tokens``
            (default: :func:`load_embedder`). Called once, in a worker thread, at startup.

    ``app.state.server`` is the :class:`ServerState`; ``app.state.models`` maps the served
    name to its :class:`ServedModel`, ``app.state.batchers`` to its ``TokenBatcher``.

    Example::

        app = create_app(ServerSettings(model="default", max_queue_size=4096))
        # uvicorn.run(app) -- or batchline.server.serve(settings), which drains on SIGTERM
    """
    from batchline.server.routes import router

    if settings is None:
        settings = ServerSettings.build()
    loader = load_model if load_model is not None else load_embedder
    metrics = ServerMetrics()
    state = ServerState(
        settings=settings,
        metrics=metrics,
        api_key=(
            settings.api_key.get_secret_value().encode("utf-8")
            if settings.api_key is not None
            else None
        ),
    )

    metrics.http_in_flight.set_function(lambda: state.in_flight)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        name = settings.served_name
        embedder = await asyncio.to_thread(loader, settings)
        kind = BatchedModel if settings.batching else DirectModel
        model = await asyncio.to_thread(kind, name, embedder, settings, metrics.for_model(name))
        state.models = {name: model}
        app.state.models = state.models
        app.state.batchers = {name: model.batcher} if model.batcher is not None else {}
        metrics.watch(name, model.stats)
        await model.start()
        state.ready = True
        state.draining = False
        logger.info(
            "model %s ready (%s, dim %d)",
            name,
            "batching" if settings.batching else "no batching",
            model.dim,
        )
        try:
            yield
        finally:
            state.begin_drain()
            await state.wait_idle(settings.drain_timeout_s)
            for m in state.models.values():
                await m.stop(timeout_s=settings.drain_timeout_s)

    app = FastAPI(
        title="batchline",
        summary="Embeddings behind one shared dynamic batcher.",
        lifespan=lifespan,
    )
    app.state.server = state
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.models = state.models
    app.state.batchers = {}
    app.include_router(router)
    app.add_middleware(_Gatekeeper, state=state)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    return app


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return validation_response(exc.errors())


def validation_response(errors: Sequence[Any]) -> JSONResponse:
    """422 with ``loc``/``msg``/``type`` of each error and never the input itself.

    (FastAPI's own handler echoes the input, and a NaN or a lone surrogate in it then
    breaks the JSON encoder: a 500 for a client's mistake.)
    """
    detail: list[dict[str, Any]] = []
    for err in errors:
        loc = [_safe(part) for part in err.get("loc", ())]
        detail.append(
            {"loc": loc, "msg": _safe(err.get("msg", "")), "type": _safe(err.get("type", ""))}
        )
    message = "invalid request"
    if detail:
        first = detail[0]
        where = ".".join(str(p) for p in first["loc"])
        message = f"{where}: {first['msg']}" if where else str(first["msg"])
    return error_response(422, message, "invalid_request_error", detail=detail)


def _safe(value: object) -> str | int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = value if isinstance(value, str) else str(value)
    return text.encode("utf-8", "replace").decode("utf-8")[:200]


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else "HTTP error"
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    headers = dict(exc.headers) if exc.headers else None
    return error_response(exc.status_code, detail, kind, headers=headers)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    logger.error("unexpected error on %s", request.url.path, exc_info=exc)
    return error_response(500, "internal server error", "server_error")


# -- running --------------------------------------------------------------------------------


def serve(settings: ServerSettings) -> int:
    """Run the app with uvicorn until SIGTERM/SIGINT; return 0 after a clean drain.

    The first signal starts a drain: ``/ready`` turns false, new model requests get 503,
    requests in flight finish (up to ``drain_timeout_s``), then uvicorn shuts down and the
    batcher drains. A second signal stops waiting. uvicorn re-raises the signal after its own
    graceful shutdown, so the process would exit -15; this runner does not.
    """
    import uvicorn

    app = create_app(settings)
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["loggers"]["batchline"] = {
        "handlers": ["default"],
        "level": settings.log_level.upper(),
        "propagate": False,
    }
    config = uvicorn.Config(
        app,
        log_config=log_config,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        lifespan="on",
        timeout_graceful_shutdown=max(1, math.ceil(settings.drain_timeout_s)),
        server_header=False,
    )
    server = _DrainingServer(config, app.state.server)
    server.run()  # uvicorn's loop factory: uvloop and httptools when installed
    if not server.started:
        raise ModelError("the server did not start; see the log above")
    return 0


try:
    import uvicorn as _uvicorn

    _ServerBase: Any = _uvicorn.Server
except ImportError:  # pragma: no cover - the server extra brings uvicorn
    _ServerBase = object


class _DrainingServer(_ServerBase):  # type: ignore[misc]
    """uvicorn's server with a drain phase before its shutdown, and no re-raised signal."""

    def __init__(self, config: Any, state: ServerState) -> None:
        super().__init__(config)
        self._state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._signals = 0

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Not calling super(): uvicorn would record the signal and raise it again on exit.
        self._signals += 1
        if self._signals > 1 or self._loop is None or not self.started:
            self.should_exit = True
            if self._signals > 2:
                self.force_exit = True
            return
        logger.info("signal %d: draining before shutdown", sig)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        assert self._loop is not None
        self._drain_task = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        self._state.begin_drain()
        await self._state.wait_idle(self._state.settings.drain_timeout_s)
        self.should_exit = True
