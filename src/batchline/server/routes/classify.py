"""``POST /classify`` (and ``/v1/classify``): a label (and optionally every label's score) per
text, or per picture for an image model (:mod:`batchline.server.routes._inputs`).

``{"model": "clf", "input": ["a great film", ...], "return_all_scores": false}`` to
``{"results": [{"label": "positive", "score": 0.91}, ...]}``; with ``return_all_scores`` each
result also has ``"scores": {label: score}``. Served by ``classify`` models
(``batchline.models.onnx.classify``), whose result is ``{"label", "score", "scores"}``;
the answer is written by :mod:`batchline.models.openai.classify`, as for a batch file's
``/v1/classify`` lines.

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from batchline.models.openai.classify import (
    NonFiniteScore,
    NotAClassification,
    classification,
    classify_json,
)
from batchline.models.openai.requests import ClassifyRequest
from batchline.server.errors import ApiError
from batchline.server.routes._common import ERRORS, body_doc, non_finite
from batchline.server.routes._inputs import run_inputs
from batchline.server.schemas import ClassifyResponse

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
    model = done.model
    try:
        items = [
            classification(model.encode(r), all_scores=done.body.return_all_scores)
            for r in done.results
        ]
        payload = classify_json(items)
    except NonFiniteScore:
        raise non_finite(model) from None
    except NotAClassification:
        model.metrics.failed("model")
        raise ApiError(
            500, f"model {model.name!r} returned no label and score", "server_error"
        ) from None
    done.observe_latency("classify")
    return Response(payload, media_type="application/json")
