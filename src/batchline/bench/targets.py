"""What a bench drives: any model in-process under some batching configuration, or a server.

* :class:`Configuration` names one way to serve the model: batchline with some ``Knobs``
  (``batching=False`` is the no-batching baseline: records one at a time on a shared session),
  the classic timeout batcher, or an HTTP URL.
* :func:`open_target` starts a configuration and yields a :class:`~batchline.bench.loadgen.Target`.

In-process targets run the model through :class:`batchline.models.batching.ModelBatcher`, the code
``batchline run`` and ``batchline serve`` run, and are fed items prepared once before
measuring (tokenizing, checking tensors: the same work in every configuration). An HTTP
target sends raw inputs, one per request, to ``POST /v1/embeddings`` (texts) or to the Open
Inference Protocol's ``POST /v2/models/{name}/infer`` (texts or tensor rows), through a lean
keep-alive HTTP/1.1 client (``httpx`` costs a millisecond or two of CPU per request, enough
for the load generator to compete with the server for the cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from batchline._errors import InputError
from batchline.bench.loadgen import Counters, Target
from batchline.bench.model import AnyModel, LoadedModels, prepare_items
from batchline.knobs import machine_cores
from batchline.models.config import Knobs

if TYPE_CHECKING:
    import httpx

    from batchline.models.batching import ModelBatcher

__all__ = [
    "CLASSIC_BATCH_TIMEOUT_S",
    "CLASSIC_MAX_BATCH_SIZE",
    "Configuration",
    "HttpError",
    "HttpTarget",
    "Route",
    "embeddings_url",
    "oip_body",
    "oip_url",
    "open_target",
    "reference_configurations",
]

#: The classic reference: at most 32 records, waiting up to 10 ms for a full batch (the shape of
#: Ray Serve's and TorchServe's batching), one session with every core.
CLASSIC_MAX_BATCH_SIZE = 32
CLASSIC_BATCH_TIMEOUT_S = 0.01

ConfigKind = Literal["knobs", "classic", "http"]
#: What an HTTP target speaks: OpenAI embeddings or the Open Inference Protocol.
Route = Literal["openai", "oip"]


@dataclass(frozen=True)
class Configuration:
    """One way of serving the model, as a bench compares them."""

    name: str
    kind: ConfigKind
    knobs: Knobs = field(default_factory=Knobs)
    url: str = ""
    description: str = ""
    route: Route = "openai"

    @classmethod
    def from_knobs(cls, name: str, knobs: Knobs, description: str = "") -> Configuration:
        return cls(name, "knobs", knobs, description=description or describe_knobs(knobs))

    @property
    def is_baseline(self) -> bool:
        return self.kind == "knobs" and not self.knobs.batching


def describe_knobs(knobs: Knobs) -> str:
    """A short human description of ``knobs``."""
    layout = (
        f"{knobs.sessions} session{'s' if knobs.sessions > 1 else ''} x "
        f"{knobs.intra_op_threads} thread{'s' if knobs.intra_op_threads > 1 else ''}"
    )
    if knobs.is_gpu:
        layout += f" on {knobs.device}"
    if not knobs.batching:
        shared = ", shared" if knobs.sessions == 1 else ""
        return (
            f"no batching: one record per call, {knobs.max_concurrent_batches} callers; "
            f"{layout}{shared}"
        )
    hold = ""
    if knobs.min_batch_size > 1:
        hold = (
            f", holds for {knobs.min_batch_size} records up to {knobs.batch_timeout_s * 1e3:g} ms"
        )
    return (
        f"{knobs.target_batch_tokens} padded tokens per batch, "
        f"{knobs.max_concurrent_batches} batch{'es' if knobs.max_concurrent_batches > 1 else ''} "
        f"in flight; {layout}{hold}"
    )


def reference_configurations(
    names: Sequence[str], *, cores: int | None = None, device: str = "cpu"
) -> list[Configuration]:
    """The built-in configurations: ``baseline``, ``defaults`` and ``classic``, in that order.

    ``cores`` (default: :func:`batchline.knobs.machine_cores`) sizes the baseline's and the
    classic batcher's one session and the defaults' sessions; ``device`` is ``cpu`` or
    ``cuda[:N]`` for all three.
    """
    cores = cores or machine_cores()
    classic_knobs = Knobs(
        sessions=1, intra_op_threads=cores, max_concurrent_batches=1, device=device
    )
    known = {
        "baseline": Configuration.from_knobs(
            "baseline",
            Knobs(device=device).baseline(cores),
        ),
        "defaults": Configuration.from_knobs(
            "batchline defaults",
            Knobs(sessions=cores, max_concurrent_batches=cores, device=device),
        ),
        "classic": Configuration(
            "classic timeout",
            "classic",
            classic_knobs,
            description=(
                f"up to {CLASSIC_MAX_BATCH_SIZE} records, waits up to "
                f"{CLASSIC_BATCH_TIMEOUT_S * 1e3:g} ms for a full batch, one batch at a time, "
                f"no padding awareness; 1 session x {cores} thread{'s' if cores > 1 else ''}"
            ),
        ),
    }
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InputError(
            f"unknown reference configuration(s) {', '.join(unknown)}; "
            f"choose among {', '.join(known)} or 'none'"
        )
    return [known[n] for n in known if n in names]


# -- in-process targets --------------------------------------------------------------------


Submit = Callable[[object], Awaitable["asyncio.Future[object]"]]


class _SubmitTarget:
    """Sends record ``i % n`` through a batcher's ``submit`` and waits for its result."""

    def __init__(
        self, submit: Submit, counters: Callable[[], Counters | None], records: Sequence[object]
    ) -> None:
        self._submit = submit
        self._counters = counters
        self._records = records

    async def call(self, index: int) -> None:
        await (await self._submit(self._records[index % len(self._records)]))

    def counters(self) -> Counters | None:
        return self._counters()


