"""Errors as HTTP responses: :class:`ApiError`, the one error body, and the app's handlers.

Every error answers ``{"detail": ..., "error": {"message", "type", "code"}}`` (FastAPI's
``detail`` plus OpenAI's ``error`` object), but on an Open Inference Protocol path (``/v2``
and below: :func:`is_oip_path`) the protocol's ``{"error": message}``, whoever refuses the
request (a route, the gate, or the app for an unknown path or method), with the same status
and headers: a Triton or KServe client reads its message there. The 422 handler lists
``loc``/``msg``/``type`` of each validation error and never the input itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic_core import ErrorDetails
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from batchline.models.openai.requests import error_text
from batchline.oip import error_body

__all__ = [
    "ApiError",
    "bad_request",
    "error_response",
    "install_error_handlers",
    "is_oip_path",
    "safe_text",
    "shutting_down",
    "validation_error",
    "validation_response",
]

logger = logging.getLogger("batchline.server")


class ApiError(Exception):
    """An error that becomes an HTTP response: ``{"detail": ..., "error": {...}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        *,
        headers: dict[str, str] | None = None,
        detail: object = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.headers = headers
        self.detail = detail

    def response(self, path: str = "") -> JSONResponse:
        """The error's response to a request for ``path`` (an OIP path: the protocol's body)."""
        return error_response(
            self.status,
            self.message,
            self.kind,
            headers=self.headers,
            detail=self.detail,
            path=path,
        )


def bad_request(message: str) -> ApiError:
    """The 400 of a request the client has to fix (``invalid_request_error``)."""
    return ApiError(400, message, "invalid_request_error")


def error_response(
    status: int,
    message: str,
    kind: str,
    *,
    headers: dict[str, str] | None = None,
    detail: object = None,
    path: str = "",
) -> JSONResponse:
    """The server's error body: FastAPI's ``detail`` plus OpenAI's ``error`` object; for a
    request to an Open Inference Protocol ``path``, the protocol's ``{"error": message}``."""
    if is_oip_path(path):
        return JSONResponse(error_body(message), status_code=status, headers=headers)
    body = {
        "detail": message if detail is None else detail,
        "error": {"message": message, "type": kind, "code": status},
    }
    return JSONResponse(body, status_code=status, headers=headers)


def is_oip_path(path: str) -> bool:
    """Whether ``path`` is the Open Inference Protocol's (``/v2`` and below), whose errors
    have its own body."""
    return path == "/v2" or path.startswith("/v2/")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error with the server's error body (and a 422 that never echoes input)."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors()).response(_path(request))


def validation_response(errors: Sequence[ErrorDetails]) -> JSONResponse:
    """422 with ``loc``/``msg``/``type`` of each error and never the input itself.

    (FastAPI's own handler echoes the input, and a NaN or a lone surrogate in it then
    breaks the JSON encoder: a 500 for a client's mistake.)
    """
    return validation_error(errors).response()


def validation_error(errors: Sequence[ErrorDetails]) -> ApiError:
    """The :func:`validation_response` as an error to raise (a route's own body parsing)."""
    detail: list[dict[str, object]] = []
    for err in errors:
        loc = [_safe(part) for part in err.get("loc", ())]
        detail.append(
            {"loc": loc, "msg": _safe(err.get("msg", "")), "type": _safe(err.get("type", ""))}
        )
    return ApiError(422, error_text(detail), "invalid_request_error", detail=detail)


def shutting_down(retry_after_s: int) -> ApiError:
    """The 503 of a request that met a batcher or generator being stopped (a drain)."""
    return ApiError(
        503,
        "the server is shutting down; retry on another replica or later",
        "service_unavailable",
        headers={"Retry-After": str(retry_after_s)},
    )


def safe_text(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a lone surrogate from a client's JSON escapes)
    replaced, so that an error body that quotes it always encodes."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _safe(value: object) -> str | int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return safe_text(value if isinstance(value, str) else str(value))[:200]


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response(_path(request))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else "HTTP error"
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    headers = dict(exc.headers) if exc.headers else None
    return error_response(exc.status_code, detail, kind, headers=headers, path=_path(request))


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    logger.error("unexpected error on %s", request.url.path, exc_info=exc)
    return error_response(500, "internal server error", "server_error", path=_path(request))


def _path(request: Request) -> str:
    # the scope's path, as the gate sees it (one test of "is this an OIP request" for both)
    return str(request.scope.get("path", ""))
