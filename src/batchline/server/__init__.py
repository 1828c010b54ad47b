"""``batchline serve``: embeddings behind one shared dynamic batcher (``batchline[server]``).

Every request feeds the same ``TokenBatcher``, so records from concurrent clients share
batches and the model always has a full queue; the model and the batcher are loaded once per
replica, in the app's lifespan.

Example::

    from batchline.server import ServerSettings, create_app, serve

    settings = ServerSettings.from_file("serve.toml", port=9000)
    app = create_app(settings)      # an ASGI app (FastAPI)
    serve(settings)                 # run it with uvicorn; SIGTERM drains, then exits 0

Routes: ``POST /v1/embeddings`` (OpenAI-compatible), ``POST /generate``, ``GET /v1/models``,
``GET /health``, ``GET /ready``, ``GET /metrics``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline._lazy import lazy_exports

if TYPE_CHECKING:
    from batchline.server.app import create_app
    from batchline.server.errors import ApiError
    from batchline.server.runner import serve
    from batchline.server.settings import API_KEY_ENV, ServerSettings, load_config
    from batchline.server.state import (
        BatchedModel,
        DirectModel,
        EmbeddingModel,
        ServedModel,
        ServerState,
        SoloWideEmbedder,
        load_embedder,
    )

__all__ = [
    "API_KEY_ENV",
    "ApiError",
    "BatchedModel",
    "DirectModel",
    "EmbeddingModel",
    "ServedModel",
    "ServerSettings",
    "ServerState",
    "SoloWideEmbedder",
    "create_app",
    "load_config",
    "load_embedder",
    "serve",
]

# Imported on first use: this package needs its extra only when a name is used.
__getattr__ = lazy_exports(
    __name__,
    {
        "API_KEY_ENV": "settings",
        "ApiError": "errors",
        "BatchedModel": "state",
        "DirectModel": "state",
        "EmbeddingModel": "state",
        "ServedModel": "state",
        "ServerSettings": "settings",
        "ServerState": "state",
        "SoloWideEmbedder": "state",
        "create_app": "app",
        "load_config": "settings",
        "load_embedder": "state",
        "serve": "runner",
    },
)