def _stats_counters(batcher: ModelBatcher[object, object]) -> Callable[[], Counters]:
    def read() -> Counters:
        s = batcher.stats
        return Counters(
            batches=s.total_batches,
            records=s.avg_batch_size * s.total_batches,
            busy_s=s.busy_time_s,
            slot_s=s.busy_time_s + s.idle_time_s,
            pending=s.queue_depth + s.in_flight_batches,
        )

    return read


async def _prepared(
    loader: LoadedModels, knobs: Knobs, inputs: Sequence[object]
) -> tuple[AnyModel, list[object]]:
    """The model laid out as ``knobs`` say and ``inputs`` prepared for it, before measuring."""
    model = await asyncio.to_thread(loader.load, knobs)
    return model, await asyncio.to_thread(prepare_items, model, inputs)


@contextlib.asynccontextmanager
async def _knobs_target(
    loader: LoadedModels, knobs: Knobs, inputs: Sequence[object]
) -> AsyncIterator[Target]:
    from batchline.models.batching import ModelBatcher

    model, items = await _prepared(loader, knobs, inputs)
    # batching or the baseline, built exactly as ``batchline run`` builds it
    async with ModelBatcher(model, knobs) as batcher:
        yield _SubmitTarget(batcher.submit, _stats_counters(batcher), items)


@contextlib.asynccontextmanager
async def _classic_target(
    loader: LoadedModels, knobs: Knobs, inputs: Sequence[object]
) -> AsyncIterator[Target]:
    from batchline.bench.classic import TimeoutBatcher

    model, items = await _prepared(loader, knobs, inputs)
    batcher: TimeoutBatcher[object, object] = TimeoutBatcher(
        model.run_batch,
        max_batch_size=CLASSIC_MAX_BATCH_SIZE,
        batch_timeout_s=CLASSIC_BATCH_TIMEOUT_S,
        max_queue_size=knobs.max_queue_size,
    )
    async with batcher:
        yield _SubmitTarget(batcher.submit, batcher.counters, items)


