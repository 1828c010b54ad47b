"""What a bench drives: the model in-process under some batching configuration, or a server.

* :class:`Configuration` names one way to serve the model: batchline with some ``Knobs``
  (``batching=False`` is the no-batching baseline: records one at a time on a shared session),
  the classic timeout batcher, or an HTTP URL.
* :class:`ModelLoader` loads the model once per session layout and reuses it, so a tuner that
  tries many batch budgets does not reload the weights each time.
* :func:`open_target` starts a configuration and yields a :class:`~batchline.bench.loadgen.Target`.

In-process targets are fed pre-tokenized texts (tokenizing is the same work in every
configuration); an HTTP target sends the raw text, one per ``POST /v1/embeddings`` request,
through a lean keep-alive HTTP/1.1 client (``httpx`` costs a millisecond or two of CPU per
request, enough for the load generator to compete with the server for the cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from batchline._errors import InputError
from batchline.bench.loadgen import Counters, Target
from batchline.knobs import BASELINE, Knobs

__all__ = [
    "CLASSIC_BATCH_TIMEOUT_S",
    "CLASSIC_MAX_BATCH_SIZE",
    "Configuration",
    "HttpError",
    "HttpTarget",
    "ModelLoader",
    "open_target",
    "reference_configurations",
]

#: The classic reference: at most 32 records, waiting up to 10 ms for a full batch (the shape of
#: Ray Serve's and TorchServe's batching), one session with every core.
CLASSIC_MAX_BATCH_SIZE = 32
CLASSIC_BATCH_TIMEOUT_S = 0.01

ConfigKind = Literal["knobs", "classic", "http"]


@dataclass(frozen=True)
class Configuration:
    """One way of serving the model, as a bench compares them."""

    name: str
    kind: ConfigKind
    knobs: Knobs = field(default_factory=Knobs)
    url: str = ""
    description: str = ""

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


def reference_configurations(names: Sequence[str]) -> list[Configuration]:
    """The built-in configurations: ``baseline``, ``defaults`` and ``classic``, in that order."""
    known = {
        "baseline": Configuration.from_knobs("baseline", BASELINE),
        "defaults": Configuration.from_knobs("batchline defaults", Knobs()),
        "classic": Configuration(
            "classic timeout",
            "classic",
            Knobs(sessions=1, intra_op_threads=2, max_concurrent_batches=1),
            description=(
                f"up to {CLASSIC_MAX_BATCH_SIZE} records, waits up to "
                f"{CLASSIC_BATCH_TIMEOUT_S * 1e3:g} ms for a full batch, one batch at a time, "
                "no padding awareness; 1 session x 2 threads"
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


# -- the model, loaded once per session layout ----------------------------------------------


class ModelLoader:
    """Loads ``--model`` (``default`` or ``PATH.onnx`` with ``--tokenizer``) and builds embedders.

    Models are cached by (sessions, intra-op threads, shared), so only the first configuration
    with a given layout pays for loading the weights.
    """

    def __init__(self, model: str = "default", tokenizer: Path | None = None) -> None:
        if model == "default":
            if tokenizer is not None:
                raise InputError("--tokenizer goes with --model PATH.onnx, not the default model")
        else:
            path = Path(model)
            if path.suffix.lower() != ".onnx":
                raise InputError(
                    f"--model must be 'default' or a path to an .onnx file, got {model!r}"
                )
            if not path.is_file():
                raise InputError(f"{path}: no such model file")
            if tokenizer is None:
                raise InputError(f"--model {path} needs --tokenizer PATH/tokenizer.json")
            if not tokenizer.is_file():
                raise InputError(f"{tokenizer}: no such tokenizer file")
        self.model = model
        self.tokenizer_path = tokenizer
        self._models: dict[tuple[int, int, bool], Any] = {}
        self._tokenizer: tuple[Any, int] | None = None

    def tokenizer(self) -> tuple[Any, int]:
        """``(tokenizer, pad_id)`` of the model, loaded once."""
        if self._tokenizer is None:
            from batchline.models import load_tokenizer

            if self.model == "default":
                from batchline.models import minilm

                self._tokenizer = load_tokenizer(
                    minilm.weights_dir() / "tokenizer.json", max_length=minilm.MAX_LENGTH
                )
            else:
                assert self.tokenizer_path is not None
                self._tokenizer = load_tokenizer(self.tokenizer_path)
        return self._tokenizer

    def onnx_model(self, sessions: int, intra_op_threads: int, shared: bool) -> Any:
        """The ``OnnxModel`` with that layout (cached)."""
        key = (sessions, intra_op_threads, shared)
        if key not in self._models:
            from batchline.models import OnnxModel

            if self.model == "default":
                from batchline.models import minilm

                path = minilm.default_model_path()
            else:
                path = Path(self.model)
            self._models[key] = OnnxModel.load(
                path, sessions=sessions, intra_op_threads=intra_op_threads, shared=shared
            )
        return self._models[key]

    def embedder(self, knobs: Knobs) -> Any:
        """An ``Embedder`` laid out and batching as ``knobs`` say."""
        from batchline.models import Embedder

        options = knobs.embedder_options()
        model = self.onnx_model(
            options.pop("sessions"), options.pop("intra_op_threads"), options.pop("shared")
        )
        tokenizer, pad_id = self.tokenizer()
        return Embedder(model, tokenizer, pad_id=pad_id, **options)

    def release(self, keep: Sequence[tuple[int, int, bool]] = ()) -> None:
        """Drop cached models except the layouts in ``keep``."""
        for key in list(self._models):
            if key not in keep:
                del self._models[key]


# -- in-process targets --------------------------------------------------------------------


Submit = Callable[[Any], Awaitable["asyncio.Future[Any]"]]


class _SubmitTarget:
    """Sends record ``i % n`` through a batcher's ``submit`` and waits for its result."""

    def __init__(
        self, submit: Submit, counters: Callable[[], Counters | None], records: Sequence[Any]
    ) -> None:
        self._submit = submit
        self._counters = counters
        self._records = records

    async def call(self, index: int) -> None:
        future = await self._submit(self._records[index % len(self._records)])
        await future

    def counters(self) -> Counters | None:
        return self._counters()


