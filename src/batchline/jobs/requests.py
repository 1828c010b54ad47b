"""What each record of a generate job asks for: its prompt and how to sample it.

A plain dataset record gives its prompt in one column (text, or chat messages) and takes the
job's sampling settings. The job's ``--response-format`` (JSON text of an OpenAI
``response_format``, ``{"type": "json_schema", "json_schema": {"schema": ...}}`` or
``{"type": "json_object"}``, or of a bare JSON schema) constrains every completion; a record
with a ``response_format``, ``guided_json``, ``guided_regex`` or ``guided_choice`` field of its
own takes that instead. A line of an
OpenAI batch file (``{"custom_id", "method", "url", "body"}``) gives everything in its
``body``, as the OpenAI route named by its ``url`` reads it. Either way a bad record raises
``ValueError`` naming the fault, and fails alone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from batchline.datasets.sources import Format, Record, open_source
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.structured import (
    GUIDED_FIELDS,
    Constraint,
    constraint_from_openai,
)

__all__ = [
    "BATCH_URLS",
    "RecordRequests",
    "is_openai_batch_file",
    "job_constraint",
    "reads_whole_rows",
    "record_constraint",
]

#: Record fields that constrain that record's completion.
CONSTRAINT_FIELDS = ("response_format", *GUIDED_FIELDS)
#: What an OpenAI batch line's ``url`` may name (embeddings need an embedding job).
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


def job_constraint(response_format: str | None) -> Constraint | None:
    """A job's ``--response-format`` (JSON text of an OpenAI ``response_format``, or of a bare
    JSON schema) as a constraint."""
    if response_format is None:
        return None
    try:
        value = json.loads(response_format)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--response-format is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("--response-format must be a JSON object")
    if value.get("type") in ("text", "json_object", "json_schema"):
        return constraint_from_openai({"response_format": value})
    return Constraint.json_schema(value)


@functools.lru_cache(maxsize=256)
def _constraint(fields: str) -> Constraint | None:
    # keyed on the fields' JSON text: a job of one schema checks its grammar once
    return constraint_from_openai(json.loads(fields))


def record_constraint(fields: Mapping[str, Any]) -> Constraint | Literal[False] | None:
    """The constraint a record (or a batch line's body) asks for; False when it names none."""
    asked = {k: fields[k] for k in CONSTRAINT_FIELDS if fields.get(k) is not None}
    if not asked:
        return False
    return _constraint(json.dumps(asked, sort_keys=True))


def reads_whole_rows(path: Path, fmt: Format | None) -> bool:
    """Whether a generate job reads each record whole (any input but plain text), so that any
    record may carry its own constraint fields (a JSONL file's first line does not say whether
    later ones do)."""
    probe = open_source(path, fmt=fmt, input_kind="record", extra_columns=(), on_bad_record="skip")
    return probe.format != "text"


def is_openai_batch_line(value: object) -> bool:
    """Whether a parsed JSONL line looks like an OpenAI batch request."""
    return isinstance(value, dict) and {"custom_id", "url", "body"} <= value.keys()


@dataclasses.dataclass(frozen=True)
class RecordRequests:
    """Reads a generate job's records: ``column`` and ``chat_template`` for plain records,
    ``base`` their sampling; ``openai_batch``: every record is a batch line, whose ``body``
    must name ``model_name``."""

    column: str
    chat_template: bool
    base: SamplingParams
    openai_batch: bool = False
    model_name: str = ""

    def prompt(self, record: Record) -> tuple[str | list[Any], bool]:
        """The record's prompt, and whether it goes through the chat template."""
        if self.openai_batch:
            url, body = self._line(record)
            if url == "/v1/chat/completions":
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise ValueError('a chat line\'s body needs "messages": [{role, content}, ...]')
                return messages, True
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise ValueError('a completions line\'s body needs "prompt": one string')
            return prompt, False
        value = record.value
        prompt = value.get(self.column) if isinstance(value, dict) else record.text
        if not isinstance(prompt, str | list):
            raise ValueError(
                f"prompt {self.column!r} is {type(prompt).__name__}, not text or a list of "
                "chat messages"
            )
        return prompt, self.chat_template

    def params(self, record: Record) -> SamplingParams:
        """The record's sampling parameters (a job seed becomes ``seed + index``)."""
        if self.openai_batch:
            return self._body_params(self._line(record)[1])
        params = self.base
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + record.index)
        if isinstance(record.value, dict):
            constraint = record_constraint(record.value)
            if constraint is not False:
                params = dataclasses.replace(params, constraint=constraint)
        return params

    def _line(self, record: Record) -> tuple[str, Mapping[str, Any]]:
        value = record.value
        if not is_openai_batch_line(value):
            raise ValueError('not an OpenAI batch line: it needs "custom_id", "url" and "body"')
        assert isinstance(value, dict)
        url, body = value["url"], value["body"]
        if url not in BATCH_URLS:
            raise ValueError(f"url {url!r} is not one of {', '.join(BATCH_URLS)}")
        if url == "/v1/embeddings":
            raise ValueError("/v1/embeddings lines are not run by a generate job yet")
        if value.get("method", "POST") != "POST":
            raise ValueError(f"method must be POST, got {value.get('method')!r}")
        if not isinstance(body, dict):
            raise ValueError('"body" must be a JSON object')
        if body.get("model") != self.model_name:
            raise ValueError(
                f"model {body.get('model')!r} is not this job's model {self.model_name!r}; "
                f"run with --model {body.get('model')}=SPEC to serve it under that name"
            )
        return url, body

    def _body_params(self, body: Mapping[str, Any]) -> SamplingParams:
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        stop = body.get("stop")
        if body.get("n", 1) != 1:
            raise ValueError(f"n must be 1, got {body.get('n')!r}")
        for name, value in (("temperature", body.get("temperature")), ("top_p", body.get("top_p"))):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float)
            ):
                raise ValueError(f"{name} must be a number, got {value!r}")
        for name, value in (("max_tokens", max_tokens), ("seed", body.get("seed"))):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if stop is not None and not (
            isinstance(stop, str)
            or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
        ):
            raise ValueError("stop must be a string or a list of strings")
        constraint = record_constraint(body)
        return SamplingParams(
            max_tokens=self.base.max_tokens if max_tokens is None else max_tokens,
            # OpenAI's default temperature is 1
            temperature=1.0 if body.get("temperature") is None else float(body["temperature"]),
            top_p=1.0 if body.get("top_p") is None else float(body["top_p"]),
            seed=body.get("seed"),
            stop=() if stop is None else (stop,) if isinstance(stop, str) else tuple(stop),
            constraint=None if constraint is False else constraint,
        )


def is_openai_batch_file(path: Path, input_format: str | None, *, forced: bool = False) -> bool:
    """Whether ``path`` is read as an OpenAI batch file: ``forced`` (``--format
    openai-batch``), or a JSONL input whose first non-blank line is a batch request. False for a
    missing file (the reader names that error)."""
    if not path.is_file():
        return False
    if forced:
        return True
    if input_format not in (None, "jsonl") or path.suffix.lower() not in (
        ".jsonl",
        ".json",
        ".ndjson",
    ):
        return False
    return is_openai_batch_line(_first_line(path))


def _first_line(path: Path) -> object:
    with path.open("rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    return json.loads(raw.removeprefix(b"\xef\xbb\xbf"))
                except ValueError:
                    return None
    return None
