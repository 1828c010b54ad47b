"""``POST /generate``: one result per prompt, in order (today: each prompt's embedding).

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

import json
import time

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from batchline.server.errors import validation_response
from batchline.server.routes._common import (
    ERRORS,
    Invalid,
    body_doc,
    check_texts,
    embed_texts,
    floats,
    parse_body,
    server_state,
)
from batchline.server.schemas import GenerateRequest, GenerateResponse

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/generate",
    response_model=GenerateResponse,
    responses=ERRORS,
    openapi_extra=body_doc(GenerateRequest),
    summary="One result per prompt, in order",
)
async def generate(request: Request) -> Response:
    """``{"prompts": [...], "task_id": ...}`` to ``{"results": [...]}``: for an embedding
    model each result is the prompt's vector."""
    started = time.perf_counter()
    state = server_state(request)
    try:
        body = await parse_body(request, GenerateRequest)
    except Invalid as exc:
        return validation_response(exc.errors)
    model = state.default_model
    check_texts(body.prompts, state, "prompts")
    m = model.metrics
    m.in_flight.inc()
    try:
        vectors, _ = await embed_texts(state, model, body.prompts)
    finally:
        m.in_flight.dec()
    results = ",".join(floats(v) for v in vectors)
    task = "" if body.task_id is None else f',"task_id":{json.dumps(body.task_id)}'
    m.request_latency("generate").observe(time.perf_counter() - started)
    return Response(f'{{"results":[{results}]{task}}}', media_type="application/json")
