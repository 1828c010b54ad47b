"""The gate: pure ASGI middleware in front of the routes (host, auth, drain, content type,
body, disconnects).

It runs before FastAPI sees a request, so a refused request costs no parsing: a ``Host``
the server does not answer to (421: a page whose name was rebound to this address, see
``ServerSettings.host_names``), a cross-site request from an origin not in ``cors_origins``
(403: a page of another site, which a browser lets send a request it may not read; see
:func:`cross_site`), the API key (401), draining or still loading (503 +
``Retry-After``), a body that is not JSON (415: a cross-site form or ``text/plain`` post,
which a browser sends without asking; a POST with no body and no type passes), the body
size (413, on ``Content-Length`` and on the bytes actually read), a body that trickles in
(408). It reads the body itself and hands it to the routes in one piece
(``scope["batchline.body"]``), counts the requests in flight (what a drain waits for), and
watches the connection of a request that lasts, until its response is sent whole (a stream
too): a client that disconnects has its request task cancelled, which withdraws the request's
queued records, or aborts its sequences; no response follows (nobody would read it). This is
the one place a disconnect is watched: no route reads ``receive`` for it.

Several API keys may be accepted (``ServerSettings.api_keys``); the gate leaves the caller's
identity in the scope (:data:`OWNER`: a digest of its key), which the Batch API's files and
batches belong to. One route's body is not read here: an upload to ``/v1/files`` (multipart,
not JSON: the one body exempt from the JSON check, and one that creates nothing a request can
run without a JSON call to ``/v1/batches``) goes to its route as a stream, cut off with 413 past
``max_batch_file_bytes``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchline.server.errors import error_response, validation_error
from batchline.server.served import ServedModel
from batchline.server.state import ServerState

__all__ = ["OPEN_PATHS", "OWNER", "UPLOAD_PATH", "Gate", "cross_site", "owner_of", "parse_body"]

#: Paths that never need the API key nor count as work (probes and scrapes).
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/v2/health/live", "/v2/health/ready"})
#: Liveness probes: answered whatever the ``Host`` (they say nothing but "up").
_ANY_HOST_PATHS = frozenset({"/health", "/v2/health/live"})
#: The Open Inference Protocol's binary tensor requests carry this header and their own
#: content type; a browser cannot send it cross-site without a CORS preflight.
_BINARY_OIP_HEADER = b"inference-header-content-length"
#: The request-scope key of the caller's identity: a digest of the API key it sent ("" when
#: the server has none). The Batch API's files and batches belong to it.
OWNER = "batchline.owner"
#: The one route whose body is not read here: a multipart upload, streamed to disk by its
#: route and capped in size on the way (``max_batch_file_bytes``), never held whole.
UPLOAD_PATH = "/v1/files"
#: Room for the multipart framing and form fields around an upload's file.
_UPLOAD_FRAMING_BYTES = 64 * 1024
# A request still running after this long starts watching for its client's disconnect.
_WATCH_AFTER_S = 0.02

M = TypeVar("M", bound=BaseModel)


class Gate:
    """The gate (see the module docstring); ``app.add_middleware(Gate, state=state)``."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        self._host_names = state.settings.host_names  # the settings are frozen
        # every accepted key (several: comma-separated or a keys file)
        self._keys = tuple(k.encode("utf-8") for k in state.settings.api_keys)
        self._origins = frozenset(o.lower().rstrip("/") for o in state.settings.cors_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        st = self.state
        names = self._host_names
        if names is not None and scope["path"] not in _ANY_HOST_PATHS:
            host = _header(scope, b"host")
            if host is not None and not _host_allowed(host, names):
                message = (
                    f"this server does not answer to Host {host.decode('latin-1')!r}; "
                    "add the name to --allowed-hosts (allowed_hosts) to serve it"
                )
                misdirected = _refusal(scope, 421, message, "misdirected")
                await misdirected(scope, receive, send)
                return
        foreign = cross_site(scope, self._origins)
        if foreign is not None:
            message = (
                f"a cross-site request ({foreign}) is refused; add the page's origin to "
                "--cors-origins (cors_origins) to let it call this server"
            )
            forbidden = _refusal(scope, 403, message, "cross_origin")
            await forbidden(scope, receive, send)
            return
        if scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        owner = _owner(scope, self._keys or (st.api_key,)) if st.api_key is not None else ""
        if owner is None:
            denied = _refusal(
                scope,
                401,
                "missing or invalid API key; send 'Authorization: Bearer <key>'",
                "authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await denied(scope, receive, send)
            return
        if st.draining or not st.ready:
            why = "the server is shutting down" if st.draining else "the model is not loaded yet"
            models = st.registry.models() if st.draining else []
            if models:
                models[0].metrics.rejected("draining")
            unavailable = _refusal(
                scope,
                503,
                f"{why}; retry on another replica or later",
                "service_unavailable",
                headers={"Retry-After": str(st.settings.retry_after_s), "Connection": "close"},
            )
            await unavailable(scope, receive, send)
            return
        scope[OWNER] = owner
        upload = scope["method"] == "POST" and scope["path"] == UPLOAD_PATH
        with_body = not upload and scope["method"] in ("POST", "PUT", "PATCH")
        media = _json_media_type(scope) if with_body else None
        if media is not None:
            message = (
                f"a request body must be JSON, sent with 'Content-Type: application/json' "
                f"(got {media or 'no Content-Type'})"
            )
            unsupported = _refusal(scope, 415, message, "unsupported_media")
            await unsupported(scope, receive, send)
            return
        st._enter()
        try:
            if upload:
                await self._upload(scope, receive, send)
            elif with_body:
                await self._with_body(scope, receive, send)
            else:
                await self.app(scope, receive, send)
        finally:
            st.registry.release(scope)  # the on-demand models this request held are idle again
            st._leave()

    async def _with_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.state.body_limit
        too_large = _refusal(
            scope,
            413,
            f"request body is larger than the server's limit of {limit} bytes; "
            f"{self.state.body_advice}",
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
                    bad = _refusal(scope, 400, "invalid Content-Length", "invalid_request_error")
                    await bad(scope, receive, send)
                    return
                if declared > limit:
                    await too_large(scope, receive, send)
                    return
        first = await receive()
        if first["type"] == "http.disconnect":
            return  # the client left before sending its body
        body = first.get("body", b"")
        if len(body) > limit:
            await too_large(scope, receive, send)
            return
        if first.get("more_body", False):
            # a body in pieces: read the rest, bounded in size and in time (a client that
            # trickles its body must not hold a slot forever)
            try:
                async with asyncio.timeout(self.state.settings.request_timeout_s):
                    rest = await _read_rest(receive, limit - len(body))
            except TimeoutError:
                slow = _refusal(
                    scope,
                    408,
                    "the request body did not arrive within request_timeout_s",
                    "request_timeout",
                    headers={"Connection": "close"},
                )
                await slow(scope, receive, send)
                return
            if rest is None:
                return
            if isinstance(rest, int):
                await too_large(scope, receive, send)
                return
            body += rest
        scope["batchline.body"] = body

        delivered = False
        finished = False
        disconnected = False
        response_sent = False  # its last byte (a stream's too) is handed to the server
        task = asyncio.current_task()

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def tracked_send(message: Message) -> None:
            nonlocal response_sent
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                response_sent = True

        async def watch() -> None:
            nonlocal disconnected
            message = await receive()
            if message["type"] == "http.disconnect" and not finished and not response_sent:
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
                served = self.state.registry.get(scope.get("batchline.model", ""))
                if isinstance(served, ServedModel):  # the batch model the route picked
                    served.metrics.cancelled("disconnect")
                return  # nobody is listening: no response
            raise
        finally:
            finished = True
            timer.cancel()
            if watcher is not None:
                watcher.cancel()

    async def _upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        """An upload goes to its route as a stream, cut off past the size cap: 413, whether
        ``Content-Length`` says so or the bytes do (the route spools the parts to disk)."""
        cap = self.state.settings.max_batch_file_bytes
        limit = cap + _UPLOAD_FRAMING_BYTES
        too_large = _refusal(
            scope,
            413,
            f"the upload is larger than max_batch_file_bytes={cap}; split the file",
            "request_too_large",
            headers={"Connection": "close"},
        )
        raw = _header(scope, b"content-length")
        declared = raw.decode("latin-1").strip() if raw is not None else None
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await too_large(scope, receive, send)
            return
        seen = 0
        over = False
        started = False

        async def capped() -> Message:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True  # the route sees the client leave, and stops reading
                    return {"type": "http.disconnect"}
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, capped, tracked)
        except Exception:
            if not over or started:
                raise
        if over and not started:
            await too_large(scope, receive, send)


def _refusal(
    scope: Scope, status: int, message: str, kind: str, *, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The gate's error response, in the body the request's path speaks (an OIP path's own)."""
    return error_response(status, message, kind, headers=headers, path=scope["path"])


async def parse_body(request: Request, model: type[M]) -> M:
    """The body the gate read, validated as ``model``; a 422 that never echoes the input."""
    body = request.scope.get("batchline.body")
    if body is None:
        body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False, include_context=False)
        for err in errors:
            err["loc"] = ("body", *err["loc"])
        raise validation_error(errors) from None


def owner_of(scope: Scope) -> str:
    """Who sent a request, as the gate found it (:data:`OWNER`)."""
    return str(scope.get(OWNER, ""))


def cross_site(scope: Scope, allowed: frozenset[str]) -> str | None:
    """What makes a request cross-site when it is not allowed (``"Origin: ..."`` or
    ``"Sec-Fetch-Site: ..."``), ``None`` when it may go on.

    A browser says where a request comes from: ``Origin`` on every POST (and on CORS reads),
    ``Sec-Fetch-Site`` on every request of a modern browser. A page of another origin may make
    a browser *send* a simple request (a form post, an image's GET) without asking the server
    first; it only may not read the answer. So a request whose ``Origin`` is neither this
    server's own (the scheme's default port aside, its ``Host``) nor in ``allowed`` (the
    ``cors_origins``, lower case; ``*`` allows all), or with no ``Origin`` and a
    ``Sec-Fetch-Site`` of ``cross-site`` or ``same-site``, is refused before it does anything.
    Clients that are not browsers (curl, the SDKs, ``drive``) send neither header."""
    if "*" in allowed:
        return None
    origin = _header(scope, b"origin")
    if origin is not None:
        text = origin.decode("latin-1").strip()
        if text.lower().rstrip("/") in allowed or _same_origin(text, _header(scope, b"host")):
            return None
        return f"Origin: {text[:200]}"
    site = _header(scope, b"sec-fetch-site")
    if site is not None:
        value = site.decode("latin-1").strip().lower()
        if value in ("cross-site", "same-site"):
            return f"Sec-Fetch-Site: {value}"
    return None


_DEFAULT_PORTS = {"http": "80", "https": "443"}


def _same_origin(origin: str, host: bytes | None) -> bool:
    """Whether ``origin`` (``scheme://name[:port]``) names the server the request's ``Host``
    names (``"null"``, an opaque origin, never does)."""
    if host is None:
        return False
    scheme, sep, rest = origin.lower().partition("://")
    if not sep or not rest or "/" in rest:
        return False

    def plain(netloc: str) -> str:
        default = _DEFAULT_PORTS.get(scheme)
        if default is not None and netloc.endswith(":" + default):
            netloc = netloc[: -len(default) - 1]
        return netloc.removesuffix(".")

    return plain(rest) == plain(host.decode("latin-1").strip().lower())


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


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _host_allowed(host: bytes, names: frozenset[str]) -> bool:
    """Whether a ``Host`` value (``name``, ``name:port``, ``[v6]:port``) names this server."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        name = text[1:].partition("]")[0]
    else:
        name, _, port = text.rpartition(":") if ":" in text else (text, "", "")
        if port and not port.isdigit():
            return False
    name = name.removesuffix(".")
    if not name:
        return False
    return name in names or any(
        n.startswith("*.") and name.endswith(n[1:]) and len(name) > len(n) - 1 for n in names
    )


def _json_media_type(scope: Scope) -> str | None:
    """``None`` when a body may be read: JSON (``application/json`` or ``application/*+json``,
    any parameters) or a binary Open Inference Protocol request; else the media type sent
    (``""``: none). An Open Inference Protocol request with no type at all is JSON by that
    protocol: tritonclient sends its JSON requests so."""
    if _header(scope, _BINARY_OIP_HEADER) is not None:
        return None
    raw = _header(scope, b"content-type")
    if raw is None and scope["path"].startswith("/v2/"):
        return None
    if raw is None and _bodiless(scope):
        return None  # nothing to type (``POST /v1/batches/{id}/cancel`` as curl sends it)
    media = (raw or b"").decode("latin-1").partition(";")[0].strip().lower()
    main, _, sub = media.partition("/")
    if main == "application" and (sub == "json" or sub.endswith("+json")):
        return None
    return media


def _bodiless(scope: Scope) -> bool:
    """Whether the request says it has no body: no ``Transfer-Encoding`` and a
    ``Content-Length`` of 0 or none (HTTP/1.1's rule for a request)."""
    if _header(scope, b"transfer-encoding") is not None:
        return False
    length = _header(scope, b"content-length")
    return length is None or length.strip() == b"0"


def _owner(scope: Scope, keys: tuple[bytes, ...]) -> str | None:
    """The owner id of the request's bearer key (a digest, never the key), ``None`` when it
    sent none of ``keys``. Every key is compared, in constant time each."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() != b"bearer":
                return None
            token = token.strip()
            matched = [hmac.compare_digest(token, key) for key in keys]
            if not any(matched):
                return None
            return hashlib.sha256(token).hexdigest()[:32]
    return None
