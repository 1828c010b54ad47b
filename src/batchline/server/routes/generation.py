"""Text generation over HTTP: ``POST /generate``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (OpenAI-compatible, streaming or not).

Every prompt of every request is submitted to the model's ONE shared
:class:`~batchline.models.generation.stream.TextGenerator`, so sequences from concurrent
clients share the engine's steps (continuous batching). A request is admitted whole or not
at all: if the waiting queue cannot take all of its prompts, the ones already admitted are
aborted and the answer is 429 + ``Retry-After``.

What the app provides (read from ``request.app.state``):

- ``generators``: ``Mapping[str, ServedGenerator]``, the generate models by name (required);
- ``models``: the app's other models (anything with a ``task``), only to answer a request
  that names one of them with 400 naming its task (optional);
- ``generation_metrics``: a :class:`~batchline.server.generation_metrics.GenerationMetrics`
  that each finished request is observed on (optional);
- ``generation_limits``: a :class:`GenerationLimits` (optional; by default built from
  ``app.state.settings``, a ``ServerSettings``, or the defaults).

Where a request can end:

==========================  ===========================================================
200                          every prompt finished (``stop``: EOS or a stop string;
                             ``length``: ``max_tokens``)
400                          prompt tokens + ``max_tokens`` over the model's context (the
                             message gives the counts and the limit), unsupported
                             parameters (``n`` > 1, ``echo``, ``logprobs``...), empty
                             prompts, a model of another task
404                          unknown model (the message lists the served ones)
413                          more prompts than ``max_prompts_per_request``
422                          wrong types or out-of-range values (never echoes the input)
429 + ``Retry-After``        the generator's waiting queue cannot take every prompt
503 + ``Retry-After``        the generator is stopping
504                          ``request_timeout_s`` elapsed: its sequences were aborted
(no response)                the client disconnected: its sequences were aborted
==========================  ===========================================================

An aborted sequence leaves the engine before its next step, so its slot and KV reservation
go to waiting requests at once. A stream (``"stream": true``) is sent as server-sent events
in OpenAI's chunk shape, ends with ``data: [DONE]``, and stops generating as soon as the
client goes away; an error after the first byte is sent as one ``data: {"error": ...}``
event (what OpenAI's clients raise), then ``[DONE]``.

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, TypeVar

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from batchline._errors import (
    BatcherClosedError,
    InputError,
    QueueFullError,
    RecordTooLargeError,
)
from batchline.models.generation.engine import FinishReason, SamplingParams
from batchline.models.generation.stream import (
    Completion,
    GenerationDelta,
    GenerationStream,
    TextGenerator,
    check_fits,
)
from batchline.server.errors import ApiError, shutting_down
from batchline.server.generation_metrics import GenerationMetrics
from batchline.server.routes._common import ERRORS, ROUTE_OF_TASK, body_doc, parse_body

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "GenerateTextRequest",
    "GenerationLimits",
    "ServedGenerator",
    "router",
]

logger = logging.getLogger("batchline.server")

router = APIRouter()

T = TypeVar("T")

#: OpenAI's documented default for ``/v1/completions``.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: ``/v1/chat/completions`` and ``/generate`` without ``max_tokens``: this many, or what is
#: left of the context if less. (Not "the whole context", as some servers do: the scheduler
#: reserves ``prompt + max_tokens`` KV positions per sequence, so a huge default would
#: admit far fewer sequences at once.)
DEFAULT_MAX_TOKENS = 256
_MAX_STOPS = 16


class ServedGenerator(Protocol):
    """What the generation routes need of one served generate model.

    Example (a test's, on the fake engine)::

        @dataclass(frozen=True)
        class Served:
            name: str
            generator: TextGenerator
            tokenizer: FakeTokenizer

            @property
            def max_context_tokens(self) -> int:
                return self.generator.max_context_tokens

            def encode_prompt(self, text: str) -> list[int]:
                return self.tokenizer.encode(text)

            def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
                text = "".join(f"<{m['role']}>{m['content']}\\n" for m in messages)
                return self.tokenizer.encode(text + "<assistant>")
    """

    @property
    def name(self) -> str:
        """The id clients send as ``model``."""
        ...

    @property
    def generator(self) -> TextGenerator:
        """The model's one shared generator (started by the app's lifespan)."""
        ...

    @property
    def max_context_tokens(self) -> int:
        """The longest prompt + generated sequence the model takes."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt's token ids (with whatever special tokens the model expects)."""
        ...

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """``[{"role", "content"}, ...]`` through the model's chat template, ending with the
        opening of the assistant's turn (``add_generation_prompt=True``). Raises
        ``ValueError`` (or ``InputError``) when the model cannot take them: 400."""
        ...


