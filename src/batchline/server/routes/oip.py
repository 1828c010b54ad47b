"""The Open Inference Protocol (KServe v2, Triton's HTTP API), on the codec of
:mod:`batchline.oip`.

``POST /v2/models/{name}/infer``, ``GET /v2/models/{name}``, ``GET /v2/models/{name}/ready``,
``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2``; and the versioned forms of the
model routes, ``/v2/models/{name}/versions/{version}[/ready|/infer]``. A served model has one
version, ``"1"`` (:data:`VERSION`; the metadata lists none, as a model without versions):
another version is a 404.

Each row of a request's batch axis becomes one record submitted to the model's shared
batcher (all rows or none: 429), so concurrent clients share batches exactly as on the other
routes. Which models it serves, and as what tensors:

- ``predict`` models with named tensors (``batchline.models.onnx.predict``): the model's own
  inputs and outputs (``ModelInfo.details``);
- ``embed`` models: input ``text`` (BYTES, UTF-8, ``[-1]``), output ``embedding``
  (FP32, ``[-1, dim]``);
- ``classify`` models: input ``text``, outputs ``label`` (BYTES ``[-1]``), ``score`` (FP32
  ``[-1]``) and ``scores`` (FP32 ``[-1, labels]``, in the labels' order). ``scores`` requested
  with ``"parameters": {"classification": K}`` (Triton's classification extension) is answered
  as BYTES ``[-1, K]``: each row's K likeliest labels as ``"score:index:label"``;
- an image model (classify or embed) takes input ``image`` (BYTES ``[-1]``): each row one
  picture's encoded bytes (JPEG, PNG, ...), decoded in the model's worker processes as on
  ``/v1/classify``, within the same limits.

Errors have the protocol's body, ``{"error": message}``, with the same statuses as the other
routes (400, 404, 413, 429 + ``Retry-After``, 503, 504); so do the gate's and the app's on
any ``/v2`` path (401, 403, 405, 413, 415, 421, 503, an unknown path's 404:
:func:`batchline.server.errors.is_oip_path`).

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from batchline import oip as codec
from batchline._types import Array
from batchline.models.openai.images import PictureRef, PictureTooLarge, picture_of
from batchline.server.errors import ApiError, bad_request
from batchline.server.routes._common import (
    check_count,
    gone_generators,
    request_priority,
    run_model,
    server_state,
    use_model,
)
from batchline.server.served import ServedModel
from batchline.server.state import ServerState

__all__ = ["VERSION", "router"]

router = APIRouter()

_PLATFORM = "batchline"
#: The one version of every served model, which the versioned paths take.
VERSION = "1"


@dataclass(frozen=True)
class _Tensors:
    """How one served model looks over the protocol: its tensors, and how rows become the
    model's inputs and results become output rows."""

    inputs: list[dict[str, object]]
    outputs: list[dict[str, object]]
    to_input: Callable[[dict[str, Array]], object]
    to_row: Callable[[object], Mapping[str, Array]]


