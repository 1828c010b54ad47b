"""What the routes share: request parsing from the gate's bytes, the typed model lookup (the
registry's ``acquire``, narrowed to a batch or a generate model), input checks, the one
mapping from the ways a model call can end to HTTP errors, and fast JSON encoders (a
client's disconnect is the gate's: :mod:`batchline.server.gate`).

(No ``from __future__ import annotations``: FastAPI reads route annotations at run time.)
"""

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, cast

import numpy as np
from pydantic import BaseModel
from starlette.requests import Request

from batchline._errors import (
    BatcherClosedError,
    EngineGoneError,
    InputError,
    QueueFullError,
    RecordTooLargeError,
)
from batchline._priority import batcher_priority
from batchline._types import Vector
from batchline.models.openai.requests import texts_of
from batchline.server.errors import (
    ApiError,
    bad_request,
    safe_text,
    shutting_down,
)
from batchline.server.gate import parse_body
from batchline.server.metrics import ModelMetrics
from batchline.server.schemas import ErrorBody
from batchline.server.served import ServedGenerator, ServedModel
from batchline.server.settings import ServerSettings
from batchline.server.state import ServerState, server_state

__all__ = [
    "ERRORS",
    "TextRun",
    "all_finite",
    "api_error",
    "body_doc",
    "check_count",
    "check_texts",
    "non_finite",
    "parse_body",
    "request_priority",
    "run_model",
    "run_texts",
    "server_state",
    "use_generator",
    "use_model",
]

logger = logging.getLogger("batchline.server")

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in (
        (400, "Empty input, a bad value, or a model of another task."),
        (401, "Missing or wrong API key (when the server has one)."),
        (404, "Unknown model (the message lists the served ones)."),
        (413, "Too many inputs, a body too large, or a text too long (truncate=false)."),
        (422, "Wrong types; the detail lists loc/msg/type, never the input."),
        (429, "The queue is full; retry after Retry-After seconds."),
        (503, "Draining or not loaded yet; retry after Retry-After seconds."),
        (504, "Not done within request_timeout_s; the request's queued records were dropped."),
    )
}


def body_doc(model: type[BaseModel]) -> dict[str, object]:
    """The OpenAPI request body of ``model``, nested models inlined (a schema's own
    ``#/$defs/...`` references would not resolve inside the OpenAPI document)."""
    schema = model.model_json_schema()
    defs: dict[str, object] = schema.pop("$defs", {})

    def inline(node: object) -> object:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": inline(schema)}},
        }
    }


async def use_model(
    request: Request, state: ServerState, name: str | None, task: str
) -> ServedModel[object, object]:
    """The served batch model ``name`` of ``task`` (:meth:`ModelRegistry.acquire
    <batchline.server.registry.ModelRegistry.acquire>`: the first of ``task`` when ``None``,
    loaded first and held for the request when it is an on-demand one)."""
    served = await state.registry.acquire(name, task, request.scope)
    assert isinstance(served, ServedModel), "a batch task's model is a ServedModel"
    return served


async def use_generator(request: Request, state: ServerState, name: str | None) -> ServedGenerator:
    """The served generate model ``name`` (the only one when ``None``), as :func:`use_model`."""
    served = await state.registry.acquire(name, "generate", request.scope)
    assert isinstance(served, ServedGenerator), "a generate model is a ServedGenerator"
    return served


def check_texts(value: str | list[str], state: ServerState, field: str) -> list[str]:
    """A body's one text or list of texts, as a list: 413 if too many, 400 if none or one
    is empty."""
    check_count(1 if isinstance(value, str) else len(value), state, field, "texts")
    try:
        return texts_of(value, field)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def check_count(n: int, state: ServerState, field: str, what: str = "inputs") -> None:
    """400 when a request has no inputs, 413 when it has more than ``max_inputs_per_request``."""
    if n == 0:
        raise bad_request(f"'{field}' is empty; send at least one of its {what}")
    limit = state.settings.max_inputs_per_request
    if n > limit:
        raise ApiError(
            413,
            f"'{field}' has {n} {what}; at most {limit} per request, split it",
            "request_too_large",
        )


#: The request header that carries a request's priority (the body's ``priority`` wins).
PRIORITY_HEADER = "x-batchline-priority"


def request_priority(request: Request, state: ServerState, model: str, body_value: object) -> int:
    """The batcher priority of a request (``batchline._priority``): the body's ``priority``,
    else the ``X-Batchline-Priority`` header, else the model's ``model_priority`` (default
    ``interactive``). A bad value is a 400 naming the accepted forms."""
    value = body_value if body_value is not None else request.headers.get(PRIORITY_HEADER)
    if value is None:
        value = state.settings.model_priority.get(model, "interactive")
    try:
        return batcher_priority(value)
    except ValueError as exc:
        where = "'priority'" if body_value is not None else "X-Batchline-Priority"
        raise bad_request(f"{where}: {safe_text(str(exc))}") from None


