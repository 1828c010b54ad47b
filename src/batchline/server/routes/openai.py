"""OpenAI-compatible routes: ``POST /v1/embeddings`` (texts, or pictures for an image model).

Request bodies are parsed with pydantic's JSON parser straight from the bytes the gate read,
and responses are written as JSON by hand: both are the hot path of a short request. The
request body schemas still appear in the OpenAPI document.

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from batchline.models.openai.embeddings import EmbeddingResponse, embeddings_json
from batchline.models.openai.requests import EmbeddingRequest
from batchline.models.vectors import shorten
from batchline.server.errors import bad_request
from batchline.server.routes._common import (
    ERRORS,
    all_finite,
    body_doc,
    non_finite,
)
from batchline.server.routes._inputs import run_inputs
from batchline.server.served import ServedModel

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/v1/embeddings",
    response_model=EmbeddingResponse,
    responses=ERRORS,
    openapi_extra=body_doc(EmbeddingRequest),
    summary="Create embeddings (OpenAI-compatible)",
)
async def create_embeddings(request: Request) -> Response:
    """Embed one text or a list of texts, or pictures on an image model (vLLM's ``messages``
    with ``image_url`` parts, one vector per conversation; infinity's ``input`` of data URIs
    with ``"modality": "image"``); ``encoding_format`` ``float`` or ``base64`` (little-endian
    float32); ``dimensions`` keeps the first n of each vector, renormalized (Matryoshka
    truncation: meaningful for models trained for it)."""
    done = await run_inputs(request, EmbeddingRequest, "embed", _check_dimensions)
    model, tokens = done.model, done.tokens
    vectors = [np.asarray(model.encode(r), dtype=np.float32) for r in done.results]
    if not all_finite(vectors):
        raise non_finite(model)
    cut = done.body.cut(model.info.details.get("dim"), model.name)
    if cut is not None:
        vectors = [shorten(v, cut) for v in vectors]
    payload = embeddings_json(
        vectors,
        model=model.name,
        tokens=tokens,
        as_base64=done.body.encoding_format == "base64",
    )
    done.observe_latency("embeddings")
    return Response(payload, media_type="application/json")


def _check_dimensions(body: EmbeddingRequest, model: ServedModel[object, object]) -> None:
    try:
        body.cut(model.info.details.get("dim"), model.name)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
