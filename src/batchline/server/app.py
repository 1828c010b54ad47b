"""``create_app``: the served models, each behind its own shared batcher, in a FastAPI app.

Every model is loaded once, in the app's lifespan, with ``models.loader.load_model(spec,
knobs)`` and batched by a ``models.engine.Engine`` (see :mod:`batchline.server.state`); the
routes pick a model by name and by task:

- ``POST /v1/embeddings`` (OpenAI-compatible): embed models, named by the body's ``model``;
- ``POST /generate`` (kept as it was): the first embed model;
- ``POST /classify``: classify models, named by the body's ``model``;
- ``POST /v2/models/{name}/infer`` (Open Inference Protocol): predict models with named
  tensors, and embed and classify models as text tensors, named by the path;
- ``GET /v1/models`` (every model and its task), ``/v2``, ``/v2/models/{name}``,
  ``/v2/models/{name}/ready``, ``/v2/health/live``, ``/v2/health/ready``, ``/health``,
  ``/ready``, ``/metrics``.

A body without ``model`` goes to the first served model of the route's task. A model of
another task gets 400 naming its task; an unknown model 404 listing the served ones.

Several models, one device: when more than one model is served with batching, their
batchers share ONE :class:`batchline.Device` whose slots are the machine's sessions
(``max_concurrent_batches``, one per session by default). The device is work-conserving (a
slot never idles while any model has work queued) and weighted-fair between busy models (the
weights are ``model_weights``, 1 each by default): a model with a long queue cannot starve
the others, and a lone busy model gets every slot. Each model still has its own queue
(``max_queue_size`` records), so one model's 429s never refuse another's requests. Each model
loads its own sessions (``sessions`` each); the shared slots bound how many batches run at
once across all of them. Until the core's ``Device`` is importable, each model keeps its
own ``max_concurrent_batches`` slots (a warning says so at startup).

Where a request can end:

==========================  ===========================================================
429 + ``Retry-After``        the queue cannot take all of the request's inputs: none are queued
504                          ``request_timeout_s`` elapsed: its queued records are withdrawn
(no response)                the client disconnected: its queued records are withdrawn
503 + ``Retry-After``        the server is draining (SIGTERM) or the models are not loaded yet
400 / 404                    empty or unusable input, wrong task / unknown model
413 / 422 / 401              too large / wrong types / missing or wrong API key
==========================  ===========================================================

``batching=False`` serves the baseline instead: one session per model with
``baseline_intra_op_threads`` threads shared by every request, each request's inputs run in
chunks of ``baseline_batch_size`` through ``asyncio.to_thread``, no queue.

Example::

    from batchline.server import ServerSettings, create_app, serve

    settings = ServerSettings(model=["emb=default", "clf=clf.onnx"], task=["clf=predict"])
    app = create_app(settings)   # an ASGI app: run it with any server
    serve(settings)              # or let batchline run uvicorn (SIGTERM-safe)
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI

from batchline.knobs import Knobs
from batchline.models.protocol import BatchModel
from batchline.models.specs import ModelSpec
from batchline.server.errors import install_error_handlers
from batchline.server.gate import Gate
from batchline.server.metrics import ServerMetrics
from batchline.server.routes import include_routes
from batchline.server.settings import ServerSettings
from batchline.server.state import ServedModel, ServerState

__all__ = ["ModelLoader", "create_app"]

logger = logging.getLogger("batchline.server")

#: ``f(spec, knobs) -> model``: how the app loads each served model.
ModelLoader = Callable[[ModelSpec, Knobs], BatchModel[Any, Any]]


def create_app(
    settings: ServerSettings | None = None,
    *,
    load_model: ModelLoader | None = None,
) -> FastAPI:
    """Build the ASGI app; its lifespan loads the models and starts their batchers.

    Args:
        settings: the knobs (default: ``ServerSettings()``, the default model on
            127.0.0.1:8000, API key from ``$BATCHLINE_API_KEY``).
        load_model: ``f(spec, knobs) -> BatchModel`` (default:
            :func:`batchline.models.loader.load_model`). Called once per model, in a worker
            thread, at startup.

    ``app.state.server`` is the :class:`ServerState`; ``app.state.models`` maps each served
    name to its :class:`ServedModel`, ``app.state.batchers`` to its batcher.

    Example::

        app = create_app(ServerSettings(model="default", max_queue_size=4096))
        # uvicorn.run(app) -- or batchline.server.serve(settings), which drains on SIGTERM
    """
    if settings is None:
        settings = ServerSettings.build()
    loader = load_model if load_model is not None else _default_loader()
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
        specs = settings.specs
        knobs = settings.knobs if settings.batching else settings.baseline_knobs
        device = _shared_device(knobs, len(specs)) if settings.batching else None
        models: dict[str, ServedModel[Any, Any]] = {}
        try:
            for spec in specs:
                model = await asyncio.to_thread(loader, spec, knobs)
                served: ServedModel[Any, Any] = ServedModel(
                    spec.name,
                    model,
                    settings,
                    knobs,
                    metrics.for_model(spec.name),
                    device=device,
                    weight=settings.model_weights.get(spec.name, 1.0),
                )
                models[spec.name] = served
                metrics.watch(spec.name, served.stats)
                await served.start()
                logger.info(
                    "model %s ready (%s, %s)",
                    spec.name,
                    served.task,
                    "batching" if settings.batching else "no batching",
                )
        except BaseException:
            for served in models.values():
                await served.stop(timeout_s=0)
            raise
        state.models.update(models)
        app.state.batchers.update(
            {name: m.batcher for name, m in models.items() if m.batcher is not None}
        )
        state.ready = True
        state.draining = False
        try:
            yield
        finally:
            state.begin_drain()
            await state.wait_idle(settings.drain_timeout_s)
            for served in state.models.values():
                await served.stop(timeout_s=settings.drain_timeout_s)

    app = FastAPI(
        title="batchline",
        summary="Models behind shared dynamic batchers.",
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


def _default_loader() -> ModelLoader:
    from batchline.models.loader import load_model

    return load_model


def _shared_device(knobs: Knobs, models: int) -> Any:
    """One ``batchline.Device`` for several models' batchers, or ``None``: one model needs
    none (its batcher's own slots are the device's), nor does a core without ``Device``."""
    if models < 2:
        return None
    device_class = getattr(importlib.import_module("batchline"), "Device", None)
    if device_class is None:
        logger.warning(
            "batchline.Device is not available: each of the %d models gets %d slots of its own",
            models,
            knobs.max_concurrent_batches,
        )
        return None
    return device_class(slots=knobs.max_concurrent_batches)