def _tensors(model: ServedModel[object, object]) -> _Tensors:
    """The model's protocol view; 400 for a model that has none."""
    info = model.info
    details = info.details
    if info.task == "predict":
        inputs, outputs = details.get("inputs"), details.get("outputs")
        if info.input_kind != "tensors" or not isinstance(inputs, list) or not outputs:
            raise bad_request(
                f"model {model.name!r} takes whole records, not named tensors, so the Open "
                "Inference Protocol cannot describe it"
            )
        return _Tensors(list(inputs), list(cast(list[dict[str, object]], outputs)), dict, _as_row)
    text: list[dict[str, object]] = [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    read: Callable[[dict[str, Array]], object] = _text
    if model.pictures is not None:
        text, read = [{"name": "image", "datatype": "BYTES", "shape": [-1]}], _image
    if info.task == "embed":
        dim = details.get("dim")
        width = dim if isinstance(dim, int) else -1
        return _Tensors(
            text,
            [{"name": "embedding", "datatype": "FP32", "shape": [-1, width]}],
            read,
            lambda r: {"embedding": np.asarray(model.encode(r), dtype=np.float32)},
        )
    if info.task == "classify":
        labels = _labels(model)

        def to_row(result: object) -> Mapping[str, Array]:
            value = model.encode(result)
            if not isinstance(value, Mapping):
                raise ApiError(500, f"model {model.name!r} returned no label", "server_error")
            scores = value.get("scores")
            scores = scores if isinstance(scores, Mapping) else {}
            return {
                "label": np.array(str(value["label"]).encode("utf-8"), dtype=object),
                "score": np.float32(value["score"]),  # type: ignore[dict-item]
                "scores": np.array([scores.get(x, np.nan) for x in labels], dtype=np.float32),
            }

        return _Tensors(
            text,
            [
                {"name": "label", "datatype": "BYTES", "shape": [-1]},
                {"name": "score", "datatype": "FP32", "shape": [-1]},
                {"name": "scores", "datatype": "FP32", "shape": [-1, len(labels) or -1]},
            ],
            read,
            to_row,
        )
    raise bad_request(
        f"model {model.name!r} does {info.task}: not served over the Open Inference Protocol"
    )


def _labels(model: ServedModel[object, object]) -> list[str]:
    raw = model.info.details.get("labels")
    return [str(x) for x in raw] if isinstance(raw, list) else []


def _classification(
    model: ServedModel[object, object], requested: codec.RequestedOutputs
) -> Mapping[str, int]:
    """The outputs asked as top K classes (Triton's classification extension), checked
    before anything runs: only a classifier's ``scores``, and K within its labels."""
    asked = requested.classification
    if not asked:
        return asked
    if model.info.task != "classify":
        raise bad_request(
            f"model {model.name!r} does {model.info.task}, not classify: the classification "
            "parameter needs a classifier"
        )
    labels = _labels(model)
    for name, count in asked.items():
        if name != "scores":
            raise bad_request(
                f"output {name[:64]!r} cannot be classified: ask for classification on "
                "output 'scores' (each label's score)"
            )
        if labels and count > len(labels):
            raise bad_request(
                f"classification {count} asks for more classes than the {len(labels)} labels "
                f"of model {model.name!r}"
            )
    return asked


def _as_row(result: object) -> Mapping[str, Array]:
    return cast(Mapping[str, Array], result)


def _image(row: dict[str, Array]) -> bytes:
    value = row["image"]
    raw = value.item() if isinstance(value, np.ndarray) else value
    return raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)


def _picture(data: bytes, max_bytes: int) -> PictureRef:
    """One ``image`` element: a data URI (what JSON tensor data can carry), else the
    picture's encoded bytes (binary tensor data); 413 over ``max_bytes``."""
    try:
        if data[:5].lower() == b"data:":
            ref = picture_of(data.decode("ascii"), max_bytes=max_bytes)
            if ref.data is not None:
                return ref
        if len(data) > max_bytes:
            raise PictureTooLarge(
                f"an image is over the limit of {max_bytes} bytes (the server's max_image_bytes)"
            )
    except PictureTooLarge as exc:
        raise codec.OipError(413, str(exc)) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise codec.OipError(400, f"input 'image': {exc}") from None
    if not data:
        raise codec.OipError(400, "input 'image' holds an empty element")
    return PictureRef(data=data)


def _text(row: dict[str, Array]) -> str:
    value = row["text"]
    raw = value.item() if isinstance(value, np.ndarray) else value
    if isinstance(raw, str):
        return raw
    try:
        return bytes(raw).decode("utf-8")
    except (UnicodeDecodeError, TypeError):
        raise codec.OipError(400, "input 'text' must hold UTF-8 text") from None


async def _model(
    request: Request, state: ServerState, name: str, version: str | None
) -> ServedModel[object, object]:
    """The batch model ``name``, an on-demand one loaded as needed (its tensors need it)."""
    task = _task(state, name, version)
    return await use_model(request, state, name, task)


def _task(state: ServerState, name: str, version: str | None) -> str:
    """The task of the batch model ``name`` (400 for a generate model, 404 for an unknown one
    or a ``version`` it does not have), loading nothing."""
    task = state.registry.task_of(name)
    if task == "generate":
        raise bad_request(
            f"model {name!r} does generate: not served over the Open Inference Protocol; send "
            "it to POST /v1/completions, POST /v1/chat/completions or POST /generate"
        )
    if task is None:
        raise ApiError(
            404,
            f"model {name[:100]!r} is not served here; models: {state.registry.describe()}",
            "model_not_found",
        )
    if version is not None and version != VERSION:
        raise ApiError(
            404,
            f"model {name[:100]!r} has no version {version[:32]!r}: a served model has one "
            f"version, {VERSION!r} (or leave the version out of the path)",
            "model_not_found",
        )
    return task


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(codec.error_body(message), status_code=status, headers=headers)


@router.get("/v2", summary="Open Inference Protocol: server metadata")
async def server_metadata() -> JSONResponse:
    return JSONResponse(codec.server_metadata())


@router.get("/v2/health/live", summary="Open Inference Protocol: liveness")
async def live(request: Request) -> JSONResponse:
    """As ``/health``: false (503) once a generate model's engine has exited."""
    if gone_generators(server_state(request)):
        return JSONResponse({"live": False}, status_code=503)
    return JSONResponse({"live": True})


