"""The answer to a classification request, for ``POST /classify`` (``/v1/classify``) and the
``/v1/classify`` lines of batch files alike: ``{"results": [{"label", "score"}, ...]}``, each
result with ``top_k`` when the model keeps the k likeliest and ``scores`` (every label's) when
the request asks ``return_all_scores``.

A classifier's result (``batchline.models.onnx.classify``, ``batchline.models.image``) is a
mapping ``{"label", "score", "scores", "top_k"?}``; :func:`classification` makes one answer of
it, or says why it cannot (:class:`NotAClassification`, :class:`NonFiniteScore`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

__all__ = [
    "CLASSIFY_URL",
    "NonFiniteScore",
    "NotAClassification",
    "classification",
    "classify_json",
]

CLASSIFY_URL = "/v1/classify"


class NotAClassification(ValueError):
    """A model's result has no ``label`` and ``score`` (a model error, not the request's)."""


class NonFiniteScore(ValueError):
    """A model's score is NaN or infinite (JSON has no number for it)."""


def classification(value: object, *, all_scores: bool) -> dict[str, object]:
    """One result of a classifier as the answer shows it: ``label`` and ``score``, ``top_k``
    when the model gives it, ``scores`` with ``all_scores``."""
    if not isinstance(value, Mapping) or "label" not in value or "score" not in value:
        raise NotAClassification("the model returned no label and score")
    score = float(value["score"])
    if not math.isfinite(score):
        raise NonFiniteScore("the model returned non-finite values for this request")
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


def classify_json(results: Sequence[Mapping[str, object]]) -> str:
    """The response body, as JSON text; :class:`NonFiniteScore` when a score among
    ``top_k`` or ``scores`` is not finite."""
    try:
        return json.dumps({"results": list(results)}, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise NonFiniteScore("the model returned non-finite values for this request") from None
