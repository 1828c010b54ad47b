"""The ``score`` task's routes: ``POST /v1/rerank`` (Cohere's and Jina's shape) and
``POST /v1/score`` (vLLM's), each also without the ``/v1`` prefix.

Both turn a request into ``{"query", "document"}`` pairs, run them through the model's one
batcher (pairs from concurrent requests share batches, padded by their token counts like
embeddings), and answer one relevance score per pair. ``/v1/rerank`` ranks the documents best
first and keeps ``top_n``; ``/v1/score`` answers in the request's order.

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

import json
import math
import time
import uuid

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from batchline.models.openai.requests import RerankRequest, ScoreRequest
from batchline.models.scoring import answer, read_rerank, read_score
from batchline.server.errors import ApiError, bad_request
from batchline.server.routes._common import (
    ERRORS,
    body_doc,
    check_count,
    non_finite,
    parse_body,
    request_priority,
    run_model,
    server_state,
    use_model,
)
from batchline.server.schemas import RerankResponse, ScoreResponse
from batchline.server.served import ServedModel

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/v1/rerank",
    response_model=RerankResponse,
    responses=ERRORS,
    openapi_extra=body_doc(RerankRequest),
    summary="Rank documents by relevance to a query (Cohere- and Jina-compatible)",
)
@router.post("/rerank", include_in_schema=False)
async def rerank(request: Request) -> Response:
    """Every document scored against ``query``, best first; ``top_n`` keeps the best n,
    ``return_documents`` (default true) echoes each document's text."""
    return await _answer(request, RerankRequest, "documents")


@router.post(
    "/v1/score",
    response_model=ScoreResponse,
    responses=ERRORS,
    openapi_extra=body_doc(ScoreRequest),
    summary="Score text pairs (vLLM-compatible)",
)
@router.post("/score", include_in_schema=False)
async def score(request: Request) -> Response:
    """One score per pair, in order: one ``text_1`` against each ``text_2``, or the two lists
    paired up when both have the same length."""
    return await _answer(request, ScoreRequest, "text_2")


async def _answer(
    request: Request, schema: type[RerankRequest] | type[ScoreRequest], field: str
) -> Response:
    started = time.perf_counter()
    state = server_state(request)
    body = await parse_body(request, schema)  # types and the OpenAPI document: 422
    model = await use_model(request, state, body.model, "score")
    read = read_rerank if schema is RerankRequest else read_score
    try:
        ask = read(body.model_dump())
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    check_count(len(ask.pairs), state, field, "texts")
    priority = request_priority(request, state, model.name, body.priority)
    results, tokens = await run_model(state, model, ask.pairs, priority=priority)
    payload = answer(
        ask, _scores(model, results), model=model.name, tokens=tokens, request_id=uuid.uuid4().hex
    )
    model.metrics.request_latency(ask.api).observe(time.perf_counter() - started)
    return Response(json.dumps(payload, separators=(",", ":")), media_type="application/json")


def _scores(model: ServedModel[object, object], results: list[object]) -> list[float]:
    scores: list[float] = []
    for result in results:
        value = model.encode(result)
        if isinstance(value, bool) or not isinstance(value, int | float):
            model.metrics.failed("model")
            raise ApiError(500, f"model {model.name!r} returned no score", "server_error")
        if not math.isfinite(value):
            raise non_finite(model)
        scores.append(float(value))
    return scores
