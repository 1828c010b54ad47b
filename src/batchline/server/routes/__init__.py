"""The HTTP routes, one module per family: ``openai`` (``/v1/embeddings``), ``classify``
(``/classify``), ``oip`` (the Open Inference Protocol, ``/v2/...``), ``generation``
(``/generate``, ``/v1/completions``, ``/v1/chat/completions``), ``ops`` (``/v1/models``,
``/health``, ``/ready``, ``/metrics``), ``scoring`` (``/v1/rerank``, ``/v1/score``), ``tokens``
(``/tokenize``, ``/detokenize``), and the Batch API (``/v1/files``, ``/v1/batches``: its own
package, ``batchline.server.batches``); ``_common`` holds what they share."""

from __future__ import annotations

from fastapi import FastAPI

__all__ = ["include_routes"]


def include_routes(app: FastAPI) -> None:
    """Add every route family to ``app``."""
    from batchline.server.batches import routes as batches
    from batchline.server.routes import classify, generation, oip, openai, ops, scoring, tokens

    for module in (openai, classify, scoring, oip, generation, tokens, ops, batches):
        app.include_router(module.router)
