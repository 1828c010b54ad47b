"""``POST /classify``: a label (and optionally every label's score) per text.

``{"model": "clf", "input": ["a great film", ...], "return_all_scores": false}`` to
``{"results": [{"label": "positive", "score": 0.91}, ...]}``; with ``return_all_scores`` each
result also has ``"scores": {label: score}``. Served by ``classify`` models
(``batchline.models.onnx.classify``), whose result is ``{"label", "score", "scores"}``.

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

import json
import math
from collections.abc import Mapping

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from batchline.server.errors import ApiError
from batchline.server.routes._common import ERRORS, body_doc, non_finite, run_texts
from batchline.server.schemas import ClassifyRequest, ClassifyResponse
from batchline.server.state import ServedModel

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/classify",
    response_model=ClassifyResponse,
    responses=ERRORS,
    openapi_extra=body_doc(ClassifyRequest),
    summary="Classify texts: a label and its score per text",
)
async def classify(request: Request) -> Response:
    """One result per text, in order: ``label`` and ``score``, plus ``scores`` (every label's)
    with ``return_all_scores``."""
    done = await run_texts(request, ClassifyRequest, "classify")
    items = [_result(done.model, r, done.body.return_all_scores) for r in done.results]
    try:
        payload = json.dumps({"results": items}, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise non_finite(done.model) from None
    done.observe_latency("classify")
    return Response(payload, media_type="application/json")


def _result(
    model: ServedModel[object, object], result: object, all_scores: bool
) -> dict[str, object]:
    value = model.model.encode(result)
    if not isinstance(value, Mapping) or "label" not in value or "score" not in value:
        model.metrics.failed("model")
        raise ApiError(500, f"model {model.name!r} returned no label and score", "server_error")
    score = float(value["score"])
    if not math.isfinite(score):
        raise non_finite(model)
    out: dict[str, object] = {"label": str(value["label"]), "score": score}
    if all_scores:
        scores = value.get("scores")
        out["scores"] = (
            {str(k): float(v) for k, v in scores.items()} if isinstance(scores, Mapping) else {}
        )
    return out
