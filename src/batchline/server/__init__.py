"""``batchline serve``: models behind shared dynamic batchers (``batchline[server]``).

Every served batch model has one shared batcher (``batchline.models.batching.ModelBatcher``), so
records from concurrent clients share batches; several models share the device's slots.
Every generate model has one shared text generator (continuous batching). Models, batchers
and generators are loaded once per replica, in the app's lifespan.

Example::

    from batchline.server import ServerSettings, create_app, serve

    settings = ServerSettings.from_file("serve.toml", port=9000)
    app = create_app(settings)      # an ASGI app (FastAPI)
    serve(settings)                 # run it with uvicorn; SIGTERM drains, then exits 0

The routes and where a request can end: :mod:`batchline.server.app`. Layout: ``app``
(create_app and the lifespan), ``gate`` (pure-ASGI auth, drain, body, disconnects), ``errors``,
``state`` (server state), ``registry`` (the one registry the routes ask for a model),
``served`` (a served model and a served generator: what a route may use), ``batcher`` (a
batch model's batcher and its metrics hook), ``routes/`` (one module per route
family, the Open Inference Protocol's among them; its codec is :mod:`batchline.oip`),
``metrics`` and ``generation_metrics``, ``residency`` (on-demand models), ``runner``
(uvicorn, SIGTERM drain), ``settings``, ``schemas`` (request and response bodies).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline._lazy import lazy_exports

if TYPE_CHECKING:
    from batchline.server.app import LoadGenerator, LoadModel, create_app
    from batchline.server.errors import ApiError
    from batchline.server.runner import serve
    from batchline.server.served import ServedGenerator, ServedModel
    from batchline.server.settings import API_KEY_ENV, ServerSettings, load_config
    from batchline.server.state import ServerState

__all__ = [
    "API_KEY_ENV",
    "ApiError",
    "LoadGenerator",
    "LoadModel",
    "ServedGenerator",
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
        "LoadGenerator": "app",
        "LoadModel": "app",
        "ServedGenerator": "served",
        "ServedModel": "served",
        "ServerSettings": "settings",
        "ServerState": "state",
        "create_app": "app",
        "load_config": "settings",
        "serve": "runner",
    },
)
