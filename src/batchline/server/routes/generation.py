"""Text generation over HTTP: ``POST /generate``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (OpenAI-compatible, streaming or not).

Every prompt of every request is submitted to the model's ONE shared
:class:`~batchline.models.generation.stream.TextGenerator` (its
:class:`~batchline.server.served.ServedGenerator`, from the server's model registry), so sequences
from concurrent clients share the engine's steps (continuous batching). A request is admitted
whole or not at all: if the waiting queue cannot take all of its prompts, the ones already
admitted are aborted and the answer is 429 + ``Retry-After``. The request bodies are in
:mod:`batchline.server.schemas`, the streaming answer in ``routes/_sse.py``; the model lookup,
the count check and the error mapping are the shared route kit's (``routes/_common.py``).

Where a request can end:

==========================  ===========================================================
200                          every prompt finished (``stop``: EOS or a stop string;
                             ``length``: ``max_tokens``)
400                          prompt tokens + ``max_tokens`` over the model's context (the
                             message gives the counts and the limit), unsupported
                             parameters (``n`` > 1, ``echo``, ``logprobs``, ``top_k``...:
                             anything accepted is applied), penalties or ``logit_bias``
                             out of OpenAI's ranges, empty prompts, a model of another
                             task, no model named while several generate models are
                             served; a constraint the grammar engine cannot enforce (the
                             reason: too many choices, a regex too big, a cyclic or
                             unsatisfiable schema), or, once generating, one it gave up
                             on (``ConstraintError``; streaming: an SSE error event):
                             never a ``stop`` that ignored the constraint
404                          unknown model (the message lists the served ones)
413                          more prompts than ``max_inputs_per_request``
422                          wrong types or out-of-range values (never echoes the input)
429 + ``Retry-After``        the generator's waiting queue cannot take every prompt
503 + ``Retry-After``        the generator is stopping
504                          ``request_timeout_s`` elapsed: its sequences were aborted
(no response)                the client disconnected: its sequences were aborted
==========================  ===========================================================

An aborted sequence leaves the engine before its next step, so its slot and KV reservation
go to waiting requests at once. A request's priority (its body's ``priority``, the
``X-Batchline-Priority`` header, the model's ``model_priority``; ``interactive`` by default)
goes with each of its prompts in ``SamplingParams.priority``: the generator orders who joins
the next step by it (aged, as the batchers' queues; ``continuous.py``).

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, cast

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from batchline._errors import InputError, RecordTooLargeError
from batchline.models.generation import (
    Completion,
    Constraint,
    GenerationRequest,
    GenerationStream,
    SamplingParams,
    completions_of,
)
from batchline.models.openai.completions import completion_response
from batchline.models.openai.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAISamplingBody,
    SamplingBody,
)
from batchline.server.errors import ApiError, bad_request, safe_text
from batchline.server.routes._common import (
    ERRORS,
    api_error,
    body_doc,
    check_count,
    parse_body,
    request_priority,
    server_state,
    use_generator,
)
from batchline.server.routes._sse import Shape, aborted, event_stream
from batchline.server.schemas import GenerateTextRequest, GenerateTextResponse
from batchline.server.served import ServedGenerator
from batchline.server.state import ServerState

__all__ = ["router"]

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


class _Routed(Protocol):
    @property
    def model(self) -> str | None: ...
    @property
    def priority(self) -> object: ...


B = TypeVar("B", bound=BaseModel)


async def _generation_request(
    request: Request, schema: type[B]
) -> tuple[B, ServerState, ServedGenerator, int]:
    """The body as ``schema`` (with ``model`` and ``priority``), the generator it names
    (loaded on demand, held for the request) and the request's priority."""
    body = await parse_body(request, schema)
    routed = cast(_Routed, body)
    state = server_state(request)
    served = await use_generator(request, state, routed.model)
    priority = request_priority(request, state, served.name, routed.priority)
    return body, state, served, priority


