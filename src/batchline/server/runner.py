"""``serve``: the app under uvicorn, with a drain on SIGTERM and exit code 0.

uvicorn re-raises SIGTERM after its graceful shutdown, so the process would exit -15; this
runner drains first (``/ready`` false, new model requests 503, requests in flight finish)
and then returns 0.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
from typing import Any

from batchline._errors import ModelError
from batchline.server.app import create_app, drain
from batchline.server.settings import ServerSettings
from batchline.server.state import ServerState

__all__ = ["serve"]

logger = logging.getLogger("batchline.server")


def serve(settings: ServerSettings) -> int:
    """Run the app with uvicorn until SIGTERM/SIGINT; return 0 after a clean drain.

    The first signal starts a drain: ``/ready`` turns false, new model requests get 503,
    requests in flight finish (up to ``drain_timeout_s``; generations still running then end
    with an error event, see :func:`~batchline.server.app.drain`), then uvicorn shuts down
    and the batchers drain. A second signal stops waiting. uvicorn re-raises the signal after
    its own graceful shutdown, so the process would exit -15; this runner does not.
    """
    import uvicorn

    app = create_app(settings)
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["loggers"]["batchline"] = {
        "handlers": ["default"],
        "level": settings.log_level.upper(),
        "propagate": False,
    }
    config = uvicorn.Config(
        app,
        log_config=log_config,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        lifespan="on",
        timeout_graceful_shutdown=max(1, math.ceil(settings.drain_timeout_s)),
        server_header=False,
    )
    server = _DrainingServer(config, app.state.server)
    server.run()  # uvicorn's loop factory: uvloop and httptools when installed
    if not server.started:
        raise ModelError("the server did not start; see the log above")
    return 0


try:
    import uvicorn as _uvicorn

    _ServerBase: Any = _uvicorn.Server
except ImportError:  # pragma: no cover - the server extra brings uvicorn
    _ServerBase = object


class _DrainingServer(_ServerBase):  # type: ignore[misc]
    """uvicorn's server with a drain phase before its shutdown, and no re-raised signal."""

    def __init__(self, config: Any, state: ServerState) -> None:
        super().__init__(config)
        self._state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._signals = 0

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
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
        self._drain_task = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        await drain(self._state)  # within drain_timeout_s: then what still streams is cut
        self.should_exit = True
