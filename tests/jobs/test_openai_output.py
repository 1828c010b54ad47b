"""The lines of an OpenAI batch job's output file (``batchline.jobs.openai_output``): an answer
in the route's body, an error in OpenAI's shape, and ``answered`` telling them apart from the
line's bytes alone."""

from __future__ import annotations

import json

import openai

from batchline.jobs.openai_output import answered, output_line

REQUEST = {
    "custom_id": "c-1",
    "method": "POST",
    "url": "/v1/embeddings",
    "body": {"input": ["a", "b"], "model": "m", "encoding_format": "float"},
}


def test_an_embedded_row_is_an_answered_line_with_the_routes_body() -> None:
    row = {"embeddings": [[0.5, 0.25], [1.0, 0.0]], "model": "m", "prompt_tokens": 4}
    line = output_line(3, REQUEST, row, None)
    parsed = json.loads(line)
    assert parsed["custom_id"] == "c-1"
    assert parsed["error"] is None
    assert parsed["response"]["status_code"] == 200
    body = openai.types.CreateEmbeddingResponse.model_validate(parsed["response"]["body"])
    assert [d.embedding for d in body.data] == [[0.5, 0.25], [1.0, 0.0]]
    assert body.usage.prompt_tokens == 4
    assert answered((line + "\n").encode())
    # the same line again: ids derive from the line, so a resumed job writes the same bytes
    assert output_line(3, REQUEST, row, None) == line


def test_a_skipped_or_unrun_line_is_an_error_line() -> None:
    skipped = output_line(0, REQUEST, None, {"reason": "bad input: 'input' is empty"})
    unrun = output_line(1, REQUEST, None, None, not_run=("batch_cancelled", "cancelled"))
    for line, code, message in (
        (skipped, "invalid_request", "bad input: 'input' is empty"),
        (unrun, "batch_cancelled", "cancelled"),
    ):
        parsed = json.loads(line)
        assert parsed["response"] is None
        assert parsed["error"] == {"code": code, "message": message}
        assert not answered(line.encode())
