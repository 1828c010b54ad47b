"""The lines of an OpenAI batch job's output file: each input line's answer, in the body the
OpenAI route would return, or its error (``batchline.jobs.openai_batch`` writes the file from
the job's committed chunks; the Batch API splits it into output and error files)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from batchline.models.openai.completions import Choice, completion_response
from batchline.models.openai.embeddings import embeddings_json
from batchline.models.openai.requests import CLASSIFY_URL, EMBEDDINGS_URL
from batchline.models.scoring import RERANK_URL, SCORE_URL, answer, read_rerank, read_score

__all__ = ["answered", "output_line"]


def output_line(
    index: int,
    request: dict[str, Any],
    row: dict[str, Any] | None,
    skipped: dict[str, object] | None,
    not_run: tuple[str, str] | None = None,
    *,
    job: str,
) -> str:
    """One line of the output file (JSON text; its ``error`` comes last).

    Its ids (``batch_req_...``, the response's ``request_id``, a completion's ``id``) derive
    from ``job`` (what tells this batch from another: the Batch API's batch id, or the input
    file's fingerprint for ``run``), the line's index and its ``custom_id``: the same in a
    resumed batch, another in another batch."""
    custom_id = request.get("custom_id")
    digest = hashlib.sha256(f"{job}\0{index}\0{custom_id}".encode()).hexdigest()[:24]
    line: dict[str, object] = {"id": f"batch_req_{digest}", "custom_id": custom_id}
    if row is None:
        code, reason = "invalid_request", "not run"
        if skipped is not None:
            reason = str(skipped["reason"])
        elif not_run is not None:
            code, reason = not_run
        line["response"] = None
        line["error"] = {"code": code, "message": reason}
        return _dumps(line)
    body = request.get("body") or {}
    url = request.get("url")
    response: dict[str, object] | str
    if url == EMBEDDINGS_URL:
        response = _embeddings_body(row, as_base64=body.get("encoding_format") == "base64")
    elif url == CLASSIFY_URL:  # the route's answer, its results already JSON text
        response = f'{{"results":{row["classifications"]}}}'
    elif url in (RERANK_URL, SCORE_URL):
        ask = read_rerank(body) if url == RERANK_URL else read_score(body)
        response = answer(
            ask, row["scores"], model=row["model"], tokens=row["prompt_tokens"],
            request_id=digest, created=row["created"],
        )  # fmt: skip
    else:
        response = _completion_body(row, digest, chat=url == "/v1/chat/completions")
    if isinstance(response, str):  # JSON text already
        head = _dumps({**line, "response": {"status_code": 200, "request_id": f"req_{digest}"}})
        return head[:-2] + f',"body":{response}}},"error":null}}'
    line["response"] = {"status_code": 200, "request_id": f"req_{digest}", "body": response}
    line["error"] = None
    return _dumps(line)


#: How an answered line of an output file ends: its ``error`` comes last (:func:`output_line`).
_ANSWERED = b',"error":null}'


def answered(line: bytes) -> bool:
    """Whether a line of an output file this module wrote is an answer, not an error, told
    without parsing the line (its vectors) whole."""
    return line.rstrip(b"\n").endswith(_ANSWERED)


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _completion_body(row: dict[str, Any], digest: str, *, chat: bool) -> dict[str, object]:
    """OpenAI's ChatCompletion (``chat``) or Completion of a generated row: its one choice,
    or those its ``choices`` column holds (``n``, log-probabilities, ``echo``:
    :mod:`~batchline.jobs.generate_choices`)."""
    held = row.get("choices")
    choices = (
        [Choice(c["text"], c["finish_reason"], c["logprobs"]) for c in json.loads(held)]
        if held
        else [Choice(row["text"], row["finish_reason"])]
    )
    return completion_response(
        id=f"{'chatcmpl' if chat else 'cmpl'}-{digest}",
        created=row["created"],
        model=row["model"],
        chat=chat,
        choices=choices,
        prompt_tokens=row["prompt_tokens"],
        completion_tokens=row["completion_tokens"],
    )


def _embeddings_body(row: dict[str, Any], *, as_base64: bool) -> str:
    """OpenAI's CreateEmbeddingResponse of an embedded row, as JSON text."""
    vectors = [np.asarray(v, dtype=np.float32) for v in row["embeddings"]]
    return embeddings_json(
        vectors, model=row["model"], tokens=row["prompt_tokens"], as_base64=as_base64
    )
