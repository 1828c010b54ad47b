"""One HTTP attempt: post a chunk of texts to a replica and judge the answer.

``ReplicaClient.post`` never raises for what a server or the network does: it returns a
``Reply`` whose ``verdict`` tells the driver what to do next.

=====================================  ===========  =============================================
what happened                          verdict      endpoint's fault (counts towards set-aside)
=====================================  ===========  =============================================
2xx with a valid body                  ok           -
2xx with a wrong count, index, dim     retry        yes: never written, retried elsewhere
429 (``Retry-After`` honoured)         retry        no: alive but busy
503, 500, 502, 504, other 5xx, 408     retry        yes
connect error, timeout, reset          retry        yes
401, 403, 404, 405, 507, 3xx           abort        - (every chunk would fail the same way)
other 4xx (400, 413, 422, ...)         fail         no: the records go to the failures file
=====================================  ===========  =============================================

Two routes: ``/v1/embeddings`` (OpenAI's body; vectors are checked and returned as one
``float32`` array) and ``/generate`` (``{"prompts", "task_id", "chat"}`` -> ``{"results",
"details"}``; one JSON value per prompt, with its ``finish_reason`` and token counts as
output columns when the server sends them).

    >>> client = ReplicaClient(EMBEDDINGS, connect_timeout_s=10, read_timeout_s=120)
    >>> reply = await client.post("http://127.0.0.1:8000", ["a text", "another"], task_id="0-1")
    >>> reply.verdict, reply.results.shape
    ('ok', (2, 384))
    >>> await client.aclose()
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import httpx
import numpy as np

from batchline._tracing import Tracing
from batchline._types import Vector
from batchline.datasets.outcomes import Result
from batchline.driver.retry import parse_retry_after

__all__ = [
    "EMBEDDINGS",
    "GENERATE",
    "EmbeddingsRoute",
    "GenerateRoute",
    "InvalidResponse",
    "ReplicaClient",
    "Reply",
    "Route",
    "Verdict",
]

Verdict = Literal["ok", "retry", "fail", "abort"]
RouteName = Literal["embeddings", "generate", "classify"]

# 507: the server can never hold the model (its memory budget): no retry will change that
_ABORT_STATUSES = frozenset({401, 403, 404, 405, 407, 507})
_RETRY_4XX = frozenset({408, 425, 429})
_MESSAGE_CHARS = 500
#: what ``/generate`` says of each result: output columns beside the text
_DETAILS = ("finish_reason", "prompt_tokens", "completion_tokens")


class InvalidResponse(Exception):  # an internal signal, never escapes this module
    """A 2xx body that does not answer the request (caught here; becomes a retry)."""


@dataclass(frozen=True, slots=True)
class Reply:
    """The outcome of one attempt.

    ``kind`` names it for the counters: ``ok``, ``connect``, ``timeout``, ``network``,
    ``http_429``, ``http_503``, ``http_5xx``, ``invalid_response``, ``client_error``,
    ``misconfigured``. ``message`` is the server's own message when it sent one.
    """

    verdict: Verdict
    kind: str
    status: int | None = None
    message: str = ""
    retry_after_s: float | None = None
    endpoint_fault: bool = False
    results: Vector | list[object] | None = None


class Route(Protocol):
    """How one serving route is called and how its answers are checked."""

    name: RouteName
    path: str
    result_column: str
    result_kind: Literal["vector", "value"]

    def body(self, texts: Sequence[str], *, model: str | None, task_id: str) -> dict[str, object]:
        """The JSON request body for ``texts``."""
        ...

    def parse(self, body: object, n: int, state: _Checks) -> Vector | list[object]:
        """The ``n`` results of a 2xx body, in request order; ``InvalidResponse`` if wrong."""
        ...


class _Checks:
    """What every answer of a job must agree on: the vector length and the model name.

    The first valid answer fixes them (or the manifest of the run being resumed does).
    """

    def __init__(self, dim: int | None = None) -> None:
        self.dim = dim
        self.model: str | None = None


class EmbeddingsRoute:
    """``POST /v1/embeddings``: ``{"input": [...], "model": ...}`` -> ``{"data": [...]}``."""

    name: RouteName = "embeddings"
    path = "/v1/embeddings"
    result_column = "embedding"
    result_kind: Literal["vector", "value"] = "vector"

    def __init__(
        self, *, encoding: Literal["float", "base64"] = "base64", images: bool = False
    ) -> None:
        # base64 (little-endian float32) is exact and ~4x smaller than decimal text, and it
        # spares both sides most of their JSON work; answers in either form are accepted.
        self.encoding = encoding
        #: the inputs are pictures as data URIs (infinity's ``"modality": "image"``)
        self.images = images

    def body(self, texts: Sequence[str], *, model: str | None, task_id: str) -> dict[str, object]:
        body: dict[str, object] = {"input": list(texts), "encoding_format": self.encoding}
        if self.images:
            body["modality"] = "image"
        if model is not None:
            body["model"] = model
        return body

    def parse(self, body: object, n: int, state: _Checks) -> Vector:
        body, data = _answers(body, "data", n, "texts", "embeddings")
        _check_model(body.get("model"), state)
        by_index: dict[int, Vector] = {}
        for item in data:
            if not isinstance(item, dict):
                raise InvalidResponse("an item of 'data' is not an object")
            index = item.get("index")
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < n:
                raise InvalidResponse(f"embedding index {index!r} is not in 0..{n - 1}")
            if index in by_index:
                raise InvalidResponse(f"embedding index {index} appears twice")
            by_index[index] = _vector(item.get("embedding"), index)
        rows = [by_index[i] for i in range(n)]  # n distinct indices below n: each one once
        dim = rows[0].shape[0] if n else state.dim
        for i, row in enumerate(rows):
            if row.shape[0] != dim:
                raise InvalidResponse(
                    f"embedding {i} has {row.shape[0]} values, embedding 0 has {dim}"
                )
        if state.dim is not None and dim != state.dim:
            raise InvalidResponse(f"embeddings have {dim} values, earlier ones {state.dim}")
        matrix = np.stack(rows) if n else np.zeros((0, dim or 0), dtype=np.float32)
        if not np.isfinite(matrix).all():
            raise InvalidResponse("an embedding holds NaN or infinity")
        if dim is not None:
            state.dim = dim
        return matrix


class ClassifyRoute:
    """``POST /v1/classify``: ``{"input": [...], "model": ...}`` (pictures as data URIs with
    ``"modality": "image"``) -> ``{"results": [{"label", "score", ...}]}``."""

    name: RouteName = "classify"
    path = "/v1/classify"
    result_column = "classification"
    result_kind: Literal["vector", "value"] = "value"

    def __init__(self, *, images: bool = False) -> None:
        self.images = images

    def body(self, texts: Sequence[str], *, model: str | None, task_id: str) -> dict[str, object]:
        body: dict[str, object] = {"input": list(texts)}
        if self.images:
            body["modality"] = "image"
        if model is not None:
            body["model"] = model
        return body

    def parse(self, body: object, n: int, state: _Checks) -> list[object]:
        body, results = _answers(body, "results", n, "inputs", "results")
        _check_model(body.get("model"), state)
        for result in results:
            label = result.get("label") if isinstance(result, dict) else None
            score = result.get("score") if isinstance(result, dict) else None
            if not isinstance(label, str) or not isinstance(score, int | float):
                raise InvalidResponse("a result is not an object with a label and a score")
        return results


class GenerateRoute:
    """``POST /generate``: ``{"prompts": [...], "task_id": ..., "chat": true}`` ->
    ``{"results": [...], "details": [...]}``.

    ``chat_template`` (the default, as ``batchline run`` does) asks the server to send each
    prompt through the model's chat template as one user message; the output has the same
    columns as ``run``'s: ``text``, ``finish_reason``, ``prompt_tokens``, ``completion_tokens``.
    """

    name: RouteName = "generate"
    path = "/generate"
    result_column = "text"
    result_kind: Literal["vector", "value"] = "value"

    def __init__(self, *, max_tokens: int | None = None, chat_template: bool = True) -> None:
        # None: the server's default (what the prompt leaves of the context, at most 256)
        self.max_tokens = max_tokens
        self.chat_template = chat_template

    def body(self, texts: Sequence[str], *, model: str | None, task_id: str) -> dict[str, object]:
        body: dict[str, object] = {"prompts": list(texts), "task_id": task_id}
        if self.chat_template:
            body["chat"] = True
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if model is not None:
            body["model"] = model
        return body

    def parse(self, body: object, n: int, state: _Checks) -> list[object]:
        body, results = _answers(body, "results", n, "prompts", "results")
        if any(r is None for r in results):
            raise InvalidResponse("a result is null")
        _check_model(body.get("model"), state)
        details = body.get("details")
        if details is None:  # a server that sends only the results
            return results
        if not isinstance(details, list) or len(details) != n:
            raise InvalidResponse(f"sent {n} prompts, got no list of {n} 'details'")
        out: list[object] = []
        for result, detail in zip(results, details, strict=True):
            if not isinstance(detail, dict) or set(detail) != set(_DETAILS):
                raise InvalidResponse(f"a detail is not an object of {', '.join(_DETAILS)}")
            out.append(Result(result, {k: detail[k] for k in _DETAILS}))
        return out


EMBEDDINGS = EmbeddingsRoute()
GENERATE = GenerateRoute()


def _answers(
    body: object, key: str, n: int, sent: str, got: str
) -> tuple[dict[str, object], list[object]]:
    """The answer body and its ``key`` list, which must hold one item per input sent."""
    if not isinstance(body, dict):
        raise InvalidResponse(f"the body is {type(body).__name__}, not a JSON object")
    items = body.get(key)
    if not isinstance(items, list):
        raise InvalidResponse(f"the body has no '{key}' list")
    if len(items) != n:
        raise InvalidResponse(f"sent {n} {sent}, got {len(items)} {got}")
    return body, items


def _check_model(model: object, state: _Checks) -> None:
    if not isinstance(model, str):
        return
    if state.model is None:
        state.model = model
    elif model != state.model:
        raise InvalidResponse(
            f"answered by model {model!r}, earlier answers by {state.model!r}: "
            "do the replicas serve different models?"
        )


def _vector(value: object, index: int) -> Vector:
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidResponse(f"embedding {index} is not valid base64") from None
        if len(raw) % 4 or not raw:
            raise InvalidResponse(f"embedding {index}: {len(raw)} bytes is not float32 values")
        return np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not isinstance(value, list) or not value:
        raise InvalidResponse(f"embedding {index} is not a non-empty list of numbers")
    array = np.array(value)
    if array.ndim != 1 or array.dtype.kind not in "fiu":
        raise InvalidResponse(f"embedding {index} is not a flat list of numbers")
    return array.astype(np.float32)


class ReplicaClient:
    """Posts chunks of texts to replicas over one pooled ``httpx.AsyncClient``.

    Arguments:
        route: ``EMBEDDINGS`` or ``GENERATE`` (or another ``Route``).
        api_key: sent as ``Authorization: Bearer <key>``.
        model: sent as the request's ``model`` when given.
        connect_timeout_s, read_timeout_s: httpx's connect and read (and write) timeouts.
        max_connections: the connection pool's size; keep it above the job's concurrency so
            no attempt waits for a connection (that wait would look like a slow replica).
        dim: the vector length already in the output (resuming), checked on every answer.
        transport: an ``httpx`` transport (``httpx.MockTransport`` in tests).
        wall: Unix time, for ``Retry-After`` dates.
        tracing: when on (``batchline._tracing``), each attempt is a client span whose
            context goes to the server in ``traceparent``, so the server's spans join it.
    """

    def __init__(
        self,
        route: Route,
        *,
        api_key: str | None = None,
        model: str | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 120.0,
        probe_timeout_s: float = 5.0,
        max_connections: int = 100,
        dim: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        wall: Callable[[], float] = time.time,
        tracing: Tracing | None = None,
    ) -> None:
        self.route = route
        self.model = model
        self._tracing = tracing
        self._checks = _Checks(dim)
        self._wall = wall
        # bulk traffic: a server that mixes it with interactive requests lets those go first
        # (batchline._priority; other servers ignore the header)
        headers = {"User-Agent": "batchline-drive", "X-Batchline-Priority": "batch"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._timeout = httpx.Timeout(
            connect=connect_timeout_s, read=read_timeout_s, write=read_timeout_s, pool=None
        )
        self._probe_timeout = httpx.Timeout(
            probe_timeout_s, connect=min(connect_timeout_s, probe_timeout_s), pool=None
        )
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=self._timeout,
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            transport=transport,
            follow_redirects=False,
        )

    @property
    def dim(self) -> int | None:
        """The vector length every answer has had (None before the first one)."""
        return self._checks.dim

    async def aclose(self) -> None:
        await self._http.aclose()

    async def ready(self, base_url: str) -> bool:
        """Whether ``GET base_url/ready`` answers 200; never raises for network errors."""
        try:
            response = await self._http.get(base_url + "/ready", timeout=self._probe_timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def post(self, base_url: str, texts: Sequence[str], *, task_id: str) -> Reply:
        """Post ``texts`` to ``base_url`` + the route's path once; judge the answer."""
        body = self.route.body(texts, model=self.model, task_id=task_id)
        # ASCII escapes: a lone surrogate in the input still makes a valid request body.
        content = json.dumps(body).encode("ascii")
        headers = {"Content-Type": "application/json"}
        if self._tracing is None:
            return await self._attempt(base_url, content, headers, len(texts))
        t = self._tracing
        span = t.tracer.start_span(
            f"POST {self.route.path}",
            kind=t.CLIENT,
            attributes={
                "http.request.method": "POST",
                "url.full": base_url + self.route.path,
                "batchline.records": len(texts),
                "batchline.task_id": task_id,
            },
        )
        t.inject(headers, context=t.in_context(span))
        try:
            reply = await self._attempt(base_url, content, headers, len(texts))
        except BaseException:  # cancelled (the job stops): the span still ends
            span.set_status(t.error)
            span.end()
            raise
        if reply.status is not None:
            span.set_attribute("http.response.status_code", reply.status)
        if reply.verdict != "ok":
            span.set_attribute("error.type", reply.kind)
            span.set_status(t.error)
        span.end()
        return reply

    async def _attempt(
        self, base_url: str, content: bytes, headers: dict[str, str], n: int
    ) -> Reply:
        try:
            response = await self._http.post(
                base_url + self.route.path, content=content, headers=headers
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            return _transport_reply("connect", exc)
        except httpx.TimeoutException as exc:
            return _transport_reply("timeout", exc)
        except httpx.TransportError as exc:
            return _transport_reply("network", exc)
        return self._judge(response, n)

    def _judge(self, response: httpx.Response, n: int) -> Reply:
        status = response.status_code
        if 200 <= status < 300:
            try:
                try:
                    body = json.loads(response.content)
                except (ValueError, UnicodeDecodeError):
                    raise InvalidResponse("the body is not JSON") from None
                results = self.route.parse(body, n, self._checks)
            except InvalidResponse as exc:
                return Reply(
                    "retry",
                    "invalid_response",
                    status=status,
                    message=str(exc),
                    endpoint_fault=True,
                )
            return Reply("ok", "ok", status=status, results=results)
        message = _server_message(response)
        retry_after = parse_retry_after(response.headers.get("retry-after"), now_wall=self._wall())
        if status == 429:
            return Reply("retry", "http_429", status, message, retry_after, endpoint_fault=False)
        if (status >= 500 and status not in _ABORT_STATUSES) or status in _RETRY_4XX:
            kind = "http_503" if status == 503 else "http_5xx" if status >= 500 else "http_4xx"
            return Reply("retry", kind, status, message, retry_after, endpoint_fault=True)
        if status in _ABORT_STATUSES or status < 200 or 300 <= status < 400:
            return Reply("abort", "misconfigured", status, message)
        return Reply("fail", "client_error", status, message)


def _transport_reply(kind: str, exc: Exception) -> Reply:
    text = str(exc) or type(exc).__name__
    return Reply("retry", kind, message=text[:_MESSAGE_CHARS], endpoint_fault=True)


def _server_message(response: httpx.Response) -> str:
    """The server's own error message: OpenAI's ``error.message``, FastAPI's ``detail``, or
    the start of the body."""
    try:
        body = json.loads(response.content)
    except (ValueError, UnicodeDecodeError):
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])[:_MESSAGE_CHARS]
        detail = body.get("detail")
        if isinstance(detail, str):
            return detail[:_MESSAGE_CHARS]
        if detail is not None:
            return json.dumps(detail)[:_MESSAGE_CHARS]
    text = response.content[:_MESSAGE_CHARS].decode("utf-8", errors="replace").strip()
    return text or response.reason_phrase
