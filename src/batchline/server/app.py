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
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from batchline.server.errors import install_error_handlers
from batchline.server.gate import Gate
from batchline.server.metrics import ServerMetrics
from batchline.server.routes import include_routes
from batchline.server.settings import ServerSettings
from batchline.server.state import (
    BatchedModel,
    DirectModel,
    EmbeddingModel,
    ServerState,
    load_embedder,
)

__all__ = ["create_app"]

logger = logging.getLogger("batchline.server")


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
    include_routes(app)
    app.add_middleware(Gate, state=state)
    install_error_handlers(app)
    return app
