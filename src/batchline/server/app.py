"""``create_app``: the served models, each behind its own shared batcher, in a FastAPI app.

Every model is loaded once, in the app's lifespan: a batch model with
``models.loader.load_model(spec, knobs)``, batched by a ``models.batching.ModelBatcher`` (see
:mod:`batchline.server.state`); a generate model with
``models.generation.load.load_text_generator(spec, knobs)``, whose one shared text generator
batches the sequences of every request (continuous batching by default). The routes pick a
model by name and by task:

- ``POST /v1/embeddings`` (OpenAI-compatible): embed models, named by the body's ``model``;
- ``POST /classify``: classify models, named by the body's ``model``;
- ``POST /v2/models/{name}/infer`` (Open Inference Protocol): predict models with named
  tensors, and embed and classify models as text tensors, named by the path;
- ``POST /generate`` (prompts to generated texts), ``POST /v1/completions`` and
  ``POST /v1/chat/completions`` (OpenAI-compatible, streaming as server-sent events):
  generate models (``routes/generation.py``);
- ``GET /v1/models`` (every model and its task), ``/v1/models/{id}`` (one of them), ``/v2``,
  ``/v2/models/{name}``, ``/v2/models/{name}/ready`` (and both, and ``infer``, under
  ``/v2/models/{name}/versions/1``), ``/v2/health/live``, ``/v2/health/ready``, ``/health``,
  ``/ready``, ``/metrics``.

A body without ``model`` goes to the first served model of the route's task (the generation
routes: the only generate model). A model of another task gets 400 naming its task and its
route, a route whose task no model does 400 listing the models' tasks; an unknown model 404
listing the served ones.

Many models, limited memory: with ``memory_budget``, batch models load on their first
request instead (``preload`` and ``pin`` ones at startup), and idle ones are evicted, least
recently used first, when a load needs room or after ``keep_alive_s`` (see
:mod:`batchline.server.residency` and :mod:`batchline._residency`).

Several models, one device: when more than one batch model is served with batching, their
batchers share ONE :class:`batchline.Device` whose slots are the machine's sessions
(``max_concurrent_batches``, one per session by default). The device is work-conserving (a
slot never idles while any model has work queued) and weighted-fair between busy models (the
weights are ``model_weights``, 1 each by default): a model with a long queue cannot starve
the others, and a lone busy model gets every slot. Each model still has its own queue
(``max_queue_size`` records), so one model's 429s never refuse another's requests. Each model
loads its own sessions (``sessions`` each); the shared slots bound how many batches run at
once across all of them. A generate model takes no slot: its generator steps its running
sequences on a thread of its own, within ``max_running_sequences`` and ``kv_token_budget``,
with at most ``max_queue_size`` requests waiting. The startup log names the models that
share the device, its slots and their weights.

Where a request can end:

==========================  ===========================================================
429 + ``Retry-After``        the queue cannot take all of the request's inputs: none are queued
504                          ``request_timeout_s`` elapsed: its queued records are withdrawn
                             (its sequences aborted)
(no response)                the client disconnected: the same
503 + ``Retry-After``        the server is draining (SIGTERM) or the models are not loaded yet
400 / 404                    empty or unusable input, wrong task / unknown model
413 / 422 / 401              too large / wrong types / missing or wrong API key
==========================  ===========================================================

SIGTERM (with :func:`batchline.server.serve`): ``/ready`` turns false, new requests get 503,
requests in flight finish (streams included), then every batcher and generator drains and
the models are freed. The wait is ``drain_timeout_s`` in all (:func:`drain`): what is still
generating then is cut at once, a stream with an SSE error event (503) and ``[DONE]``, a
non-streaming request with a 503, each cut stream logged on one line, so nothing is left for
uvicorn to cancel (no ``CancelledError`` traceback, no second wait).

``batching=False`` serves the baseline instead: one session per batch model with
``baseline_intra_op_threads`` threads shared by every request, each request's inputs run in
chunks of ``baseline_batch_size`` through ``asyncio.to_thread``, no queue; a generate model
runs one sequence at a time.

Example::

    from batchline.server import ServerSettings, create_app, serve

    settings = ServerSettings(model=["emb=default", "gen=smollm2"])
    app = create_app(settings)   # an ASGI app: run it with any server
    serve(settings)              # or let batchline run uvicorn (SIGTERM-safe)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from batchline._device import Device
from batchline._tracing import tracing_for, tracing_from_env
from batchline.models.config import Knobs
from batchline.models.protocol import BatchModel
from batchline.models.specs import ModelSpec
from batchline.server.errors import install_error_handlers
from batchline.server.gate import Gate
from batchline.server.metrics import ServerMetrics
from batchline.server.registry import LoadGenerator, LoadModel
from batchline.server.routes import include_routes
from batchline.server.settings import ServerSettings
from batchline.server.state import ServerState

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from batchline.server.batches.runner import BatchService

__all__ = ["LoadGenerator", "LoadModel", "create_app", "drain"]

logger = logging.getLogger("batchline.server")


def create_app(
    settings: ServerSettings | None = None,
    *,
    load_model: LoadModel | None = None,
    load_generator: LoadGenerator | None = None,
    tracer_provider: TracerProvider | None = None,
) -> FastAPI:
    """Build the ASGI app; its lifespan loads the models and starts their batchers.

    Args:
        settings: the knobs (default: ``ServerSettings()``, the default model on
            127.0.0.1:8000, API key from ``$BATCHLINE_API_KEY``).
        load_model: ``f(spec, knobs) -> BatchModel`` (default:
            :func:`batchline.models.loader.load_model`), for every spec whose task is not
            ``generate``.
        load_generator: ``f(spec, knobs) -> GenerationModel`` (default:
            :func:`batchline.models.generation.load.load_text_generator`), for every
            ``generate`` spec. Both are called once per model, in a worker thread, at startup.
        tracer_provider: trace with this OpenTelemetry ``TracerProvider`` (yours to shut
            down). Default: the one the ``OTEL_*`` variables ask for, or no tracing at all
            (:mod:`batchline._tracing`, :mod:`batchline.server.tracing`).

    ``app.state.server`` is the :class:`ServerState` (the one thing the app keeps in
    ``app.state``); its ``registry`` (:class:`~batchline.server.registry.ModelRegistry`)
    loads the models and hands them to the routes.

    Example::

        app = create_app(ServerSettings(model="default", max_queue_size=4096))
        # uvicorn.run(app) -- or batchline.server.serve(settings), which drains on SIGTERM
    """
    if settings is None:
        settings = ServerSettings.build()
    loader = load_model if load_model is not None else _default_loader()
    gen_loader = load_generator if load_generator is not None else _default_generator_loader()
    metrics = ServerMetrics()
    tracing = tracing_for(tracer_provider) if tracer_provider is not None else tracing_from_env()
    state = ServerState(
        settings=settings,
        metrics=metrics,
        # any of the keys is accepted (the gate checks them all); this one says "keys on"
        api_key=settings.api_keys[0].encode("utf-8") if settings.api_keys else None,
        tracing=tracing,
    )

    metrics.http_in_flight.set_function(lambda: state.in_flight)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        knobs = settings.knobs if settings.knobs.batching else settings.baseline_knobs
        batch_names = [s.name for s in settings.specs if not s.generates]
        device = _shared_device(settings, knobs, batch_names) if settings.knobs.batching else None
        registry = state.registry
        await registry.open(
            metrics=metrics,
            tracing=tracing,
            load_model=loader,
            load_generator=gen_loader,
            device=device,
        )
        if settings.host_names is None and not settings.allowed_hosts:
            logger.info(
                "bound to every interface: any Host is accepted; --allowed-hosts NAMES limits "
                "it, and --api-key (or BATCHLINE_API_KEY) keeps strangers out"
            )
        state.limit_bodies()
        batches = await _start_batches(state)
        state.ready = True
        state.draining = False
        try:
            yield
        finally:
            state.begin_drain()
            await batches.stop()  # unfinished batches resume on the next start
            await drain(state)
            await registry.close()  # unloads (drains) every model
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)  # the last spans go out

    app = FastAPI(
        title="batchline",
        summary="Models behind shared dynamic batchers.",
        lifespan=lifespan,
        **_no_native_telemetry(),
    )
    app.state.server = state
    include_routes(app)
    app.add_middleware(Gate, state=state)
    if settings.cors_origins:
        # outside the gate: a preflight needs no API key, and the gate's errors carry the
        # CORS headers so the page can read them
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=[
                "Authorization",
                "Content-Type",
                "X-Batchline-Priority",
                "Inference-Header-Content-Length",
            ],
            expose_headers=["Retry-After", "Inference-Header-Content-Length"],
        )
    if tracing is not None:
        # outermost: the span covers the gate's refusals and the whole response write
        from batchline.server.tracing import TraceRequests

        app.add_middleware(TraceRequests, tracing=tracing)
    install_error_handlers(app)
    return app


#: Once a drain has timed out and the generations are cut, how long their last events (the
#: error event, ``[DONE]``) may take to go out.
_CUT_GRACE_S = 1.0


async def drain(state: ServerState) -> None:
    """Stop taking work and wait for the requests in flight, ``drain_timeout_s`` at most; then
    cut every generation still running (its generator stops without draining: a stream ends
    with an SSE error event and ``[DONE]``, a waiting request gets a 503), and give their
    answers a moment to go out. Idempotent: a second call finds nothing in flight."""
    state.begin_drain()
    if await state.wait_idle(state.settings.drain_timeout_s):
        return
    generators = state.registry.generators()
    await asyncio.gather(
        *(g.generator.stop(drain=False) for g in generators), return_exceptions=True
    )
    await state.wait_idle(_CUT_GRACE_S)


async def _start_batches(state: ServerState) -> BatchService:
    """The Batch API's service on the data directory, resuming what a last run left."""
    from batchline.server.batches.runner import BatchService
    from batchline.server.batches.store import Store

    root = state.settings.batch_data_dir
    store = await asyncio.to_thread(Store, root)
    service = BatchService(state, store)
    state.metrics.watch_batches(store.status_counts)
    state.batches = service
    await service.start()
    logger.info("batch API: data in %s", root)
    return service


