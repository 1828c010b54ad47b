"""OpenAI-compatible routes: ``POST /v1/embeddings``.

Request bodies are parsed with pydantic's JSON parser straight from the bytes the gate read,
and responses are written as JSON by hand: both are the hot path of a short request. The
request body schemas still appear in the OpenAPI document.

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

import json
import time

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from batchline.server.errors import ApiError, validation_response
from batchline.server.routes._common import (
    ERRORS,
    Invalid,
    b64,
    body_doc,
    check_texts,
    embed_texts,
    floats,
    parse_body,
    pick_model,
    server_state,
)
from batchline.server.schemas import EmbeddingRequest, EmbeddingResponse

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
    """Embed one text or a list of texts; ``encoding_format`` ``float`` or ``base64``
    (little-endian float32)."""
    started = time.perf_counter()
    state = server_state(request)
    try:
        body = await parse_body(request, EmbeddingRequest)
    except Invalid as exc:
        return validation_response(exc.errors)
    model = pick_model(state, body.model)
    texts = [body.input] if isinstance(body.input, str) else body.input
    check_texts(texts, state, "input")
    if body.dimensions is not None and body.dimensions != model.dim:
        raise ApiError(
            400,
            f"{model.name} returns {model.dim} dimensions; omit 'dimensions' or send {model.dim}",
            "invalid_request_error",
        )
    m = model.metrics
    m.in_flight.inc()
    try:
        vectors, tokens = await embed_texts(state, model, texts)
    finally:
        m.in_flight.dec()
    encode = b64 if body.encoding_format == "base64" else floats
    items = ",".join(
        f'{{"object":"embedding","index":{i},"embedding":{encode(v)}}}'
        for i, v in enumerate(vectors)
    )
    payload = (
        f'{{"object":"list","data":[{items}],"model":{json.dumps(model.name)},'
        f'"usage":{{"prompt_tokens":{tokens},"total_tokens":{tokens}}}}}'
    )
    m.request_latency("embeddings").observe(time.perf_counter() - started)
    return Response(payload, media_type="application/json")
