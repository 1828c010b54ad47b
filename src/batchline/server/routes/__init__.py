"""The HTTP routes, one module per family: ``openai`` (``/v1/embeddings``), ``generate``
(``/generate``), ``ops`` (``/v1/models``, ``/health``, ``/ready``, ``/metrics``)."""

from __future__ import annotations

from fastapi import FastAPI

__all__ = ["include_routes"]


def include_routes(app: FastAPI) -> None:
    """Add every route family to ``app``."""
    from batchline.server.routes import generate, openai, ops

    for module in (openai, generate, ops):
        app.include_router(module.router)
