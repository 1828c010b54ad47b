"""``POST /classify`` (and ``/v1/classify``): a label (and optionally every label's score) per
text, or per picture for an image model (:mod:`batchline.server.routes._inputs`).

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
from batchline.server.routes._common import ERRORS, body_doc, non_finite
from batchline.server.routes._inputs import run_inputs
from batchline.server.schemas import ClassifyRequest, ClassifyResponse
from batchline.server.state import ServedModel

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/classify",
    response_model=ClassifyResponse,
    responses=ERRORS,
    openapi_extra=body_doc(ClassifyRequest),
    summary="Classify texts or images: a label and its score per input",
)
@router.post(
    "/v1/classify",
    response_model=ClassifyResponse,
    responses=ERRORS,
    openapi_extra=body_doc(ClassifyRequest),
    summary="Classify texts or images (the same as POST /classify)",
)
async def classify(request: Request) -> Response:
    """One result per input, in order: ``label`` and ``score``, plus ``scores`` (every
    label's) with ``return_all_scores``, and ``top_k`` when the model keeps the k likeliest.
    An image classifier (or a zero-shot CLIP/SigLIP with labels) takes pictures as
    ``/v1/embeddings`` does: ``messages`` with ``image_url`` parts, or data URIs in ``input``
    with ``"modality": "image"``."""
    done = await run_inputs(request, ClassifyRequest, "classify")
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
    top_k = value.get("top_k")
    if isinstance(top_k, list):
        out["top_k"] = [
            {"label": str(t["label"]), "score": float(t["score"])}
            for t in top_k
            if isinstance(t, Mapping)
        ]
    if all_scores:
        scores = value.get("scores")
        out["scores"] = (
            {str(k): float(v) for k, v in scores.items()} if isinstance(scores, Mapping) else {}
        )
    return out
