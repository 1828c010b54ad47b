"""Operations: ``GET /v1/models``, ``GET /v1/models/{id}``, ``/health``, ``/ready``,
``/metrics``.

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from batchline.server.errors import ApiError
from batchline.server.metrics import CONTENT_TYPE
from batchline.server.routes._common import gone_generators, server_state
from batchline.server.schemas import ModelCard, ModelList
from batchline.server.served import model_card
from batchline.server.state import ServerState

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, summary="The models served here")
async def list_models(request: Request) -> JSONResponse:
    """OpenAI-style model list; each model also says its ``task``, its ``modality`` (text,
    image or tensors; an image model also its ``limits``) and, for an on-demand model
    (``memory_budget``), its ``state`` (unloaded, loading, resident, unloading),
    ``footprint_bytes`` (estimated from its files, or what its last load measured),
    ``load_peak_bytes`` (the most a load of it grew memory by at its peak; 0 until measured)
    and ``pinned``. A model not loaded yet has the fields of a loaded one: ``created`` is
    when the server started, ``modality`` what its backend says it takes (``text`` for a
    ``module:factory``, which only its load tells)."""
    return JSONResponse({"object": "list", "data": _cards(server_state(request))})


@router.get(
    "/v1/models/{model_id:path}",
    response_model=ModelCard,
    summary="One model served here (OpenAI's retrieve model)",
)
async def retrieve_model(request: Request, model_id: str) -> JSONResponse:
    """The card ``GET /v1/models`` lists for ``model_id``; 404 naming the served models."""
    state = server_state(request)
    for card in _cards(state):
        if card["id"] == model_id:
            return JSONResponse(card)
    raise ApiError(
        404,
        f"model {model_id[:100]!r} is not served here; models: {state.registry.describe()}",
        "model_not_found",
    )


def _cards(state: ServerState) -> list[dict[str, object]]:
    registry = state.registry
    data: list[dict[str, object]] = []
    for served in registry.served():
        card = served.card()
        card.update(_modality(state, served.info.input_kind))
        data.append(card)
    if registry.residency is not None and state.settings.memory_budget is not None:
        # on-demand models: listed loaded or not, with their residency and footprint
        cards = {str(c["id"]): c for c in data}
        data = []
        for s in registry.residency.stats():
            card = cards.pop(s.name) if s.name in cards else _unloaded_card(state, s.name)
            card.update(
                state=s.state.value,
                footprint_bytes=s.footprint_bytes,
                footprint_measured=s.measured,
                load_peak_bytes=s.load_peak_bytes,
                pinned=s.pinned,
            )
            data.append(card)
        data.extend(cards.values())
    return data


def _unloaded_card(state: ServerState, name: str) -> dict[str, object]:
    """An on-demand model's card before it loads, with what its backend tells of it."""
    registry = state.registry
    card = model_card(name, registry.opened_at, registry.task_of(name) or "")
    card.update(_modality(state, registry.input_kind_of(name) or "record"))
    return card


def _modality(state: ServerState, input_kind: str) -> dict[str, object]:
    """What a model takes (``modality``: text, image or tensors) and, for images, the limits
    a request must keep to."""
    if input_kind != "image":
        return {"modality": "tensors" if input_kind == "tensors" else "text"}
    s = state.settings
    return {
        "modality": "image",
        "limits": {
            "max_inputs_per_request": s.max_inputs_per_request,
            "max_image_bytes": s.max_image_bytes,
            "max_image_pixels": s.max_image_pixels,
            "url_fetch_hosts": list(s.allow_url_fetch),
        },
    }


@router.get("/health", summary="Liveness: the process answers and can serve")
async def health(request: Request) -> JSONResponse:
    """200 while the process runs and its models can serve (a full disk is no reason to
    restart it); 503 with ``status`` ``failed`` once a generate model's engine has exited (an
    engine process killed, vLLM's engine core dead), which only a restart brings back, so that
    an orchestrator's liveness probe restarts it. With the Batch API on, ``data_dir`` says
    whether its data directory can take writes: ``problem`` is ``full``, ``read-only``, ``not
    writable`` or ``I/O error`` (and ``status`` then ``degraded``), else null. Never its path:
    this route answers any ``Host`` (a rebound name included), and the path is the server's
    business; the logs and a 507 name it."""
    state = server_state(request)
    gone = gone_generators(state)
    if gone:
        return JSONResponse(_failed(state, gone), status_code=503)
    store = getattr(state.batches, "store", None)
    if store is None:
        return JSONResponse({"status": "ok"})
    disk = store.disk_state()
    status = "ok" if disk["problem"] is None else "degraded"
    return JSONResponse({"status": status, "data_dir": disk})


@router.get("/ready", summary="Readiness: models loaded and able to serve, not draining")
async def ready(request: Request) -> JSONResponse:
    """200 when the models are loaded and the server is not draining, else 503: ``loading``,
    ``draining``, or ``failed`` where a generate model's engine has exited (``/health``). With
    an API key the models are not listed (this route needs none; ``/v1/models`` lists them)."""
    state = server_state(request)
    gone = gone_generators(state)
    if gone:
        return JSONResponse(_failed(state, gone), status_code=503)
    if state.ready and not state.draining:
        if state.api_key is not None:
            return JSONResponse({"status": "ready"})
        models = [m.name for m in state.registry.served()]
        return JSONResponse({"status": "ready", "models": models})
    status = "draining" if state.draining else "loading"
    return JSONResponse(
        {"status": status},
        status_code=503,
        headers={"Retry-After": str(state.settings.retry_after_s)},
    )


def _failed(state: ServerState, gone: dict[str, str]) -> dict[str, object]:
    """The body of a 503 for models whose engines exited: which and why, unless an API key
    hides the models' names."""
    if state.api_key is not None:
        return {"status": "failed"}
    return {"status": "failed", "failed": gone}


@router.get("/metrics", summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    """The text exposition format, from the app's own registry (batch and generate models)."""
    state = server_state(request)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