@dataclass(frozen=True, slots=True)
class GenerationLimits:
    """The routes' limits (default: from ``app.state.settings``, see :meth:`from_settings`)."""

    request_timeout_s: float = 30.0
    """A request (streaming too) not done by then is aborted: 504, or an error event."""
    retry_after_s: int = 1
    """``Retry-After`` of a 429 or 503."""
    max_prompts_per_request: int = 2048
    """More prompts in one request: 413."""
    encode_inline_max_chars: int = 1024
    """Prompts up to this many characters are tokenized on the event loop; longer ones in a
    worker thread (the hop costs more than tokenizing a short text)."""

    @classmethod
    def from_settings(cls, settings: object) -> "GenerationLimits":
        """From a ``ServerSettings`` (or anything with some of its field names)."""
        default = cls()
        return cls(
            request_timeout_s=float(
                getattr(settings, "request_timeout_s", default.request_timeout_s)
            ),
            retry_after_s=int(getattr(settings, "retry_after_s", default.retry_after_s)),
            max_prompts_per_request=int(
                getattr(settings, "max_inputs_per_request", default.max_prompts_per_request)
            ),
            encode_inline_max_chars=int(
                getattr(settings, "tokenize_inline_max_chars", default.encode_inline_max_chars)
            ),
        )


# -- request bodies ---------------------------------------------------------------------------

Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False, strict=True)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False, strict=True)]
MaxTokens = Annotated[int, Field(ge=1, strict=True)]
# int64, as OpenAI's API takes; torch's generators refuse seeds outside 64 bits
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1, strict=True)]
Stop = StrictStr | Annotated[list[StrictStr], Field(max_length=_MAX_STOPS)]


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    # vLLM's extension (its server takes it too): generate max_tokens even past the EOS token
    ignore_eos: StrictBool = False


class GenerateTextRequest(_Sampling):
    """``POST /generate``: one generated text per prompt, in order (greedy by default)."""

    prompts: list[StrictStr]
    task_id: StrictStr | StrictInt | None = None


class GenerateTextResponse(BaseModel):
    results: list[str]
    task_id: str | int | None = None
    model: str


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class _OpenAISampling(_Sampling):
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logprobs: StrictBool | StrictInt | None = None
    user: StrictStr | None = None


