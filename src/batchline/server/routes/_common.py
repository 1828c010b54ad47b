"""What the routes share: request parsing from the gate's bytes, model lookup, input checks,
turning the ways a model call can end into HTTP errors, and fast JSON encoders.

(No ``from __future__ import annotations``: FastAPI reads route annotations at run time.)
"""

import asyncio
import base64
import logging
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from batchline._errors import BatcherClosedError, InputError, QueueFullError
from batchline.server.errors import ApiError
from batchline.server.schemas import ErrorBody
from batchline.server.state import ServedModel, ServerState, Vector

__all__ = [
    "ERRORS",
    "Invalid",
    "b64",
    "body_doc",
    "check_texts",
    "embed_texts",
    "floats",
    "parse_body",
    "pick_model",
    "server_state",
]

logger = logging.getLogger("batchline.server")

M = TypeVar("M", bound=BaseModel)

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in (
        (400, "Empty input or a bad value."),
        (401, "Missing or wrong API key (when the server has one)."),
        (404, "Unknown model."),
        (413, "Too many inputs, a body too large, or a text too long (truncate=false)."),
        (422, "Wrong types; the detail lists loc/msg/type, never the input."),
        (429, "The queue is full; retry after Retry-After seconds."),
        (503, "Draining or not loaded yet; retry after Retry-After seconds."),
        (504, "Not done within request_timeout_s; the request's queued records were dropped."),
    )
}


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


async def parse_body(request: Request, model: type[M]) -> M:
    body = request.scope.get("batchline.body")
    if body is None:
        body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False, include_context=False)
        for err in errors:
            err["loc"] = ("body", *err["loc"])
        raise Invalid(errors) from None


class _NonFinite(Exception):
    pass


class Invalid(Exception):
    def __init__(self, errors: Sequence[Any]) -> None:
        self.errors = errors


def pick_model(state: ServerState, name: str | None) -> ServedModel:
    if name is None:
        return state.default_model
    model = state.models.get(name)
    if model is None:
        raise ApiError(
            404,
            f"model {name[:100]!r} is not served here; GET /v1/models lists the models",
            "model_not_found",
        )
    return model


def check_texts(texts: list[str], state: ServerState, field: str) -> None:
    if not texts:
        raise ApiError(400, f"'{field}' is empty; send at least one text", "invalid_request_error")
    limit = state.settings.max_inputs_per_request
    if len(texts) > limit:
        raise ApiError(
            413,
            f"'{field}' has {len(texts)} texts; at most {limit} per request, split it",
            "request_too_large",
        )
    for i, text in enumerate(texts):
        if not text:
            raise ApiError(
                400,
                f"'{field}' text {i} is empty; send non-empty texts",
                "invalid_request_error",
            )


async def embed_texts(
    state: ServerState, model: ServedModel, texts: list[str]
) -> tuple[Sequence[Vector], int]:
    """Run the texts; turn the ways it can end into HTTP errors."""
    settings = state.settings
    try:
        async with asyncio.timeout(settings.request_timeout_s):
            vectors, tokens = await model.embed(texts)
        for v in vectors:
            if not np.isfinite(v).all():
                raise _NonFinite
        return vectors, tokens
    except _NonFinite:
        model.metrics.failed("non_finite")
        raise ApiError(
            500, "the model returned non-finite values for this request", "server_error"
        ) from None
    except TimeoutError:
        model.metrics.cancelled("timeout")
        raise ApiError(
            504,
            f"not done within request_timeout_s={settings.request_timeout_s}; "
            "its queued texts were dropped",
            "timeout",
        ) from None
    except QueueFullError:
        model.metrics.rejected("queue_full")
        raise ApiError(
            429,
            "the server is busy (queue full); retry after the Retry-After delay",
            "rate_limit_exceeded",
            headers={"Retry-After": str(settings.retry_after_s)},
        ) from None
    except BatcherClosedError:
        model.metrics.rejected("draining")
        raise ApiError(
            503,
            "the server is shutting down; retry on another replica or later",
            "service_unavailable",
            headers={"Retry-After": str(settings.retry_after_s)},
        ) from None
    except InputError as exc:
        raise ApiError(400, str(exc), "invalid_request_error") from None
    except ApiError:
        raise
    except Exception:
        model.metrics.failed("model")
        logger.exception("model %s failed on a request of %d text(s)", model.name, len(texts))
        raise ApiError(500, "the model failed on this request", "server_error") from None


def floats(vector: Vector) -> str:
    # "%.9g" round-trips float32 exactly, in 60% fewer bytes and ~2.7x less CPU than
    # json.dumps(vector.tolist()) (~100 us vs ~270 us for 384 floats, measured)
    n = vector.shape[0]
    fmt = _FORMATS.get(n)
    if fmt is None:
        fmt = _FORMATS[n] = "[" + ",".join(["%.9g"] * n) + "]"
    return fmt % tuple(vector.tolist())


_FORMATS: dict[int, str] = {}


def b64(vector: Vector) -> str:
    data = vector.astype("<f4", copy=False).tobytes()
    return '"' + base64.b64encode(data).decode("ascii") + '"'
