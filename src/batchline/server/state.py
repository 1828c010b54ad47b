"""The server's state (``app.state.server``): its settings, metrics, the one
:class:`~batchline.server.registry.ModelRegistry` of its models, and its lifecycle (ready,
draining, the requests in flight that a drain waits for)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from starlette.requests import Request

from batchline._tracing import Tracing
from batchline.server.metrics import ServerMetrics
from batchline.server.registry import ModelRegistry
from batchline.server.settings import ServerSettings

__all__ = ["ServerState", "server_state"]

logger = logging.getLogger("batchline.server")


#: What a model's requests carry, by its ``input_kind`` (any other, or several: "inputs").
_INPUTS = {"text": "texts", "record": "texts", "image": "pictures"}


@dataclass
class ServerState:
    """What the app knows about itself; ``app.state.server``."""

    settings: ServerSettings
    metrics: ServerMetrics
    ready: bool = False
    draining: bool = False
    in_flight: int = 0
    api_key: bytes | None = None
    tracing: Tracing | None = None
    """The tracer when ``OTEL_*`` asks for traces (:mod:`batchline.server.tracing`)."""
    batches: object = None
    """The Batch API's :class:`batchline.server.batches.runner.BatchService` (``None``
    until the app has started it)."""
    registry: ModelRegistry = field(init=False)
    """The models it serves (:class:`~batchline.server.registry.ModelRegistry`)."""
    body_limit: int = field(init=False)
    """The largest request body served (413 beyond): ``ServerSettings.body_limit``, set again
    once the registry knows whether a model takes pictures."""
    body_advice: str = ""
    """The 413's advice for a body over :attr:`body_limit`."""
    _idle: asyncio.Event | None = None

    def __post_init__(self) -> None:
        self.registry = ModelRegistry(self.settings)
        self.body_limit = self.settings.body_limit(pictures=False)
        self.body_advice = _body_advice("texts", follows_pictures=False)

    def limit_bodies(self) -> None:
        """Set :attr:`body_limit` for the models the registry serves (after it opens)."""
        kinds = set(self.registry.input_kinds().values())
        pictures = "image" in kinds
        self.body_limit = self.settings.body_limit(pictures=pictures)
        words = {_INPUTS.get(kind or "", "inputs") for kind in kinds}
        follows = pictures and self.settings.max_body_bytes is None
        self.body_advice = _body_advice(
            words.pop() if len(words) == 1 else "inputs", follows_pictures=follows
        )

    def begin_drain(self) -> None:
        """Stop taking work: ``/ready`` turns false, new model requests get 503."""
        if not self.draining:
            logger.info("draining: %d request(s) in flight", self.in_flight)
        self.draining = True
        self.ready = False

    async def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait until no request is in flight (at most ``timeout_s``); True if idle."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            logger.warning(
                "drain timed out after %ss with %d request(s) in flight", timeout_s, self.in_flight
            )
            return False
        return True

    def _enter(self) -> None:
        self.in_flight += 1

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()


def _body_advice(inputs: str, *, follows_pictures: bool) -> str:
    """What to do about a body over the limit: send less, or raise the setting it comes from
    (``max_image_bytes`` where the limit makes room for one such picture)."""
    if follows_pictures:
        return (
            f"send fewer or smaller {inputs} per request; for larger pictures raise "
            "--max-image-bytes (the limit makes room for one such picture), or set the limit "
            "with --set max_body_bytes=SIZE"
        )
    return (
        f"send fewer or smaller {inputs} per request, or raise the limit with --set "
        "max_body_bytes=SIZE"
    )


def server_state(request: Request) -> ServerState:
    """The state of the app a request came to."""
    state: ServerState = request.app.state.server
    return state
