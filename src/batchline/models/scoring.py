"""The ``score`` task's requests and answers, as clients send them: the rerank API (Cohere's and
Jina's shape: one query, many documents, ``top_n``, ``return_documents``) and vLLM's score API
(``text_1`` against ``text_2``). ``batchline serve``'s ``/v1/rerank`` and ``/v1/score`` and the
``/v1/rerank`` and ``/v1/score`` lines of an OpenAI batch file both read and answer through
here, so the two cannot drift. Standard library only.

A score model takes ``{"query", "document"}`` pairs (:func:`pair`) and gives one float each.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "RERANK_URL",
    "SCORE_URL",
    "ScoreAsk",
    "answer",
    "pair",
    "read_rerank",
    "read_score",
]

RERANK_URL = "/v1/rerank"
SCORE_URL = "/v1/score"


def pair(query: str, document: str) -> dict[str, str]:
    """One input of a score model."""
    return {"query": query, "document": document}


@dataclass(frozen=True)
class ScoreAsk:
    """What a rerank or score request asks: its pairs in request order, and how to answer."""

    api: Literal["rerank", "score"]
    pairs: tuple[dict[str, str], ...]
    top_n: int | None = None
    return_documents: bool = True


def read_rerank(body: Mapping[str, object]) -> ScoreAsk:
    """A rerank body: ``query``, ``documents`` (texts or ``{"text"}`` objects), ``top_n`` (at
    least 1), ``return_documents`` (default true). ``ValueError`` naming what is wrong."""
    query = _text(body.get("query"), "query")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise ValueError('"documents" must be a non-empty list of texts or {"text"} objects')
    texts = [
        _text(d.get("text") if isinstance(d, Mapping) else d, f"documents[{i}]")
        for i, d in enumerate(documents)
    ]
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise ValueError(f'"top_n" must be an integer >= 1, got {top_n!r}')
    keep = body.get("return_documents", True)
    if not isinstance(keep, bool):
        raise ValueError(f'"return_documents" must be true or false, got {keep!r}')
    return ScoreAsk("rerank", tuple(pair(query, t) for t in texts), top_n, keep)


def read_score(body: Mapping[str, object]) -> ScoreAsk:
    """A score body: one ``text_1`` against each ``text_2``, or two lists of one length
    paired up. ``ValueError`` naming what is wrong."""
    firsts = _texts(body.get("text_1"), "text_1")
    seconds = _texts(body.get("text_2"), "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise ValueError(
            f'"text_1" has {len(firsts)} texts and "text_2" {len(seconds)}: send one text_1, '
            "or two lists of one length"
        )
    return ScoreAsk("score", tuple(pair(q, d) for q, d in zip(firsts, seconds, strict=True)))


def answer(
    ask: ScoreAsk,
    scores: Sequence[float],
    *,
    model: str,
    tokens: int,
    request_id: str,
    created: int | None = None,
) -> dict[str, object]:
    """The response body: rerank's results best first (ties in request order, cut to
    ``top_n``), or score's data in request order."""
    if len(scores) != len(ask.pairs):
        raise ValueError(f"{len(scores)} scores for {len(ask.pairs)} pairs")
    if ask.api == "score":
        return {
            "id": f"score-{request_id}",
            "object": "list",
            "created": int(time.time()) if created is None else created,
            "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: ask.top_n]
    results: list[dict[str, object]] = []
    for i in ranked:
        result: dict[str, object] = {"index": i, "relevance_score": scores[i]}
        if ask.return_documents:
            result["document"] = {"text": ask.pairs[i]["document"]}
        results.append(result)
    return {
        "id": f"rerank-{request_id}",
        "model": model,
        "results": results,
        "usage": {"total_tokens": tokens},
    }


def _text(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f'"{field}" must be a text, got {type(value).__name__}')
    if not value:
        raise ValueError(f'"{field}" is empty; send a non-empty text')
    return value


def _texts(value: object, field: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise ValueError(f'"{field}" must be a text or a non-empty list of texts')
    return [_text(t, f"{field}[{i}]") for i, t in enumerate(items)]
