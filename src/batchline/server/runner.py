"""``serve``: the app under uvicorn, with a drain on SIGTERM and exit code 0.

uvicorn re-raises SIGTERM after its graceful shutdown, so the process would exit -15; this
runner drains first (``/ready`` false, new model requests 503, requests in flight finish)
and then returns 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import socket
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from batchline._errors import BatchlineError, InputError, ModelError
from batchline.server.app import create_app, drain
from batchline.server.settings import ServerSettings
from batchline.server.state import ServerState

__all__ = ["serve"]

logger = logging.getLogger("batchline.server")


def serve(settings: ServerSettings, *, tracer_provider: TracerProvider | None = None) -> int:
    """Run the app with uvicorn until SIGTERM/SIGINT; return 0 after a clean drain.

    The first signal starts a drain: ``/ready`` turns false, new model requests get 503,
    requests in flight finish (up to ``drain_timeout_s``; generations still running then end
    with an error event, see :func:`~batchline.server.app.drain`), then uvicorn shuts down
    and the batchers drain. A second signal stops waiting. uvicorn re-raises the signal after
    its own graceful shutdown, so the process would exit -15; this runner does not.
    ``tracer_provider``: as :func:`~batchline.server.app.create_app`'s. The Batch API's data
    directory is this process's alone while it serves (another server's is refused).
    """
    _check_port(settings.host, settings.port)
    with _own_data_dir(settings) as settings:
        return _serve(settings, tracer_provider)


@contextlib.contextmanager
def _own_data_dir(settings: ServerSettings) -> Iterator[ServerSettings]:
    """``settings`` on a Batch API data directory this process holds (one owner per
    directory: :mod:`batchline.server.data_lock`), held until the server has stopped."""
    from batchline.server.data_lock import hold_data_dir

    root = settings.batch_data_dir
    lock = hold_data_dir(root, explicit=settings.data_dir is not None, port=settings.port)
    with lock:
        if lock.root != root:
            settings = settings.model_copy(update={"data_dir": lock.root})
        yield settings


def _serve(settings: ServerSettings, tracer_provider: TracerProvider | None) -> int:
    import uvicorn

    app = create_app(settings, tracer_provider=tracer_provider)
    startup = _Startup(app)
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["loggers"]["batchline"] = {
        "handlers": ["default"],
        "level": settings.log_level.upper(),
        "propagate": False,
    }
    config = uvicorn.Config(
        startup.app,
        log_config=log_config,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        lifespan="on",
        timeout_graceful_shutdown=max(1, math.ceil(settings.drain_timeout_s)),
        server_header=False,
    )
    startup.hold_log(logging.getLogger("uvicorn.error"))
    server = _DrainingServer(config, app.state.server)
    try:
        server.run()  # uvicorn's loop factory: uvloop and httptools when installed
    except SystemExit:  # uvicorn's exit on a failed start
        if startup.error is not None:
            raise startup.error from None  # the CLI's one line: what to fix, and how
        raise ModelError("the server did not start; see the log above") from None
    if not server.started:
        raise ModelError("the server did not start; see the log above")
    return 0


def _check_port(host: str, port: int) -> None:
    """Refuse a port another process listens on, before the models load (uvicorn would find
    out only after loading them, and exit 1)."""
    import errno

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise InputError(
                    f"port {port} on {host} is in use by another process; "
                    "pick a free one with --port"
                ) from None
            raise InputError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


class _Startup:
    """The app's start, watched so that an error the user can fix (a model not pulled, a
    missing extra, a bad model file) ends ``serve`` in one line, not in uvicorn's traceback.

    Wraps the app's lifespan: an expected error is kept in :attr:`error` and the lifespan
    failure reported to uvicorn carries no traceback text; uvicorn's own log lines are held
    until the models are loaded, then let through (or, after an expected error, dropped).
    """

    def __init__(self, app: FastAPI) -> None:
        self.error: BaseException | None = None
        self._held: list[logging.LogRecord] = []
        self._holding = False
        self._logger: logging.Logger | None = None
        inner = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(a: FastAPI) -> AsyncIterator[Any]:  # starlette's Lifespan union
            started = False
            try:
                async with inner(a) as state:
                    started = True
                    self._release()
                    yield state
            except BaseException as exc:
                if not started and isinstance(exc, BatchlineError | ModuleNotFoundError):
                    self.error = exc
                else:
                    self._release()
                raise

        app.router.lifespan_context = lifespan
        app_call = app.__call__

        async def quiet(scope: Scope, receive: Receive, send: Send) -> None:
            async def send_quietly(message: Message) -> None:
                if message.get("type") == "lifespan.startup.failed" and self.error is not None:
                    message = {"type": "lifespan.startup.failed", "message": ""}
                await send(message)

            wrapped = send_quietly if scope.get("type") == "lifespan" else send
            await app_call(scope, receive, wrapped)

        self.app = quiet

    def hold_log(self, logger: logging.Logger) -> None:
        """Hold ``logger``'s records until the models are loaded."""
        self._logger = logger
        self._holding = True
        logger.addFilter(self._hold)

    def _hold(self, record: logging.LogRecord) -> bool:
        if self._holding:
            self._held.append(record)
            return False
        return True

    def _release(self) -> None:
        self._holding = False
        held, self._held = self._held, []
        if self._logger is not None:
            for record in held:
                self._logger.handle(record)


if TYPE_CHECKING:
    from fastapi import FastAPI
    from opentelemetry.sdk.trace import TracerProvider
    from starlette.types import Message, Receive, Scope, Send
    from uvicorn import Config
    from uvicorn import Server as _ServerBase
else:
    try:
        from uvicorn import Server as _ServerBase
    except ImportError:  # pragma: no cover - the server extra brings uvicorn
        _ServerBase = object


class _DrainingServer(_ServerBase):
    """uvicorn's server with a drain phase before its shutdown, and no re-raised signal."""

    def __init__(self, config: Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._signals = 0

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: object) -> None:
        # Not calling super(): uvicorn would record the signal and raise it again on exit.
        self._signals += 1
        if self._signals > 1 or self._loop is None or not self.started:
            self.should_exit = True
            if self._signals > 2:
                self.force_exit = True
            return
        logger.info("signal %d: draining before shutdown", sig)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        assert self._loop is not None
        _close_after_response(self.server_state.connections)
        self._drain_task = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        await drain(self._state)  # within drain_timeout_s: then what still streams is cut
        self.should_exit = True


def _close_after_response(connections: Iterable[object]) -> None:
    """Have every response in progress close its connection when it ends (``Connection:
    close`` where its headers have not gone yet).

    Otherwise a client whose request finishes during the drain sends its next one on the same
    kept-alive connection at once; when that request is the last of the drain, uvicorn's
    shutdown closes the connection with the request unread, and the client gets a reset, not an
    answer (the soak found it: ``benchmarks/bench_soak.py``). Closed, the client opens a new
    connection instead: a 503 while the drain lasts, refused once the server is gone. Idle
    connections stay open: one used during the drain gets a 503 that closes it.
    """
    for connection in list(connections):
        cycle = getattr(connection, "cycle", None)  # uvicorn's h11 and httptools protocols
        if cycle is not None and not getattr(cycle, "response_complete", True):
            cycle.keep_alive = False
