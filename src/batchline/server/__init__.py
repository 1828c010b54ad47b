"""``batchline serve``: models behind shared dynamic batchers (``batchline[server]``).

Every served model has one shared batcher (``batchline.models.engine.Engine``), so records
from concurrent clients share batches; several models share the device's slots. Models and
batchers are loaded once per replica, in the app's lifespan.

Example::

    from batchline.server import ServerSettings, create_app, serve

    settings = ServerSettings.from_file("serve.toml", port=9000)
    app = create_app(settings)      # an ASGI app (FastAPI)
    serve(settings)                 # run it with uvicorn; SIGTERM drains, then exits 0

Routes: ``POST /v1/embeddings`` (OpenAI-compatible), ``POST /generate``, ``POST /classify``,
the Open Inference Protocol (``/v2/...``), ``GET /v1/models``, ``GET /health``,
``GET /ready``, ``GET /metrics``.

Layout: ``app`` (create_app and the lifespan), ``gate`` (pure-ASGI auth, drain, body,
disconnects), ``errors``, ``state`` (server state, served models), ``routes/`` (one module per
route family), ``metrics``, ``runner`` (uvicorn, SIGTERM drain), ``settings``, ``schemas``,
``oip`` (the Open Inference Protocol codec).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline._lazy import lazy_exports

if TYPE_CHECKING:
    from batchline.server.app import ModelLoader, create_app
    from batchline.server.errors import ApiError
    from batchline.server.runner import serve
    from batchline.server.settings import API_KEY_ENV, ServerSettings, load_config
    from batchline.server.state import ServedModel, ServerState

__all__ = [
    "API_KEY_ENV",
    "ApiError",
    "ModelLoader",
    "ServedModel",
    "ServerSettings",
    "ServerState",
    "create_app",
    "load_config",
    "serve",
]

# Imported on first use: this package needs its extra only when a name is used.
__getattr__ = lazy_exports(
    __name__,
    {
        "API_KEY_ENV": "settings",
        "ApiError": "errors",
        "ModelLoader": "app",
        "ServedModel": "state",
        "ServerSettings": "settings",
        "ServerState": "state",
        "create_app": "app",
        "load_config": "settings",
        "serve": "runner",
    },
)
