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
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from batchline.server.errors import ApiError
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
from batchline.server.schemas import (
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from batchline.server.state import ServedModel

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
    started = time.perf_counter()
    state = server_state(request)
    body = await parse_body(request, RerankRequest)
    model = await use_model(request, state, body.model, "score")
    _check_text(body.query, "query")
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    check_count(len(documents), state, "documents", "documents")
    for i, document in enumerate(documents):
        _check_text(document, f"documents[{i}]")
    pairs = [{"query": body.query, "document": d} for d in documents]
    priority = request_priority(request, state, model.name, body.priority)
    results, tokens = await run_model(state, model, pairs, priority=priority)
    scores = _scores(model, results)
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    items: list[dict[str, Any]] = []
    for i in ranked:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            item["document"] = {"text": documents[i]}
        items.append(item)
    payload = {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model.name,
        "results": items,
        "usage": {"total_tokens": tokens},
    }
    model.metrics.request_latency("rerank").observe(time.perf_counter() - started)
    return _json(payload)


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
    started = time.perf_counter()
    state = server_state(request)
    body = await parse_body(request, ScoreRequest)
    model = await use_model(request, state, body.model, "score")
    firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise ApiError(
            400,
            f"'text_1' has {len(firsts)} texts and 'text_2' {len(seconds)}: send one text_1, "
            "or two lists of one length",
            "invalid_request_error",
        )
    check_count(len(seconds), state, "text_2", "texts")
    for field, texts in (("text_1", firsts), ("text_2", seconds)):
        for i, text in enumerate(texts):
            _check_text(text, f"{field}[{i}]")
    pairs = [{"query": q, "document": d} for q, d in zip(firsts, seconds, strict=True)]
    priority = request_priority(request, state, model.name, body.priority)
    results, tokens = await run_model(state, model, pairs, priority=priority)
    scores = _scores(model, results)
    payload = {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model.name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    model.metrics.request_latency("score").observe(time.perf_counter() - started)
    return _json(payload)


def _check_text(text: str, field: str) -> None:
    if not text:
        raise ApiError(400, f"'{field}' is empty; send a non-empty text", "invalid_request_error")


def _scores(model: ServedModel[Any, Any], results: list[Any]) -> list[float]:
    scores: list[float] = []
    for result in results:
        value = model.model.encode(result)
        if isinstance(value, bool) or not isinstance(value, int | float):
            model.metrics.failed("model")
            raise ApiError(500, f"model {model.name!r} returned no score", "server_error")
        if not math.isfinite(value):
            raise non_finite(model)
        scores.append(float(value))
    return scores


def _json(payload: dict[str, Any]) -> Response:
    return Response(json.dumps(payload, separators=(",", ":")), media_type="application/json")