@router.post(
    "/generate",
    response_model=GenerateTextResponse,
    responses=ERRORS,
    openapi_extra=body_doc(GenerateTextRequest),
    summary="One generated text per prompt, in order",
)
async def generate(request: Request) -> Response:
    """``{"prompts": [...], "task_id": ...}`` to ``{"results": [...], "details": [...],
    "task_id", "model"}``: each prompt is a raw prompt (no chat template) unless ``"chat":
    true``; greedy unless ``temperature`` is given."""
    body, state, served, priority = await _generation_request(request, GenerateTextRequest)
    check_count(len(body.prompts), state, "prompts", "prompts")
    prompts = [
        await _encode_text(served, state, text, "prompts", i, chat=body.chat)
        for i, text in enumerate(body.prompts)
    ]
    params = _sampling(
        served,
        body,
        prompts,
        await _constraint(body, request),
        priority,
        default_max_tokens=DEFAULT_MAX_TOKENS,
        greedy=True,
    )
    _check_sizes(served, prompts, params)
    streams = _submit_all(served, state, prompts, params, f"gen-{uuid.uuid4().hex}")
    completions = await _finish_all(request, state, served, streams)
    return JSONResponse(
        {
            "results": [c.text for c in completions],
            "details": [
                {
                    "finish_reason": c.finish_reason,
                    "prompt_tokens": c.prompt_tokens,
                    "completion_tokens": c.completion_tokens,
                }
                for c in completions
            ],
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
    body, state, served, priority = await _generation_request(request, CompletionRequest)
    _check(body)
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    check_count(len(texts), state, "prompt", "prompts")
    prompts = [await _encode_text(served, state, text, "prompt", i) for i, text in enumerate(texts)]
    params = _sampling(
        served,
        body,
        prompts,
        await _constraint(body, request),
        priority,
        default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
    )
    _check_sizes(served, prompts, params)
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = _submit_all(served, state, *_samples(body, state, prompts, params), rid)
    echo = (texts, [ids[0] for ids in prompts]) if body.echo else None
    shape = _shape(served, body, rid, chat=False, echo=echo)
    if body.stream:
        return event_stream(served, streams, shape, state.settings, body.include_usage())
    completions = await _finish_all(request, state, served, streams)
    return JSONResponse(_response(shape, completions))


@router.post(
    "/v1/chat/completions",
    responses=ERRORS,
    openapi_extra=body_doc(ChatCompletionRequest),
    summary="Create a chat completion (OpenAI-compatible; stream: true for server-sent events)",
)
async def create_chat_completion(request: Request) -> Response:
    """The messages through the model's chat template; one choice (``n`` is 1)."""
    body, state, served, priority = await _generation_request(request, ChatCompletionRequest)
    _check(body)
    messages = body.chat()
    size = sum(len(m["content"]) for m in messages)
    ids = await _encode(served.encode_chat, messages, size, state, "messages")
    if not ids:
        raise bad_request("'messages' produced no tokens; send some text")
    constraint = await _constraint(body, request)
    params = _sampling(
        served, body, [ids], constraint, priority, default_max_tokens=DEFAULT_MAX_TOKENS
    )
    _check_sizes(served, [ids], params)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = _submit_all(served, state, *_samples(body, state, [ids], params), rid)
    shape = _shape(served, body, rid, chat=True)
    if body.stream:
        return event_stream(served, streams, shape, state.settings, body.include_usage())
    completions = await _finish_all(request, state, served, streams)
    return JSONResponse(_response(shape, completions))


def _shape(
    served: ServedGenerator,
    body: OpenAISamplingBody,
    rid: str,
    *,
    chat: bool,
    echo: tuple[Sequence[str], Sequence[int]] | None = None,
) -> Shape:
    """What each response or chunk of the request repeats, and how its choices are told
    (``echo``: the prompts' texts and first token ids)."""
    return Shape(
        rid,
        "chat.completion" if chat else "text_completion",
        int(time.time()),
        served.name,
        chat=chat,
        n=body.n,
        token_text=None if body.logprob_count() is None else _token_text(served),
        token_bytes=None if body.logprob_count() is None else _token_bytes(served),
        echo=None if echo is None else tuple(echo[0]),
        echo_first=None if echo is None else tuple(echo[1]),
    )


def _token_text(served: ServedGenerator) -> Callable[[int], str]:
    return served.token_text


def _token_bytes(served: ServedGenerator) -> Callable[[int], bytes]:
    return served.token_bytes


def _samples(
    body: OpenAISamplingBody,
    state: ServerState,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
) -> tuple[list[Sequence[int]], list[SamplingParams]]:
    """Each prompt ``n`` times, with each completion's params (``SamplingParams.samples``):
    choice ``i * n + j`` is prompt ``i``'s ``j``-th. 413 past ``max_inputs_per_request``."""
    n = body.n
    limit = state.settings.max_inputs_per_request
    if len(prompts) * n > limit:
        raise ApiError(
            413,
            f"{len(prompts)} prompt(s) x n={n} is {len(prompts) * n} completions; at most "
            f"{limit} per request, lower n or split the prompts",
            "request_too_large",
        )
    return (
        [ids for ids in prompts for _ in range(n)],
        [sample for p in params for sample in p.samples(n)],
    )


def _response(shape: Shape, completions: Sequence[Completion]) -> dict[str, object]:
    return completion_response(
        id=shape.id,
        created=shape.created,
        model=shape.model,
        chat=shape.chat,
        choices=[shape.choice(i, c) for i, c in enumerate(completions)],
        prompt_tokens=sum(c.prompt_tokens for c in completions[:: shape.n]),
        completion_tokens=sum(c.completion_tokens for c in completions),
    )


# -- checks, prompts and sampling ----------------------------------------------------------


def _check(body: OpenAISamplingBody) -> None:
    try:
        body.check()
    except ValueError as exc:
        raise bad_request(str(exc)) from None


async def _encode_text(
    served: ServedGenerator,
    state: ServerState,
    text: str,
    field: str,
    index: int,
    *,
    chat: bool = False,
) -> list[int]:
    if not text:
        raise bad_request(f"'{field}' text {index} is empty; send non-empty prompts")

    def as_user_message(prompt: str) -> list[int]:
        try:
            return served.encode_chat([{"role": "user", "content": prompt}])
        except InputError:
            # no chat template: the prompt as it is, as `batchline run` takes it
            return served.encode_prompt(prompt)

    encode = as_user_message if chat else served.encode_prompt
    ids = await _encode(encode, text, len(text), state, field)
    if not ids:
        raise bad_request(f"'{field}' text {index} has no tokens; send some text")
    return ids


async def _encode(
    encode: Callable[[T], list[int]], value: T, size: int, state: ServerState, field: str
) -> list[int]:
    """Tokenized on the event loop when short (``tokenize_inline_max_chars``, as the batch
    models' inputs), else in a worker thread."""
    try:
        if size <= state.settings.tokenize_inline_max_chars:
            return list(encode(value))
        return list(await asyncio.to_thread(encode, value))
    except (ValueError, InputError) as exc:
        raise bad_request(
            f"'{field}' cannot be used with this model: {safe_text(str(exc))[:300]}"
        ) from None
    except Exception as exc:
        if not any(t.__name__ == "TemplateError" for t in type(exc).__mro__):
            raise
        # a chat template that refuses the conversation (jinja's raise_exception: "roles
        # must alternate", "system role not supported"): the client's to fix
        raise bad_request(
            f"'{field}' refused by the model's chat template: {safe_text(str(exc))[:300]}"
        ) from None


async def _constraint(body: SamplingBody, request: Request) -> Constraint | None:
    """The body's constraint, checked against the grammar engine's limits in a worker thread
    (compiling a large grammar takes up to a few hundred ms); 400 with the reason when it is
    bad or cannot be enforced, and one log line saying which request and why (the client's
    ``X-Request-Id`` when it sends one)."""
    try:
        if not body.constrains():
            return None
        return await asyncio.to_thread(body.constraint)
    except ValueError as exc:
        reason = safe_text(str(exc))[:300]
        sent = request.headers.get("x-request-id")
        who = f" (request {safe_text(sent)[:100]})" if sent else ""
        logger.warning(
            "%s %s%s: constraint refused: %s", request.method, request.url.path, who, reason
        )
        raise bad_request(str(exc)) from None


def _sampling(
    served: ServedGenerator,
    body: SamplingBody,
    prompts: Sequence[Sequence[int]],
    constraint: Constraint | None,
    priority: int = 0,
    *,
    default_max_tokens: int,
    greedy: bool = False,
) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt (:meth:`SamplingBody.sampling`), at the request's
    ``priority`` (the batcher's, from :func:`request_priority`: the generator orders joins by
    it): a missing ``max_tokens`` is capped by what the context (or the KV budget, where
    smaller) leaves after that prompt; ``constraint`` is the body's, checked already
    (:func:`_constraint`). 400 when the body cannot be sampled as asked."""
    limit = served.generator.max_request_tokens
    params: list[SamplingParams] = []
    for ids in prompts:
        try:
            p = body.sampling(
                max_tokens=max(1, min(default_max_tokens, limit - len(ids))),
                constraint=constraint,
                priority=priority,
                greedy=greedy,
            )
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        params.append(p)
    return params


def _check_sizes(
    served: ServedGenerator, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
) -> None:
    """400 when a prompt can never fit or names a token outside the vocabulary, before any is
    admitted: the generator's own check (``TextGenerator.check``, what its ``submit``
    checks), asked for every prompt first."""
    generator = served.generator
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        try:
            generator.check(ids, p)
        except (RecordTooLargeError, ValueError) as exc:
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            raise bad_request(f"{where}{exc}") from None


def _submit_all(
    served: ServedGenerator,
    state: ServerState,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    request_id: str,
) -> list[GenerationStream]:
    """Admit every prompt, or none, in one go (``TextGenerator.submit_many``): the engine
    takes a request's prompts and samples into the same step."""
    try:
        requests = [
            GenerationRequest(f"{request_id}-{i}", tuple(ids), p)
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
        ]
        return served.generator.submit_many(requests)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    except Exception as exc:
        error = api_error(exc, state.settings, served.name, withdrawn="nothing was admitted")
        raise error from None


# -- waiting for every sequence ----------------------------------------------------------------


async def _finish_all(
    request: Request,
    state: ServerState,
    served: ServedGenerator,
    streams: Sequence[GenerationStream],
) -> list[Completion]:
    """Every stream's completion, in order; whatever way this ends, no sequence outlives
    it (a timeout, an error, or the gate cancelling it on a disconnect aborts the rest). The
    timeout is ``request_timeout_s`` without a new token (:func:`completions_of`), as a
    stream's: a long answer that makes progress is not cut."""
    settings = state.settings
    try:
        # a disconnect cancels this (the gate)
        completions = await completions_of(streams, settings.request_timeout_s)
    except Exception as exc:
        raise api_error(
            exc, settings, served.name, withdrawn="its sequences were aborted"
        ) from None
    finally:
        for stream in streams:
            stream.abort()
    served.observe(completions)
    if any(c.finish_reason == "abort" for c in completions):
        raise aborted(settings)
    return completions
