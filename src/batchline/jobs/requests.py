"""What each record of a generate job asks for: its prompt and how to sample it.

A plain dataset record gives its prompt in one column (text, or chat messages) and takes the
job's sampling settings, but for a ``max_tokens`` field of its own (a whole number >= 1), which
is its answer's limit in place of ``--max-tokens``. The job's ``--response-format`` (JSON text
of an OpenAI ``response_format``, ``{"type": "json_schema", "json_schema": {"schema": ...}}`` or
``{"type": "json_object"}``, or of a bare JSON schema) constrains every completion; a record
with a ``response_format``, ``guided_json``, ``guided_regex`` or ``guided_choice`` field of its
own takes that instead. A line of an
OpenAI batch file (``{"custom_id", "method", "url", "body"}``) gives everything in its
``body``, validated and read by the same :mod:`batchline.models.openai.requests` body as the route
named by its ``url`` (:func:`batch_request`), and its ``body.model`` picks one of the job's
models (:class:`BatchModels`). Either way a bad record raises ``ValueError`` naming the fault,
and fails alone.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, cast

from pydantic import BaseModel

from batchline.datasets.sources import Format, Record, open_source
from batchline.models.generation import Constraint, SamplingParams, constraint_from_openai
from batchline.models.openai.requests import (
    BODY_OF_URL,
    CHAT_URL,
    CLASSIFY_URL,
    COMPLETIONS_URL,
    CONSTRAINT_FIELDS,
    EMBEDDINGS_URL,
    ChatCompletionRequest,
    ClassifyRequest,
    CompletionRequest,
    EmbeddingRequest,
    OpenAISamplingBody,
    read_body,
    texts_of,
)
from batchline.models.scoring import RERANK_URL, SCORE_URL

__all__ = [
    "BATCH_URLS",
    "KIND_OF_URL",
    "BatchModels",
    "Choices",
    "ClassifyLine",
    "EmbeddingLine",
    "RecordRequests",
    "batch_line",
    "batch_request",
    "classify_line",
    "custom_id_error",
    "deterministic",
    "embedding_line",
    "first_duplicate_custom_id",
    "is_openai_batch_file",
    "job_constraint",
    "line_key",
    "reads_whole_rows",
    "record_constraint",
    "record_max_tokens",
]

#: What an OpenAI batch line's ``url`` may name.
BATCH_URLS = tuple(BODY_OF_URL)


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


def record_constraint(fields: Mapping[str, object]) -> Constraint | Literal[False] | None:
    """The constraint a record (or a batch line's body) asks for; False when it names none."""
    asked = {k: fields[k] for k in CONSTRAINT_FIELDS if fields.get(k) is not None}
    if not asked:
        return False
    return _constraint(json.dumps(asked, sort_keys=True))


def record_max_tokens(value: object) -> int:
    """A record's own ``max_tokens`` field, checked: a whole number >= 1 (a float of one, as a
    Parquet column with gaps reads, too); else ``ValueError`` naming it, the record's failure."""
    limit = int(value) if isinstance(value, float) and value.is_integer() else value
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"the record's max_tokens must be a whole number >= 1, got {value!r}")
    return limit


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
    ``base`` their sampling, ``n`` their completions each; ``openai_batch``: every record is
    a chat or completions line of an OpenAI batch file (its model already picked:
    :class:`BatchModels`)."""

    column: str
    chat_template: bool
    base: SamplingParams
    openai_batch: bool = False
    #: completions per plain record (an OpenAI batch line says its own ``n``)
    n: int = 1
    #: with the column found, not named: the columns a record lacking it is read from (a JSONL
    #: file may mix ``prompt`` rows and ``messages`` rows)
    fallbacks: tuple[str, ...] = ()

    def prompt(self, record: Record) -> tuple[str | list[Any], bool]:
        """The record's prompt, and whether it goes through the chat template."""
        if self.openai_batch:
            body = self._line(record)
            if isinstance(body, ChatCompletionRequest):
                return body.chat(), True
            assert isinstance(body, CompletionRequest)
            prompts = body.prompts()
            if len(prompts) != 1:
                raise ValueError(
                    f'a completions line\'s "prompt" is one string, got {len(prompts)}: send '
                    "one line per prompt"
                )
            return prompts[0], False
        value = record.value
        prompt = value.get(self.column) if isinstance(value, dict) else record.text
        if prompt is None and isinstance(value, dict):
            prompt = next((value[c] for c in self.fallbacks if value.get(c) is not None), None)
            if prompt is None:
                looked = ", ".join(repr(c) for c in (self.column, *self.fallbacks))
                raise ValueError(
                    f"no prompt: the record has none of {looked}"
                    + ("" if self.fallbacks else " (named by --prompt-column)")
                )
        if not isinstance(prompt, str | list):
            raise ValueError(
                f"prompt {self.column!r} is {type(prompt).__name__}, not text or a list of "
                "chat messages"
            )
        return prompt, self.chat_template

    def params(self, record: Record) -> SamplingParams:
        """The record's sampling parameters (a job seed becomes ``seed + index``)."""
        if self.openai_batch:
            body = self._line(record)
            constraint = record_constraint(body.constraint_fields())
            return body.sampling(
                max_tokens=self.base.max_tokens,
                constraint=None if constraint is False else constraint,
            )
        params = self.base
        if params.seed is not None:  # its n samples draw from the n seeds after it
            params = dataclasses.replace(params, seed=params.seed + record.index * self.n)
        if isinstance(record.value, dict):
            constraint = record_constraint(record.value)
            if constraint is not False:
                params = dataclasses.replace(params, constraint=constraint)
            limit = record.value.get("max_tokens")
            if limit is not None:
                params = dataclasses.replace(params, max_tokens=record_max_tokens(limit))
        return params

    def _line(self, record: Record) -> OpenAISamplingBody:
        url, body = batch_request(record.value)
        kind = KIND_OF_URL[url]
        if kind != "generate":
            raise ValueError(f"a {url} line goes to the job's {_KINDS[kind][0]}, not a generator")
        assert isinstance(body, OpenAISamplingBody)
        body.check()
        return body

    def choices(self, record: Record) -> Choices | None:
        """What a batch file's line asks beyond one plain completion (``n`` > 1,
        log-probabilities, ``echo``); None for one plain completion (any other record)."""
        if not self.openai_batch:
            logprobs = self.base.logprobs is not None
            if self.n == 1 and not logprobs:
                return None
            return Choices(self.n, False, logprobs, "", listed=True)
        body = self._line(record)
        echo = ""
        if isinstance(body, CompletionRequest) and body.echo:
            echo = body.prompts()[0]
        logprobs = body.logprob_count() is not None
        if body.n == 1 and not logprobs and not echo:
            return None
        return Choices(body.n, isinstance(body, ChatCompletionRequest), logprobs, echo)