class CompletionRequest(_OpenAISampling):
    """``POST /v1/completions``, OpenAI-compatible: one text prompt or a list of them."""

    prompt: StrictStr | list[StrictStr]
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_OpenAISampling):
    """``POST /v1/chat/completions``, OpenAI-compatible: messages through the model's chat
    template. ``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""

    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None
    tools: list[Any] | None = None


# -- routes -----------------------------------------------------------------------------------


@router.post(
    "/generate",
    response_model=GenerateTextResponse,
    responses=ERRORS,
    openapi_extra=body_doc(GenerateTextRequest),
    summary="One generated text per prompt, in order",
)
async def generate(request: Request) -> Response:
    """``{"prompts": [...], "task_id": ...}`` to ``{"results": [...], "task_id", "model"}``:
    each prompt is a raw prompt (no chat template); greedy unless ``temperature`` is given."""
    body = await parse_body(request, GenerateTextRequest)
    served = pick_generator(request, body.model)
    limits = generation_limits(request)
    _check_count(len(body.prompts), limits, "prompts")
    prompts = [
        await _encode_text(served, limits, text, "prompts", i)
        for i, text in enumerate(body.prompts)
    ]
    params = _sampling(served, body, prompts, default_max_tokens=DEFAULT_MAX_TOKENS, greedy=True)
    streams = _submit_all(served, prompts, params, limits, f"gen-{uuid.uuid4().hex}")
    completions = await _finish_all(request, served, streams, limits)
    return JSONResponse(
        {
            "results": [c.text for c in completions],
            "task_id": body.task_id,
            "model": served.name,
        }
    )


@router.post(
    "/v1/completions",
    responses=ERRORS,
    openapi_extra=body_doc(CompletionRequest),
    summary="Create completions (OpenAI-compatible; stream: true for server-sent events)",
)
async def create_completion(request: Request) -> Response:
    """One choice per prompt (``n`` is 1), with ``usage`` over all of them."""
    body = await parse_body(request, CompletionRequest)
    served = pick_generator(request, body.model)
    _check_openai(body)
    if body.echo:
        raise _bad("'echo' is not supported; send echo=false")
    if body.best_of not in (None, 1):
        raise _bad("'best_of' is not supported; send best_of=1 or omit it")
    if body.suffix:
        raise _bad("'suffix' is not supported; omit it")
    limits = generation_limits(request)
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    _check_count(len(texts), limits, "prompt")
    prompts = [
        await _encode_text(served, limits, text, "prompt", i) for i, text in enumerate(texts)
    ]
    params = _sampling(served, body, prompts, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = _submit_all(served, prompts, params, limits, rid)
    shape = _Shape(rid, "text_completion", int(time.time()), served.name, chat=False)
    if body.stream:
        return _event_stream(request, served, streams, shape, limits, body)
    completions = await _finish_all(request, served, streams, limits)
    choices = [
        {"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
        for i, c in enumerate(completions)
    ]
    return JSONResponse({**shape.head(), "choices": choices, "usage": _usage(completions)})


@router.post(
    "/v1/chat/completions",
    responses=ERRORS,
    openapi_extra=body_doc(ChatCompletionRequest),
    summary="Create a chat completion (OpenAI-compatible; stream: true for server-sent events)",
)
async def create_chat_completion(request: Request) -> Response:
    """The messages through the model's chat template; one choice (``n`` is 1)."""
    body = await parse_body(request, ChatCompletionRequest)
    served = pick_generator(request, body.model)
    _check_openai(body)
    if body.tools:
        raise _bad("'tools' are not supported by this server; omit them")
    if not body.messages:
        raise _bad("'messages' is empty; send at least one message")
    if body.max_completion_tokens is not None:
        body.max_tokens = body.max_completion_tokens
    limits = generation_limits(request)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    size = sum(len(m["content"]) for m in messages)
    ids = await _encode(served.encode_chat, messages, size, limits, "messages")
    if not ids:
        raise _bad("'messages' produced no tokens; send some text")
    params = _sampling(served, body, [ids], default_max_tokens=DEFAULT_MAX_TOKENS)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = _submit_all(served, [ids], params, limits, rid)
    shape = _Shape(rid, "chat.completion", int(time.time()), served.name, chat=True)
    if body.stream:
        return _event_stream(request, served, streams, shape, limits, body)
    (completion,) = await _finish_all(request, served, streams, limits)
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": completion.text},
        "logprobs": None,
        "finish_reason": completion.finish_reason,
    }
    return JSONResponse({**shape.head(), "choices": [choice], "usage": _usage([completion])})


# -- model lookup and limits ------------------------------------------------------------------


def pick_generator(request: Request, name: str | None) -> ServedGenerator:
    """The generate model ``name`` (the only one when ``None``): 404 listing the models
    when unknown, 400 naming its task when it does something else."""
    generators: Mapping[str, ServedGenerator] = getattr(request.app.state, "generators", {})
    others: Mapping[str, Any] = getattr(request.app.state, "models", {})
    if name is None:
        if len(generators) == 1:
            return next(iter(generators.values()))
        if not generators:
            raise _bad(
                f"no model served here does generate; models: {_describe(generators, others)}"
            )
        raise _bad(
            f"{len(generators)} generate models are served ({', '.join(generators)}); "
            "name one in 'model'"
        )
    served = generators.get(name)
    if served is not None:
        return served
    other = others.get(name)
    if other is not None:
        task = str(getattr(other, "task", "another task"))
        where = ROUTE_OF_TASK.get(task)
        hint = f"; send it to {where}" if where else ""
        raise _bad(f"model {name!r} does {task}, and this route serves generate models{hint}")
    raise ApiError(
        404,
        f"model {_safe(name[:100])!r} is not served here; models: {_describe(generators, others)}",
        "model_not_found",
    )