async def run_model(
    state: ServerState,
    model: ServedModel[object, object],
    inputs: Sequence[object],
    *,
    priority: int = 0,
) -> tuple[list[object], int]:
    """Prepare and run a request's inputs (at the batcher's ``priority``, see
    :func:`request_priority`); the results in order and their total cost (tokens, for a text
    model). Turns the ways it can end into HTTP errors."""
    settings = state.settings
    m = model.metrics
    m.in_flight.inc()
    try:
        async with asyncio.timeout(settings.request_timeout_s):
            items = await model.prepare(inputs)
            results = await model.run(items, priority=priority)
        return results, model.cost(items)
    except Exception as exc:
        error = api_error(exc, settings, model.name, withdrawn="its queued inputs were dropped")
        _count(m, error.status)
        raise error from None
    finally:
        m.in_flight.dec()


class _TextBody(Protocol):
    @property
    def input(self) -> str | list[str]: ...
    @property
    def model(self) -> str | None: ...
    @property
    def priority(self) -> object: ...


@dataclass(frozen=True)
class TextRun(Generic[M]):
    """A text route's request, run: its body, its model, the results in order, their tokens."""

    body: M
    model: ServedModel[object, object]
    results: list[object]
    tokens: int
    started: float

    def observe_latency(self, route: str) -> None:
        """Count the request, answered, in ``batchline_request_duration_seconds``."""
        self.model.metrics.request_latency(route).observe(time.perf_counter() - self.started)


async def run_texts(
    request: Request,
    schema: type[M],
    task: str,
    check: Callable[[M, ServedModel[object, object]], None] | None = None,
) -> TextRun[M]:
    """The path of the text routes (``/v1/embeddings``, ``/classify``): the body as ``schema``
    (``input``, ``model``, ``priority``), the served model of ``task``, the texts checked (then
    ``check``, a route's own), all run through the model's batcher at the request's priority."""
    started = time.perf_counter()
    state = server_state(request)
    body = await parse_body(request, schema)
    fields = cast(_TextBody, body)
    model = await use_model(request, state, fields.model, task)
    texts = check_texts(fields.input, state, "input")
    if check is not None:
        check(body, model)
    priority = request_priority(request, state, model.name, fields.priority)
    results, tokens = await run_model(state, model, texts, priority=priority)
    return TextRun(body, model, results, tokens, started)


def gone_generators(state: ServerState) -> dict[str, str]:
    """Each loaded generate model whose engine has exited (``TextGenerator.gone``), and why:
    what turns the probes (``/health``, ``/ready`` and the Open Inference Protocol's) 503."""
    return {
        g.name: why for g in state.registry.generators() if (why := g.generator.gone) is not None
    }


def api_error(
    exc: BaseException, settings: ServerSettings, model: str, *, withdrawn: str
) -> ApiError:
    """The HTTP error for one way a model call ended (every route's one mapping): 504 for
    ``TimeoutError`` (``withdrawn`` says what became of the request's work), 429 + Retry-After
    for a full queue, 503 + Retry-After for a batcher or generator being stopped, 400 for bad
    input, 503 saying why for a generator whose engine exited, 500 (logged) for anything else.
    An :class:`ApiError` is returned as it is."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, TimeoutError):
        return ApiError(
            504,
            f"not done within request_timeout_s={settings.request_timeout_s}; {withdrawn}",
            "timeout",
        )
    if isinstance(exc, QueueFullError):
        return ApiError(
            429,
            "the server is busy (queue full); retry after the Retry-After delay",
            "rate_limit_exceeded",
            headers={"Retry-After": str(settings.retry_after_s)},
        )
    if isinstance(exc, BatcherClosedError):
        return shutting_down(settings.retry_after_s)
    if isinstance(exc, InputError | RecordTooLargeError):
        return bad_request(safe_text(str(exc)))
    if isinstance(exc, EngineGoneError):  # logged once, when it exited; /ready says 503 now
        return ApiError(503, safe_text(str(exc)), "server_error")
    logger.error("model %s failed on a request", model, exc_info=exc)
    return ApiError(500, "the model failed on this request", "server_error")


def _count(m: ModelMetrics, status: int) -> None:
    if status == 504:
        m.cancelled("timeout")
    elif status == 429:
        m.rejected("queue_full")
    elif status == 503:
        m.rejected("draining")
    elif status == 500:
        m.failed("model")


def non_finite(model: ServedModel[object, object]) -> ApiError:
    """The 500 for a result with NaN or infinity (counted)."""
    model.metrics.failed("non_finite")
    return ApiError(500, "the model returned non-finite values for this request", "server_error")


def all_finite(vectors: Sequence[Vector]) -> bool:
    return all(np.isfinite(v).all() for v in vectors)
