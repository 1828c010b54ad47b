"""The lines of an OpenAI batch job's output file (``batchline.jobs.openai_output``): an answer
in the route's body, an error in OpenAI's shape, and ``answered`` telling them apart from the
line's bytes alone."""

from __future__ import annotations

import json
from pathlib import Path

import openai

from batchline.jobs.openai_batch import BatchFiles
from batchline.jobs.openai_output import answered, output_line

REQUEST = {
    "custom_id": "c-1",
    "method": "POST",
    "url": "/v1/embeddings",
    "body": {"input": ["a", "b"], "model": "m", "encoding_format": "float"},
}


def test_an_embedded_row_is_an_answered_line_with_the_routes_body() -> None:
    row = {"embeddings": [[0.5, 0.25], [1.0, 0.0]], "model": "m", "prompt_tokens": 4}
    line = output_line(3, REQUEST, row, None, job="batch_a")
    parsed = json.loads(line)
    assert parsed["custom_id"] == "c-1"
    assert parsed["error"] is None
    assert parsed["response"]["status_code"] == 200
    body = openai.types.CreateEmbeddingResponse.model_validate(parsed["response"]["body"])
    assert [d.embedding for d in body.data] == [[0.5, 0.25], [1.0, 0.0]]
    assert body.usage.prompt_tokens == 4
    assert answered((line + "\n").encode())
    # the same line again: ids derive from the line, so a resumed job writes the same bytes
    assert output_line(3, REQUEST, row, None, job="batch_a") == line


def test_a_skipped_or_unrun_line_is_an_error_line() -> None:
    skipped = output_line(0, REQUEST, None, {"reason": "bad input: 'input' is empty"}, job="b")
    unrun = output_line(1, REQUEST, None, None, not_run=("batch_cancelled", "cancelled"), job="b")
    for line, code, message in (
        (skipped, "invalid_request", "bad input: 'input' is empty"),
        (unrun, "batch_cancelled", "cancelled"),
    ):
        parsed = json.loads(line)
        assert parsed["response"] is None
        assert parsed["error"] == {"code": code, "message": message}
        assert not answered(line.encode())


def test_the_ids_of_a_line_differ_from_batch_to_batch() -> None:
    chat = {**REQUEST, "url": "/v1/chat/completions"}
    row = {"text": "hi", "finish_reason": "stop", "model": "m", "created": 1,
           "prompt_tokens": 1, "completion_tokens": 1}  # fmt: skip
    one, again = (json.loads(output_line(0, chat, row, None, job="batch_a")) for _ in "12")
    other = json.loads(output_line(0, chat, row, None, job="batch_b"))
    assert one == again  # a resumed batch writes the same ids
    for ids in (lambda x: x["id"], lambda x: x["response"]["request_id"],
                lambda x: x["response"]["body"]["id"]):  # fmt: skip
        assert ids(one) != ids(other)


def test_a_run_derives_its_ids_from_its_input_file(tmp_path: Path) -> None:
    """``run`` has no batch id: two files whose first line is the same get other ids, one
    file written twice the same."""
    ids = []
    for name, second in (("a", "x"), ("a", "x"), ("b", "y")):
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        src = folder / "in.jsonl"
        src.write_text(json.dumps(REQUEST) + "\n" + json.dumps({**REQUEST, "custom_id": second}))
        files = BatchFiles(src, folder / "out.jsonl", folder / "out.jsonl.parts")
        files.write_output(not_run=("batch_cancelled", "cancelled"))
        ids.append(json.loads(files.output.read_text().splitlines()[0])["id"])
    assert ids[0] == ids[1] != ids[2]