@router.get("/v2/health/ready", summary="Open Inference Protocol: readiness")
async def ready(request: Request) -> JSONResponse:
    state = server_state(request)
    if gone_generators(state):
        return JSONResponse({"ready": False}, status_code=503)
    if state.ready and not state.draining:
        return JSONResponse({"ready": True})
    return JSONResponse(
        {"ready": False},
        status_code=503,
        headers={"Retry-After": str(state.settings.retry_after_s)},
    )


@router.get("/v2/models/{name}", summary="Open Inference Protocol: model metadata")
async def model_metadata(request: Request, name: str) -> JSONResponse:
    return await _metadata(request, name, None)


@router.get(
    "/v2/models/{name}/versions/{version}",
    summary="Open Inference Protocol: model metadata (of its one version)",
)
async def model_version_metadata(request: Request, name: str, version: str) -> JSONResponse:
    return await _metadata(request, name, version)


async def _metadata(request: Request, name: str, version: str | None) -> JSONResponse:
    state = server_state(request)
    try:
        model = await _model(request, state, name, version)
        tensors = _tensors(model)
    except ApiError as exc:
        return _error(exc.status, exc.message, exc.headers)
    return JSONResponse(
        codec.model_metadata(model.name, None, _PLATFORM, tensors.inputs, tensors.outputs)
    )


@router.get("/v2/models/{name}/ready", summary="Open Inference Protocol: model readiness")
async def model_ready(request: Request, name: str) -> JSONResponse:
    return await _ready(request, name, None)


@router.get(
    "/v2/models/{name}/versions/{version}/ready",
    summary="Open Inference Protocol: model readiness (of its one version)",
)
async def model_version_ready(request: Request, name: str, version: str) -> JSONResponse:
    return await _ready(request, name, version)


async def _ready(request: Request, name: str, version: str | None) -> JSONResponse:
    state = server_state(request)
    try:
        registry = state.registry
        # an on-demand batch model is ready: it loads on a request (a generate model has no
        # tensors here, loaded or not: _model says so)
        if not registry.loads_on_demand(name) or registry.task_of(name) == "generate":
            await _model(request, state, name, version)
        else:
            _task(state, name, version)
    except ApiError as exc:
        return _error(exc.status, exc.message, exc.headers)
    is_ready = state.ready and not state.draining
    return JSONResponse({"name": name, "ready": is_ready}, status_code=200 if is_ready else 503)


@router.post("/v2/models/{name}/infer", summary="Open Inference Protocol: inference")
async def infer(request: Request, name: str) -> Response:
    """Rows in (JSON or binary tensor data), one record each through the shared batcher."""
    return await _infer(request, name, None)


@router.post(
    "/v2/models/{name}/versions/{version}/infer",
    summary="Open Inference Protocol: inference (on the model's one version)",
)
async def infer_version(request: Request, name: str, version: str) -> Response:
    """As ``/v2/models/{name}/infer``; the response names the version."""
    return await _infer(request, name, version)


async def _infer(request: Request, name: str, version: str | None) -> Response:
    started = time.perf_counter()
    state = server_state(request)
    try:
        model = await _model(request, state, name, version)
        request.scope["batchline.model"] = model.name
        tensors = _tensors(model)
        body = request.scope.get("batchline.body")
        if body is None:
            body = await request.body()
        header_length = codec.parse_header_length(request.headers.get(codec.HEADER_LENGTH_HEADER))
        parsed = codec.parse_infer_request(
            body, header_length, tensors.inputs, model_outputs=tensors.outputs
        )
        try:
            rows = codec.request_rows(parsed)
        except ValueError as exc:
            raise codec.OipError(400, str(exc)) from None
        check_count(len(rows), state, "inputs", "rows")
        inputs: Sequence[object] = [tensors.to_input(row) for row in rows]
        classified = _classification(model, parsed.requested)
        if model.pictures is not None:
            limit = state.settings.max_image_bytes
            refs = [_picture(cast(bytes, b), limit) for b in inputs]
            inputs = await model.pictures.pixels(refs)
        priority = request_priority(request, state, model.name, parsed.parameters.get("priority"))
        results, _ = await run_model(state, model, inputs, priority=priority)
        outputs = codec.stack_rows([tensors.to_row(r) for r in results])
        for name, count in classified.items():
            outputs[name] = codec.classification_strings(outputs[name], count, _labels(model))
        payload, headers = codec.build_infer_response(
            model.name, version, parsed.id, outputs, parsed.requested
        )
    except codec.OipError as exc:
        return _error(exc.status, exc.message)
    except ApiError as exc:
        return _error(exc.status, exc.message, exc.headers)
    model.metrics.request_latency("infer").observe(time.perf_counter() - started)
    return Response(payload, headers=headers)