@contextlib.asynccontextmanager
async def open_target(
    config: Configuration,
    inputs: Sequence[object],
    loader: LoadedModels | None = None,
    *,
    model: str = "",
) -> AsyncIterator[Target]:
    """Start ``config`` and yield a target sending ``inputs`` (cyclically); stop it on exit.

    In-process configurations load the model through ``loader`` and prepare ``inputs`` before
    yielding; an HTTP configuration sends them raw (``model``: the served model's name).
    """
    if config.kind == "http":
        async with HttpTarget(config.url, inputs, route=config.route, model=model) as http:
            yield http
        return
    if loader is None:
        raise ValueError(f"configuration {config.name!r} runs in-process and needs a LoadedModels")
    opener = _classic_target if config.kind == "classic" else _knobs_target
    async with opener(loader, config.knobs, inputs) as target:
        yield target


# -- HTTP ----------------------------------------------------------------------------------


def _check_url(url: str) -> urllib.parse.SplitResult:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(
            f"--target {url!r}: expected 'inprocess' or an http(s):// URL of a batchline "
            "server (POST /v1/embeddings, or with --route oip /v2/models/NAME/infer), e.g. "
            "http://127.0.0.1:8000"
        )
    return parts


def embeddings_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/v1/embeddings``; a full route is kept."""
    parts = _check_url(url)
    path = parts.path.rstrip("/")
    if not path.endswith("/embeddings"):
        path += "/v1/embeddings"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def oip_url(url: str, model: str, *, action: str = "infer") -> str:
    """``http://host:port`` -> ``http://host:port/v2/models/MODEL/infer`` (the Open Inference
    Protocol); ``action=""`` gives the model's metadata route. A full ``.../infer`` is kept."""
    parts = _check_url(url)
    path = parts.path.rstrip("/")
    if path.endswith("/infer"):
        if not action:
            path = path[: -len("/infer")]
    else:
        path += f"/v2/models/{urllib.parse.quote(model, safe='')}"
        if action:
            path += f"/{action}"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def oip_body(item: object) -> dict[str, object]:
    """One record as an Open Inference Protocol request of one row: a text as the ``text``
    BYTES tensor (embed and classify models), a tensor row ``{name: array}`` as its inputs."""
    if isinstance(item, str):
        return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [item]}]}
    if not isinstance(item, Mapping):
        raise InputError(
            f"an Open Inference Protocol request carries texts or named tensors, not "
            f"{type(item).__name__}"
        )
    import numpy as np

    from batchline.oip import datatype_of

    tensors: list[dict[str, object]] = []
    for name, value in item.items():
        arr = np.asarray(value)
        try:
            datatype = datatype_of(arr.dtype)
        except ValueError:
            datatype = "BYTES"
        if datatype == "BYTES":
            raise InputError(f"input {name!r}: {arr.dtype} tensors are not sent over JSON")
        data = arr.ravel().tolist()
        tensors.append(
            {"name": str(name), "datatype": datatype, "shape": [1, *arr.shape], "data": data}
        )
    return {"inputs": tensors}


def oip_inputs(url: str, model: str, *, timeout_s: float = 10.0) -> list[dict[str, object]]:
    """The model's inputs as the server describes them (``GET /v2/models/MODEL``): what to
    shape random rows from, or which columns of ``--inputs`` to read. Sync."""
    import urllib.error
    import urllib.request

    meta = oip_url(url, model, action="")
    try:
        with urllib.request.urlopen(meta, timeout=timeout_s) as response:
            doc = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise InputError(f"GET {meta}: HTTP {exc.code}; is {model!r} served there?") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"GET {meta}: {exc}") from None
    inputs = doc.get("inputs") if isinstance(doc, dict) else None
    if not isinstance(inputs, list) or not all(isinstance(i, dict) for i in inputs):
        raise InputError(f"GET {meta}: the answer lists no model inputs")
    return inputs


