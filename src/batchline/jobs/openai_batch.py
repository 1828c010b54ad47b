"""OpenAI batch files in and out: ``batchline run requests.jsonl`` where each line is
``{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}``.

The job runs as any generate job (its records read by :class:`~.requests.RecordRequests`),
into a chunked output folder beside the output file (``OUTPUT.parts``), so it is resumable
like every job. The output file is then written, whole and atomically, from the committed
chunks: one line per input line, in input order, ``{"id", "custom_id", "response":
{"status_code": 200, "request_id", "body"}, "error": null}``, or ``"response": null`` and
``"error": {"code", "message"}`` for a line that failed (malformed JSON, an unknown url, a bad
body). Its ids derive from the line, and ``created`` is when the completion was made (kept in
the chunk), so a job killed and resumed writes the same file as one that never stopped.

Example::

    batchline run requests.jsonl --model gpt-4o-mini=smollm2 --output results.jsonl
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline.datasets.readers import read_output, read_skipped
from batchline.jobs.requests import is_openai_batch_file

if TYPE_CHECKING:
    from batchline.jobs.options import GenerateOptions, RunOptions

__all__ = ["BatchFiles", "detect_batch"]


def _lines(path: Path) -> list[bytes]:
    """The input's non-blank lines, as the JSONL reader numbers records."""
    out = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.rstrip(b"\r\n")
            if lineno == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")
            if line.strip():
                out.append(line)
    return out


def detect_batch(options: RunOptions) -> BatchFiles | None:
    """The batch files of a job whose input is an OpenAI batch file (``--format openai-batch``,
    or a JSONL input whose first line is a batch request); None for any other job."""
    path = options.input
    if path is None or not is_openai_batch_file(
        path, options.input_format, forced=getattr(options, "openai_batch", False)
    ):
        return None
    output = options.output or Path(f"{path.stem}.output.jsonl")
    return BatchFiles(path, output, output.with_name(output.name + ".parts"))


@dataclasses.dataclass(frozen=True)
class BatchFiles:
    """An OpenAI batch job's input file, output file, and the chunk folder between them."""

    input: Path
    output: Path
    parts: Path

    def job_options(self, options: GenerateOptions) -> GenerateOptions:
        """The generate job that runs the batch: JSONL in, chunks out, a bad line an error."""
        return dataclasses.replace(
            options,
            input_format="jsonl",
            openai_batch=True,
            output=self.parts,
            on_bad_record="skip",
            copy_columns=(),
            prompt_column="body",
        )

    def write_output(self) -> Path:
        """Write the output file from the committed chunks (replacing it whole)."""
        rows = {int(r["index"]): r for r in read_output(self.parts).to_pylist()}
        skipped = {int(s["index"]): s for s in read_skipped(self.parts)}  # type: ignore[call-overload]
        lines = []
        for index, raw in enumerate(_lines(self.input)):
            if index not in rows and index not in skipped:
                continue  # not run (--limit)
            try:
                request: Any = json.loads(raw)
            except ValueError:
                request = None
            if not isinstance(request, dict):
                request = {}
            out = _output_line(index, request, rows.get(index), skipped.get(index))
            lines.append(json.dumps(out, ensure_ascii=False, separators=(",", ":")))
        _write_atomically(self.output, "".join(line + "\n" for line in lines))
        return self.output


def _output_line(
    index: int,
    request: dict[str, Any],
    row: dict[str, Any] | None,
    skipped: dict[str, object] | None,
) -> dict[str, Any]:
    custom_id = request.get("custom_id")
    digest = hashlib.sha256(f"{index}\0{custom_id}".encode()).hexdigest()[:24]
    line: dict[str, Any] = {"id": f"batch_req_{digest}", "custom_id": custom_id}
    if row is None:
        reason = str(skipped["reason"]) if skipped is not None else "not run"
        line["response"] = None
        line["error"] = {"code": "invalid_request", "message": reason}
        return line
    body = request.get("body") or {}
    usage = {
        "prompt_tokens": row["prompt_tokens"],
        "completion_tokens": row["completion_tokens"],
        "total_tokens": row["prompt_tokens"] + row["completion_tokens"],
    }
    common = {"created": row["created"], "model": body.get("model"), "usage": usage}
    choice: dict[str, Any] = {"index": 0, "finish_reason": row["finish_reason"], "logprobs": None}
    if request.get("url") == "/v1/chat/completions":
        choice["message"] = {"role": "assistant", "content": row["text"]}
        response = {"id": f"chatcmpl-{digest}", "object": "chat.completion", **common}
    else:
        choice["text"] = row["text"]
        response = {"id": f"cmpl-{digest}", "object": "text_completion", **common}
    response["choices"] = [choice]
    line["response"] = {"status_code": 200, "request_id": f"req_{digest}", "body": response}
    line["error"] = None
    return line


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