def _no_native_telemetry() -> dict[str, Any]:
    """FastAPI >= 0.165 makes OpenTelemetry spans and metrics of its own whenever a global
    provider is set: off, so that a request has one server span (batchline's, with its queue
    and batch under it) and its metrics stay Prometheus's; older FastAPI has no such option."""
    import inspect

    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def _default_loader() -> LoadModel:
    from batchline.models.loader import load_model

    def load(spec: ModelSpec, knobs: Knobs) -> BatchModel[object, object]:
        from batchline.jobs.precision import announce, resolve_knobs

        knobs, choice = resolve_knobs(spec, knobs)  # auto: measured once per model and CPU
        model = load_model(spec, knobs)
        announce(spec, choice)
        if knobs.precision == "int8" and not (choice is not None and choice.measured):
            from batchline.jobs.quantized import check_quantized  # int8 asked for: its gate

            try:
                check_quantized(model, spec, knobs)
            except BaseException:
                model.close()
                raise
        return model

    return load


def _default_generator_loader() -> LoadGenerator:
    from batchline.models.generation import load_text_generator

    return load_text_generator


#: On a CPU, the device's last free slot is kept for a model that holds none and had a batch
#: within this many seconds (:class:`batchline.Device`'s ``reserve_s``): a light model's batch
#: does not wait behind a heavy one's, and the event loop keeps a core for its requests.
CPU_RESERVE_S = 0.1


def _shared_device(settings: ServerSettings, knobs: Knobs, names: list[str]) -> Device | None:
    """One :class:`batchline.Device` for several batch models' batchers, or ``None``: one
    model needs none (its batcher's own slots are the device's)."""
    if len(names) < 2:
        return None
    device = Device(
        slots=knobs.max_concurrent_batches,
        name="serve",
        reserve_s=CPU_RESERVE_S if knobs.device == "cpu" else 0.0,
    )
    logger.info(
        "models %s share one device of %d slot(s), weights %s",
        ", ".join(names),
        device.slots,
        ", ".join(f"{n}={settings.model_weights.get(n, 1.0):g}" for n in names),
    )
    return device