class HttpError(Exception):
    """A request got a non-200 answer or a broken response."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


class HttpTarget:
    """One input per request over keep-alive HTTP/1.1 connections (opened as needed, at most
    ``max_connections``): ``route="openai"`` posts ``{"input": text}`` (plus ``"model"`` when
    ``model`` is given) to ``/v1/embeddings``; ``route="oip"`` posts a one-row Open Inference
    Protocol request (:func:`oip_body`) to ``/v2/models/{model}/infer``.

    A plain ``http://`` URL goes through a small built-in client; ``https://`` through httpx.
    """

    def __init__(
        self,
        url: str,
        inputs: Sequence[object],
        *,
        route: Route = "openai",
        model: str = "",
        max_connections: int = 512,
    ) -> None:
        if route == "oip":
            if not model:
                raise InputError("--route oip needs the served model's name: --model NAME")
            self.url = oip_url(url, model)
            bodies = [oip_body(item) for item in inputs]
        elif route == "openai":
            self.url = embeddings_url(url)
            bodies = []
            for text in inputs:
                if not isinstance(text, str):
                    raise InputError("POST /v1/embeddings sends texts; use --route oip for tensors")
                bodies.append({"input": text, **({"model": model} if model else {})})
        else:
            raise InputError(f"--route must be openai or oip, got {route!r}")
        if not bodies:
            raise InputError("no inputs to send")
        parts = urllib.parse.urlsplit(self.url)
        self._tls = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._tls else 80)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        self._bodies = [json.dumps(b).encode() for b in bodies]
        self._head = (
            f"POST {target} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            "Content-Type: application/json\r\nAccept: application/json\r\n"
        ).encode()
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._httpx: httpx.AsyncClient | None = None

    async def __aenter__(self) -> HttpTarget:
        if self._tls:
            import httpx

            self._httpx = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=512))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
        if self._httpx is not None:
            await self._httpx.aclose()

    def counters(self) -> Counters | None:
        return None

    async def call(self, index: int) -> None:
        body = self._bodies[index % len(self._bodies)]
        if self._httpx is not None:
            response = await self._httpx.post(
                self.url, content=body, headers={"content-type": "application/json"}
            )
            status = response.status_code
        else:
            async with self._slots:
                status = await self._post(body)
        if status != 200:
            raise HttpError(f"HTTP {status}")

    async def _post(self, body: bytes) -> int:
        if self._idle:
            try:
                return await self._send(self._idle.pop(), body)
            except (ConnectionError, asyncio.IncompleteReadError, HttpError):
                pass  # the server closed an idle keep-alive connection: retry once on a fresh one
        return await self._send(await self._connect(), body)

    async def _send(self, conn: _Connection, body: bytes) -> int:
        """One request on ``conn``, then kept for the next one or closed (as the server says)."""
        try:
            status, keep = await self._exchange(conn, body)
        except BaseException:
            conn.close()
            raise
        if keep:
            self._idle.append(conn)
        else:
            conn.close()
        return status

    async def _connect(self) -> _Connection:
        reader, writer = await asyncio.open_connection(self._host, self._port)
        return _Connection(reader, writer)

    async def _exchange(self, conn: _Connection, body: bytes) -> tuple[int, bool]:
        conn.writer.write(self._head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await conn.writer.drain()
        status_line = await conn.reader.readline()
        if not status_line:
            raise ConnectionError("connection closed before the response")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise HttpError(f"not an HTTP response: {status_line[:80]!r}")
        status = int(parts[1])
        keep = parts[0] == b"HTTP/1.1"
        length: int | None = None
        chunked = False
        while True:
            line = await conn.reader.readline()
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise ConnectionError("connection closed inside the response headers")
            name, _, value = line.partition(b":")
            key = name.strip().lower()
            if key == b"content-length":
                length = int(value.strip())
            elif key == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif key == b"connection":
                keep = value.strip().lower() == b"keep-alive" or (
                    keep and value.strip().lower() != b"close"
                )
        if chunked:
            while True:
                size = int((await conn.reader.readline()).split(b";")[0].strip(), 16)
                await conn.reader.readexactly(size + 2)  # the chunk and its CRLF
                if size == 0:
                    break
        elif length is not None:
            await conn.reader.readexactly(length)
        else:
            await conn.reader.read()  # body until the server closes
            keep = False
        return status, keep