@dataclasses.dataclass(frozen=True, slots=True)
class Choices:
    """A record's completions: ``n`` of its prompt (sampled with ``seed + i`` when seeded:
    ``SamplingParams.samples``), with their log-probabilities in the ``chat`` or the
    completions shape, each text after ``echo`` (the prompt, or ""). ``listed``: a dataset
    job's record (``--n``), whose row lists the texts; else an OpenAI batch line's."""

    n: int
    chat: bool
    logprobs: bool
    echo: str
    listed: bool = False


def custom_id_error(value: object) -> str | None:
    """What is wrong with a batch line's ``custom_id`` when it is not a string (``5`` and
    ``"5"`` would both pass, and name two requests alike), else None."""
    if not isinstance(value, dict) or "custom_id" not in value:
        return None
    custom_id = value["custom_id"]
    if isinstance(custom_id, str):
        return None
    shown = json.dumps(custom_id)
    shown = shown if len(shown) <= 40 else shown[:40] + "..."
    return f"custom_id must be a string, got {shown}; quote it"


def batch_line(value: object) -> tuple[str, Mapping[str, object]]:
    """An OpenAI batch line's ``url`` and ``body``; ``ValueError`` saying what is wrong with
    its shape (the body's own fields are read where they are used)."""
    if not is_openai_batch_line(value):
        raise ValueError('not an OpenAI batch line: it needs "custom_id", "url" and "body"')
    assert isinstance(value, dict)
    wrong = custom_id_error(value)
    if wrong is not None:
        raise ValueError(wrong)
    url, body = value["url"], value["body"]
    if url not in BATCH_URLS:
        raise ValueError(f"url {url!r} is not one of {', '.join(BATCH_URLS)}")
    if value.get("method", "POST") != "POST":
        raise ValueError(f"method must be POST, got {value.get('method')!r}")
    if not isinstance(body, dict):
        raise ValueError('"body" must be a JSON object')
    return url, body


