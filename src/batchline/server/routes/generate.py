"""``POST /generate``: one result per prompt, in order (today: each prompt's embedding, from
the first embed model served; the generation work replaces this route).

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

import json
import time

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from batchline.server.errors import validation_response
from batchline.server.routes._common import (
    ERRORS,
    Invalid,
    all_finite,
    body_doc,
    check_texts,
    floats,
    non_finite,
    parse_body,
    pick_model,
    run_model,
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
    model = pick_model(request, state, None, "embed")
    check_texts(body.prompts, state, "prompts")
    outputs, _ = await run_model(state, model, body.prompts)
    vectors = [np.asarray(model.model.encode(r), dtype=np.float32) for r in outputs]
    if not all_finite(vectors):
        raise non_finite(model)
    results = ",".join(floats(v) for v in vectors)
    task = "" if body.task_id is None else f',"task_id":{json.dumps(body.task_id)}'
    model.metrics.request_latency("generate").observe(time.perf_counter() - started)
    return Response(f'{{"results":[{results}]{task}}}', media_type="application/json")