def _stats_counters(batcher: Any) -> Callable[[], Counters]:
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


@contextlib.asynccontextmanager
async def _knobs_target(
    loader: ModelLoader, knobs: Knobs, texts: Sequence[str]
) -> AsyncIterator[Target]:
    from batchline.models.engine import Engine
    from batchline.models.onnx.embed import TextEmbedder

    embedder = await asyncio.to_thread(loader.embedder, knobs)
    model = TextEmbedder(embedder, name=loader.model)
    tokens = await asyncio.to_thread(embedder.tokenize, texts)
    # batching or the baseline, built by the engine layer exactly as ``batchline run`` builds it
    async with Engine(model, knobs) as engine:
        yield _SubmitTarget(engine.submit, _stats_counters(engine), tokens)


@contextlib.asynccontextmanager
async def _classic_target(
    loader: ModelLoader, knobs: Knobs, texts: Sequence[str]
) -> AsyncIterator[Target]:
    from batchline.bench.classic import TimeoutBatcher

    embedder = await asyncio.to_thread(loader.embedder, knobs)
    tokens = await asyncio.to_thread(embedder.tokenize, texts)

    def run_batch(batch: list[Any]) -> list[Any]:
        return list(embedder.embed_tokens(batch))

    batcher: TimeoutBatcher[Any, Any] = TimeoutBatcher(
        run_batch,
        max_batch_size=CLASSIC_MAX_BATCH_SIZE,
        batch_timeout_s=CLASSIC_BATCH_TIMEOUT_S,
        max_queue_size=knobs.max_queue_size,
    )
    async with batcher:
        yield _SubmitTarget(batcher.submit, batcher.counters, tokens)


@contextlib.asynccontextmanager
async def open_target(
    config: Configuration, texts: Sequence[str], loader: ModelLoader | None = None
) -> AsyncIterator[Target]:
    """Start ``config`` and yield a target sending ``texts`` (cyclically); stop it on exit."""
    if config.kind == "http":
        async with HttpTarget(config.url, texts) as http:
            yield http
        return
    if loader is None:
        raise ValueError(f"configuration {config.name!r} runs in-process and needs a ModelLoader")
    opener = _classic_target if config.kind == "classic" else _knobs_target
    async with opener(loader, config.knobs, texts) as target:
        yield target


# -- HTTP ----------------------------------------------------------------------------------


class HttpError(Exception):
    """A request got a non-200 answer or a broken response."""


def embeddings_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/v1/embeddings``; a full route is kept."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(
            f"--target {url!r}: expected 'inprocess' or an http(s):// URL of a server with "
            "POST /v1/embeddings, e.g. http://127.0.0.1:8000"
        )
    path = parts.path.rstrip("/")
    if not path.endswith("/embeddings"):
        path += "/v1/embeddings"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


class HttpTarget:
    """``POST /v1/embeddings`` with ``{"input": text}``, one text per request, over keep-alive
    HTTP/1.1 connections (opened as needed, at most ``max_connections``).

    A plain ``http://`` URL goes through a small built-in client; ``https://`` through httpx.
    """

    def __init__(self, url: str, texts: Sequence[str], *, max_connections: int = 512) -> None:
        self.url = embeddings_url(url)
        parts = urllib.parse.urlsplit(self.url)
        self._tls = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._tls else 80)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        self._bodies = [json.dumps({"input": t}).encode() for t in texts]
        self._head = (
            f"POST {target} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            "Content-Type: application/json\r\nAccept: application/json\r\n"
        ).encode()
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._httpx: Any = None

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
            if response.status_code != 200:
                raise HttpError(f"HTTP {response.status_code}")
            return
        async with self._slots:
            status = await self._post(body)
        if status != 200:
            raise HttpError(f"HTTP {status}")

    async def _post(self, body: bytes) -> int:
        reused = bool(self._idle)
        conn = self._idle.pop() if reused else await self._connect()
        try:
            status, keep = await self._exchange(conn, body)
        except (ConnectionError, asyncio.IncompleteReadError, HttpError):
            conn.close()
            if not reused:
                raise
            # the server closed an idle keep-alive connection: retry once on a fresh one
            conn = await self._connect()
            try:
                status, keep = await self._exchange(conn, body)
            except BaseException:
                conn.close()
                raise
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