def batch_request(value: object) -> tuple[str, BaseModel]:
    """An OpenAI batch line's ``url`` and its ``body`` read as that route reads it
    (:data:`~batchline.models.openai.requests.BODY_OF_URL`); ``ValueError`` naming the fault."""
    url, body = batch_line(value)
    return url, read_body(BODY_OF_URL[url], body)


def deterministic(params: SamplingParams) -> bool:
    """Whether a request's completion does not depend on chance: greedy (temperature 0), or
    sampled from a fixed seed. Only such requests are answered from a duplicate's completion:
    in a job (:func:`~batchline.jobs.generate_cache.request_key`) and in the Ray driver
    (:func:`line_key`)."""
    return params.temperature == 0 or params.seed is not None


def line_key(value: object, base: SamplingParams) -> bytes | None:
    """What identifies a batch line's answer for the Ray driver's dedupe (``run --engine
    ray``, once per job): a 16-byte digest of the line without its ``custom_id``, so two
    lines of one body are answered once. None for a line that is not a batch request (it is
    sent, and fails on its own), and for a chat or completions line whose completion may
    differ from an identical line's: sampled without a seed (the job's own rule,
    :func:`deterministic`; ``base`` the job's sampling, whose
    ``max_tokens`` a line without one takes)."""
    try:
        url, fields = batch_line(value)
        if KIND_OF_URL[url] == "generate":
            body = read_body(BODY_OF_URL[url], fields)
            assert isinstance(body, OpenAISamplingBody)
            if not deterministic(body.sampling(max_tokens=base.max_tokens, constraint=None)):
                return None
    except ValueError:
        return None
    assert isinstance(value, dict)
    line = {k: v for k, v in value.items() if k != "custom_id"}
    try:
        data = json.dumps(line, sort_keys=True, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None
    return hashlib.blake2b(b"l" + data.encode("utf-8", "surrogatepass"), digest_size=16).digest()


#: The kind of model that answers each url's lines, and how messages name it: what it is,
#: a spec to suggest, what it does.
KIND_OF_URL: dict[str, Literal["generate", "embed", "score", "classify"]] = {
    CHAT_URL: "generate",
    COMPLETIONS_URL: "generate",
    EMBEDDINGS_URL: "embed",
    RERANK_URL: "score",
    SCORE_URL: "score",
    CLASSIFY_URL: "classify",
}
_KINDS = {
    "generate": ("generator", "smollm2", "generates text"),
    "embed": ("embedding model", "default", "embeds"),
    "score": ("reranker", "RERANKER_FOLDER/", "scores pairs"),
    "classify": ("classifier", "CLASSIFIER_FOLDER/", "classifies"),
}


@dataclasses.dataclass(frozen=True)
class BatchModels:
    """The names an OpenAI batch job serves its models under: one generator, one embedding
    model, one reranker and one classifier at most. :meth:`pick` is the model a line's
    ``body.model`` names (a line that names none takes the job's model of its kind)."""

    generate: str | None = None
    embed: str | None = None
    score: str | None = None
    classify: str | None = None

    def pick(self, url: str, asked: object) -> str:
        """The name of the model that answers a line at ``url`` whose body names ``asked``
        (its ``model``); ``ValueError`` naming the ``--model`` flag to add when the job has no
        such model."""
        kind = KIND_OF_URL[url]
        model = getattr(self, kind)
        what, example, _ = _KINDS[kind]
        a_what = f"{'an' if what[0] in 'aeiou' else 'a'} {what}"
        if asked is None:
            if model is None:
                raise ValueError(
                    f"this job has no {what} for {url} lines: add --model NAME={example} "
                    'and name it in the body\'s "model"'
                )
            return str(model)
        if not isinstance(asked, str):
            raise ValueError(f'"model" must be a string, got {asked!r}')
        if asked == model:
            return asked
        for other in _KINDS:
            if other != kind and asked == getattr(self, other):
                raise ValueError(f"model {asked!r} {_KINDS[other][2]}; a {url} line needs {a_what}")
        serve_it = f"--model {asked}=SPEC ({a_what}, such as {asked}={example})"
        if model is not None:  # the name to use is the one served, not the spec's
            raise ValueError(
                f"model {asked!r} is not one of this job's models: its {what} is {model!r} "
                f'(name it in "model", or leave "model" out), or add {serve_it} to serve it '
                "under that name"
            )
        raise ValueError(
            f"model {asked!r} is not one of this job's models, which have no {what}; add "
            f"{serve_it} to serve it under that name"
        )


@dataclasses.dataclass(frozen=True)
class EmbeddingLine:
    """What an embeddings line asks for: its texts (or its pictures' bytes), their vectors as
    base64 (little-endian float32) rather than floats, and cut to ``dimensions``
    (renormalized) when it says so."""

    texts: tuple[str, ...]
    base64: bool
    dimensions: int | None = None
    pictures: tuple[bytes, ...] = ()

    @property
    def items(self) -> tuple[str, ...] | tuple[bytes, ...]:
        """What the model is given, one result each: the pictures, else the texts."""
        return self.pictures or self.texts


def embedding_line(body: EmbeddingRequest, dim: int | None, model: str) -> EmbeddingLine:
    """An embeddings line's body as ``POST /v1/embeddings`` reads it, for ``model`` (its
    vectors ``dim`` long): texts, or pictures as data URIs (vLLM's ``messages``, infinity's
    ``"modality": "image"``: ``batchline.models.openai.images``); ``ValueError`` naming what
    is wrong. A batch line's pictures come in the line: URLs are not fetched."""
    texts, pictures = _line_inputs(body.input, body.messages, body.modality)
    as_base64, cut = body.encoding_format == "base64", body.cut(dim, model)
    return EmbeddingLine(texts, as_base64, cut, pictures=pictures)


@dataclasses.dataclass(frozen=True)
class ClassifyLine:
    """What a ``/v1/classify`` line asks for: a label per text (or per picture), with every
    label's score when ``all_scores`` (the body's ``return_all_scores``)."""

    texts: tuple[str, ...]
    all_scores: bool
    pictures: tuple[bytes, ...] = ()

    @property
    def items(self) -> tuple[str, ...] | tuple[bytes, ...]:
        """What the model is given, one result each: the pictures, else the texts."""
        return self.pictures or self.texts


def classify_line(body: ClassifyRequest) -> ClassifyLine:
    """A ``/v1/classify`` line's body as ``POST /v1/classify`` reads it: texts, or pictures
    as data URIs (as for :func:`embedding_line`); ``ValueError`` naming what is wrong."""
    texts, pictures = _line_inputs(body.input, body.messages, body.modality)
    return ClassifyLine(texts, body.return_all_scores, pictures)


def _line_inputs(
    input: str | list[str] | None, messages: Any, modality: str
) -> tuple[tuple[str, ...], tuple[bytes, ...]]:
    """A line's texts (checked as the routes check them), or its pictures' bytes."""
    from batchline.models.openai.images import DEFAULT_MAX_IMAGE_BYTES, request_inputs

    kind, inputs = request_inputs(input, messages, modality, max_bytes=DEFAULT_MAX_IMAGE_BYTES)
    if kind == "text":
        return tuple(texts_of(cast(list[str], inputs), "input")), ()
    pictures = [getattr(p, "data", None) for p in inputs]
    if not pictures or any(p is None for p in pictures):
        raise ValueError(
            "a batch line's images come in the line, as data URIs (data:image/...;base64,...); "
            "URLs are not fetched"
        )
    return (), tuple(cast(list[bytes], pictures))


def is_openai_batch_file(
    path: Path | None, input_format: str | None, *, forced: bool = False
) -> bool:
    """Whether ``path`` is read as an OpenAI batch file: ``forced`` (``--format
    openai-batch``), or a JSONL input whose first non-blank line is a batch request. False for
    no input (the demo's) or a missing file (the reader names that error)."""
    if path is None or not path.is_file():
        return False
    if forced:
        return True
    jsonl_name = path.suffix.lower() in (".jsonl", ".json", ".ndjson")
    if input_format not in (None, "jsonl") or not jsonl_name:
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


def first_duplicate_custom_id(
    lines: Iterable[tuple[int, object]],
) -> tuple[str, int, int] | None:
    """The first ``custom_id`` that two lines of a batch file share, as ``(custom_id, first
    line number, second line number)``; ``None`` when every id is unique. ``lines`` are
    ``(line number, parsed line)``; a line that is not a batch request, or whose id is not a
    string, is skipped (its own error says why). OpenAI refuses such a file whole."""
    seen: dict[str, int] = {}
    for number, value in lines:
        custom_id = value.get("custom_id") if isinstance(value, dict) else None
        if not isinstance(custom_id, str):
            continue
        first = seen.setdefault(custom_id, number)
        if first != number:
            return custom_id, first, number
    return None