def generation_limits(request: Request) -> GenerationLimits:
    state = request.app.state
    limits: GenerationLimits | None = getattr(state, "generation_limits", None)
    if limits is None:
        limits = GenerationLimits.from_settings(getattr(state, "settings", None))
        state.generation_limits = limits
    return limits


def _describe(generators: Mapping[str, Any], others: Mapping[str, Any]) -> str:
    names = [f"{name} (generate)" for name in generators]
    names += [f"{name} ({getattr(m, 'task', '?')})" for name, m in others.items()]
    return ", ".join(names) or "none"


def _check_count(n: int, limits: GenerationLimits, field: str) -> None:
    if n == 0:
        raise _bad(f"'{field}' is empty; send at least one prompt")
    if n > limits.max_prompts_per_request:
        raise ApiError(
            413,
            f"'{field}' has {n} prompts; at most {limits.max_prompts_per_request} per "
            "request, split it",
            "request_too_large",
        )


def _check_openai(body: _OpenAISampling) -> None:
    if body.n != 1:
        raise _bad(f"n={body.n} is not supported; send n=1 (several prompts for several texts)")
    if body.logprobs not in (None, False, 0):
        raise _bad("'logprobs' is not supported; omit it")


# -- prompts and sampling ---------------------------------------------------------------------


async def _encode_text(
    served: ServedGenerator, limits: GenerationLimits, text: str, field: str, index: int
) -> list[int]:
    if not text:
        raise _bad(f"'{field}' text {index} is empty; send non-empty prompts")
    ids = await _encode(served.encode_prompt, text, len(text), limits, field)
    if not ids:
        raise _bad(f"'{field}' text {index} has no tokens; send some text")
    return ids


async def _encode(
    encode: Callable[[T], list[int]], value: T, size: int, limits: GenerationLimits, field: str
) -> list[int]:
    try:
        if size <= limits.encode_inline_max_chars:
            return list(encode(value))
        return list(await asyncio.to_thread(encode, value))
    except (ValueError, InputError) as exc:
        raise _bad(f"'{field}' cannot be used with this model: {_safe(str(exc))[:300]}") from None
    except Exception as exc:
        if not any(t.__name__ == "TemplateError" for t in type(exc).__mro__):
            raise
        # a chat template that refuses the conversation (jinja's raise_exception: "roles
        # must alternate", "system role not supported"): the client's to fix
        raise _bad(
            f"'{field}' refused by the model's chat template: {_safe(str(exc))[:300]}"
        ) from None


def _sampling(
    served: ServedGenerator,
    body: _Sampling,
    prompts: Sequence[Sequence[int]],
    *,
    default_max_tokens: int,
    greedy: bool = False,
) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt: a missing ``max_tokens`` is capped by what the
    context leaves after that prompt. 400 when a prompt can never fit."""
    stop: tuple[str, ...] = (
        ()
        if body.stop is None
        else (body.stop,)
        if isinstance(body.stop, str)
        else tuple(body.stop)
    )
    # OpenAI's default temperature is 1; /generate is greedy unless told otherwise
    temperature = body.temperature if body.temperature is not None else (0.0 if greedy else 1.0)
    limit = served.max_context_tokens
    # checked here too (when the generator says its budget), so that a prompt that can
    # never fit refuses the request before any of its prompts is admitted
    budget = getattr(served.generator, "kv_token_budget", None)
    budget = budget if isinstance(budget, int) and budget > 0 else None
    params: list[SamplingParams] = []
    for i, ids in enumerate(prompts):
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(default_max_tokens, limit - len(ids)))
        try:
            check_fits(len(ids), max_tokens, max_context_tokens=limit, kv_token_budget=budget)
            params.append(
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=temperature,
                    top_p=body.top_p if body.top_p is not None else 1.0,
                    seed=body.seed,
                    stop=stop,
                    ignore_eos=body.ignore_eos,
                )
            )
        except RecordTooLargeError as exc:
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            raise ApiError(400, f"{where}{exc}", "invalid_request_error") from None
        except ValueError as exc:
            raise _bad(str(exc)) from None
    return params


def _submit_all(
    served: ServedGenerator,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    limits: GenerationLimits,
    request_id: str,
) -> list[GenerationStream]:
    """Admit every prompt, or none: what was admitted is aborted when one is refused."""
    generator = served.generator
    streams: list[GenerationStream] = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            streams.append(generator.submit(ids, p, request_id=f"{request_id}-{i}"))
    except BaseException as exc:
        for stream in streams:
            stream.abort()
        if isinstance(exc, QueueFullError):
            raise ApiError(
                429,
                "the server is busy (generation queue full); retry after the Retry-After delay",
                "rate_limit_exceeded",
                headers={"Retry-After": str(limits.retry_after_s)},
            ) from None
        if isinstance(exc, RecordTooLargeError):
            raise ApiError(400, str(exc), "invalid_request_error") from None
        if isinstance(exc, BatcherClosedError):
            raise shutting_down(limits.retry_after_s) from None
        if isinstance(exc, ValueError):
            raise _bad(str(exc)) from None
        raise
    return streams


# -- non-streaming: wait for every sequence ---------------------------------------------------


async def _finish_all(
    request: Request,
    served: ServedGenerator,
    streams: Sequence[GenerationStream],
    limits: GenerationLimits,
) -> list[Completion]:
    """Every stream's completion, in order; whatever way this ends, no sequence outlives
    it (a disconnect, a timeout or an error aborts the rest)."""

    async def results() -> list[Completion]:
        return [await s.result() for s in streams]

    try:
        async with asyncio.timeout(limits.request_timeout_s):
            completions = await _unless_disconnected(request.receive, results())
    except TimeoutError:
        raise ApiError(
            504,
            f"not done within request_timeout_s={limits.request_timeout_s}; its sequences "
            "were aborted",
            "timeout",
        ) from None
    except BatcherClosedError:
        raise shutting_down(limits.retry_after_s) from None
    except ApiError:
        raise
    except Exception:
        logger.exception("generation failed on model %s", served.name)
        raise ApiError(500, "the model failed on this request", "server_error") from None
    finally:
        for stream in streams:
            stream.abort()
    metrics = _metrics(request)
    if metrics is not None:
        for c in completions:
            metrics.observe(served.name, c)
    if any(c.finish_reason == "abort" for c in completions):
        raise ApiError(
            503,
            "generation was aborted (the server is shutting down); retry later",
            "service_unavailable",
            headers={"Retry-After": str(limits.retry_after_s)},
        )
    return completions


class _ClientGone(ApiError):
    """The client disconnected: nobody reads the answer (499, nginx's "client closed
    request", is what an access log shows)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the request", "client_closed_request")


async def _unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """``await work``, cancelled as soon as the client disconnects (then ``_ClientGone``)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise _ClientGone
    finally:
        for t in (task, watcher):
            t.cancel()
        # the work's cancellation aborts its sequences: let that run before returning
        await asyncio.gather(task, watcher, return_exceptions=True)


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


# -- streaming ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Shape:
    """The fields every response or chunk of one request repeats."""

    id: str
    object: str
    created: int
    model: str
    chat: bool

    def head(self, *, chunk: bool = False) -> dict[str, Any]:
        kind = self.object + ".chunk" if chunk and self.chat else self.object
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(
        self, index: int, text: str | None, finish: FinishReason | None, usage: bool
    ) -> bytes:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        body = {**self.head(chunk=True), "choices": [choice]}
        if usage:
            body["usage"] = None
        return _sse(body)

    def role(self, index: int, usage: bool) -> bytes:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        body = {**self.head(chunk=True), "choices": [choice]}
        if usage:
            body["usage"] = None
        return _sse(body)


def _sse(body: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode("utf-8") + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _error_event(status: int, message: str, kind: str) -> bytes:
    return _sse({"error": {"message": message, "type": kind, "code": status}})


def _event_stream(
    request: Request,
    served: ServedGenerator,
    streams: Sequence[GenerationStream],
    shape: _Shape,
    limits: GenerationLimits,
    body: _OpenAISampling,
) -> "_EventStream":
    """The streaming answer (``"stream": true``) of a request whose sequences are admitted."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    events = _events(served, streams, shape, limits, include_usage, _metrics(request))
    return _EventStream(events, streams)


async def _events(
    served: ServedGenerator,
    streams: Sequence[GenerationStream],
    shape: _Shape,
    limits: GenerationLimits,
    include_usage: bool,
    metrics: GenerationMetrics | None,
) -> AsyncIterator[bytes]:
    """The request's server-sent events: text chunks as the steps produce them, each
    choice's finish, the usage chunk if asked, then ``[DONE]``."""
    if shape.chat:
        for i in range(len(streams)):
            yield shape.role(i, include_usage)
    try:
        async with contextlib.aclosing(_merge(streams, limits.request_timeout_s)) as merged:
            async for index, delta in merged:
                if delta.finish_reason == "abort":
                    yield _error_event(
                        503,
                        "generation was aborted (the server is shutting down)",
                        "service_unavailable",
                    )
                    yield _DONE
                    return
                if delta.text or delta.finished:
                    text = delta.text if (delta.text or not shape.chat) else None
                    yield shape.chunk(index, text, delta.finish_reason, include_usage)
    except TimeoutError:
        yield _error_event(
            504,
            f"not done within request_timeout_s={limits.request_timeout_s}; its sequences "
            "were aborted",
            "timeout",
        )
        yield _DONE
        return
    except BatcherClosedError:
        yield _error_event(503, "the server is shutting down", "service_unavailable")
        yield _DONE
        return
    except Exception:
        logger.exception("generation failed on model %s (streaming)", served.name)
        yield _error_event(500, "the model failed on this request", "server_error")
        yield _DONE
        return
    completions = [await s.result() for s in streams]
    if metrics is not None:
        for c in completions:
            metrics.observe(served.name, c)
    if include_usage:
        yield _sse({**shape.head(chunk=True), "choices": [], "usage": _usage(completions)})
    yield _DONE


async def _merge(
    streams: Sequence[GenerationStream], timeout_s: float
) -> AsyncGenerator[tuple[int, GenerationDelta], None]:
    """``(index, delta)`` of every stream as they arrive; ``TimeoutError`` after
    ``timeout_s`` in all. Leaving early cancels the waits (which aborts those streams)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pending: dict[asyncio.Future[GenerationDelta], int] = {}

    def arm(i: int) -> None:
        pending[asyncio.ensure_future(streams[i].__anext__())] = i

    for i in range(len(streams)):
        arm(i)
    try:
        while pending:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError
            done, _ = await asyncio.wait(
                pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                raise TimeoutError
            for future in sorted(done, key=lambda f: pending[f]):
                i = pending.pop(future)
                try:
                    delta = future.result()
                except StopAsyncIteration:
                    continue
                if not delta.finished:
                    arm(i)
                yield i, delta
    finally:
        for future in pending:
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()  # retrieved: an error we did not get to is not logged


class _EventStream(Response):
    """``text/event-stream`` from an async iterator of ready-made events, that stops (and
    aborts the request's sequences) as soon as the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], streams: Sequence[GenerationStream]) -> None:
        self.status_code = 200
        self.background = None
        self._events = events
        self._streams = streams
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self._events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await _unless_disconnected(receive, pump())
        except (_ClientGone, OSError):
            pass  # nobody is listening: the sequences are aborted below
        except Exception:
            # the response has started: no error response can follow, only a log line
            logger.exception("streaming a generation response failed")
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            for stream in self._streams:
                stream.abort()
        if self.background is not None:
            await self.background()


# -- small helpers --------------------------------------------------------------------------


def _usage(completions: Sequence[Completion]) -> dict[str, int]:
    prompt = sum(c.prompt_tokens for c in completions)
    generated = sum(c.completion_tokens for c in completions)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }


def _metrics(request: Request) -> GenerationMetrics | None:
    metrics: GenerationMetrics | None = getattr(request.app.state, "generation_metrics", None)
    return metrics


def _bad(message: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error")


def _safe(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")
