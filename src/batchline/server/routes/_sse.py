"""Server-sent events of the generation routes (``"stream": true``): OpenAI's chunk shape,
one event per text delta, ``data: [DONE]`` at the end, and an error after the first byte sent
as one ``data: {"error": ...}`` event (what OpenAI's clients raise). The stream stops, and
aborts its sequences, as soon as the client goes away.

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

import asyncio
import builtins
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from batchline.models.generation import (
    Completion,
    FinishReason,
    GenerationDelta,
    GenerationStream,
    TokenLogprob,
)
from batchline.models.openai.completions import (
    Choice,
    chat_logprobs,
    completion_logprobs,
)
from batchline.models.openai.completions import usage as openai_usage
from batchline.server.errors import ApiError
from batchline.server.routes._common import api_error
from batchline.server.served import ServedGenerator
from batchline.server.settings import ServerSettings

__all__ = [
    "DONE",
    "EventStream",
    "Shape",
    "aborted",
    "event_stream",
    "merged_deltas",
    "sse",
    "usage",
]

logger = logging.getLogger("batchline.server")


@dataclass(frozen=True, slots=True)
class Shape:
    """The fields every response or chunk of one request repeats, and how its choices read:
    ``n`` choices per prompt (choice ``i`` is prompt ``i // n``'s), log-probabilities when
    ``token_text`` (a token id's text) is given, each choice's text after its prompt's
    when ``echo`` holds the prompts."""

    id: str
    object: str
    created: int
    model: str
    chat: bool
    n: int = 1
    token_text: Callable[[int], str] | None = None
    #: a token's own bytes (chat ``logprobs``' ``bytes``), with ``token_text``
    token_bytes: Callable[[int], bytes] | None = None
    echo: tuple[str, ...] | None = None
    #: with ``echo``: each prompt's first token id (its log-probability is null)
    echo_first: tuple[int, ...] | None = None

    def head(self, *, chunk: bool = False) -> dict[str, builtins.object]:
        kind = self.object + ".chunk" if chunk and self.chat else self.object
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def echoed(self, index: int) -> str:
        """The prompt text choice ``index`` starts with ("" without ``echo``)."""
        return "" if self.echo is None else self.echo[index // self.n]

    def logprobs(
        self,
        tokens: Sequence[TokenLogprob] | None,
        *,
        offset: int = 0,
        prompt: tuple[int, Sequence[TokenLogprob]] | None = None,
    ) -> dict[str, builtins.object] | None:
        """The ``logprobs`` object of these tokens, after the echoed ``prompt``'s (None when
        the request asked for none)."""
        if self.token_text is None or tokens is None:
            return None
        if self.chat:
            return chat_logprobs(tokens, self.token_text, self.token_bytes)
        return completion_logprobs(tokens, self.token_text, offset=offset, prompt=prompt)

    def scored_prompt(
        self, index: int, scored: Sequence[TokenLogprob] | None
    ) -> tuple[int, Sequence[TokenLogprob]] | None:
        """Choice ``index``'s echoed prompt as :func:`completion_logprobs` takes it (None
        without ``echo`` and log-probabilities)."""
        if self.echo_first is None or scored is None:
            return None
        return self.echo_first[index // self.n], scored

    def choice(self, index: int, completion: Completion) -> Choice:
        """Choice ``index`` of the whole (not streamed) response."""
        echoed = self.echoed(index)
        prompt = self.scored_prompt(index, completion.prompt_logprobs)
        offset = 0 if prompt is not None else len(echoed)
        return Choice(
            echoed + completion.text,
            completion.finish_reason,
            self.logprobs(completion.logprobs, offset=offset, prompt=prompt),
        )

    def chunk(
        self,
        index: int,
        text: str | None,
        finish: FinishReason | None,
        usage: bool,
        logprobs: dict[str, builtins.object] | None = None,
    ) -> bytes:
        choice: dict[str, builtins.object] = {"index": index}
        if self.chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        body = {**self.head(chunk=True), "choices": [choice]}
        if usage:
            body["usage"] = None
        return sse(body)

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
        return sse(body)


def sse(body: Mapping[str, object]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode("utf-8") + b"\n\n"


DONE = b"data: [DONE]\n\n"


def _error_event(error: ApiError) -> bytes:
    return sse({"error": {"message": error.message, "type": error.kind, "code": error.status}})


def _cut(shape: Shape, error: ApiError) -> bytes:
    """The error event of a stream the server cut (it is shutting down), logged on one line."""
    logger.warning("%s: stream cut before it finished: %s", shape.id, error.message)
    return _error_event(error)


def event_stream(
    served: ServedGenerator,
    streams: Sequence[GenerationStream],
    shape: Shape,
    settings: ServerSettings,
    include_usage: bool,
) -> "EventStream":
    """The streaming answer (``"stream": true``) of a request whose sequences are admitted."""
    return EventStream(_events(served, streams, shape, settings, include_usage), streams)


async def _events(
    served: ServedGenerator,
    streams: Sequence[GenerationStream],
    shape: Shape,
    settings: ServerSettings,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The request's server-sent events: text chunks as the steps produce them, each
    choice's finish, the usage chunk if asked, then ``[DONE]``. An error after the first
    byte is one error event (the routes' one error mapping), then ``[DONE]``."""
    if shape.chat:
        for i in range(len(streams)):
            yield shape.role(i, include_usage)
    # where each choice's next token starts in its text (completions' ``text_offset``)
    offsets = [len(shape.echoed(i)) for i in range(len(streams))]
    # the echoed prompts: at once, or with log-probabilities when their prefill gives them
    scoring = shape.echo is not None and shape.token_text is not None
    if shape.echo is not None and not scoring:
        for i in range(len(streams)):
            yield shape.chunk(i, shape.echoed(i), None, include_usage)
    try:
        async with contextlib.aclosing(
            merged_deltas(streams, settings.request_timeout_s)
        ) as merged:
            async for index, delta in merged:
                if delta.finish_reason == "abort":
                    # the generator stopped under it (a drain that timed out, a shutdown)
                    yield _cut(shape, aborted(settings))
                    yield DONE
                    return
                prompt = shape.scored_prompt(index, delta.prompt_logprobs) if scoring else None
                if prompt is not None:
                    scored = shape.logprobs((), prompt=prompt)
                    yield shape.chunk(index, shape.echoed(index), None, include_usage, scored)
                logprobs = shape.logprobs(delta.logprobs, offset=offsets[index])
                if logprobs is not None and shape.token_text is not None:
                    offsets[index] += sum(len(shape.token_text(t)) for t in delta.token_ids)
                if delta.text or delta.finished or logprobs is not None:
                    text = delta.text if (delta.text or not shape.chat) else None
                    yield shape.chunk(index, text, delta.finish_reason, include_usage, logprobs)
    except Exception as exc:
        error = api_error(exc, settings, served.name, withdrawn="its sequences were aborted")
        # 503: the generator closed while it waited (a drain that timed out, a shutdown)
        yield _cut(shape, error) if error.status == 503 else _error_event(error)
        yield DONE
        return
    completions = [await s.result() for s in streams]
    served.observe(completions)
    if include_usage:
        counted = usage(completions, n=shape.n)
        yield sse({**shape.head(chunk=True), "choices": [], "usage": counted})
    yield DONE


async def merged_deltas(
    streams: Sequence[GenerationStream],
    timeout_s: float,
    *,
    now: Callable[[], float] | None = None,
) -> AsyncGenerator[tuple[int, GenerationDelta], None]:
    """``(index, delta)`` of every stream as they arrive; ``TimeoutError`` once ``timeout_s``
    pass with no delta from any of them (the first token's wait, a queue's included): a
    request that makes progress runs to its end, one stuck or starved ends. Leaving early
    cancels the waits (which aborts those streams). ``now``: the clock (tests; the loop's)."""
    clock = now if now is not None else asyncio.get_running_loop().time
    deadline = clock() + timeout_s
    pending: dict[asyncio.Future[GenerationDelta], int] = {}

    def arm(i: int) -> None:
        pending[asyncio.ensure_future(streams[i].__anext__())] = i

    for i in range(len(streams)):
        arm(i)
    try:
        while pending:
            remaining = deadline - clock()
            if remaining <= 0:
                raise TimeoutError
            done, _ = await asyncio.wait(
                pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                raise TimeoutError
            deadline = clock() + timeout_s  # progress: the wait starts again
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


class EventStream(Response):
    """``text/event-stream`` from an async iterator of ready-made events, that stops (and
    aborts the request's sequences) as soon as the client disconnects (the gate cancels it)."""

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
            await pump()  # a disconnect cancels it (the gate): the sequences are aborted below
        except OSError:
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


def aborted(settings: ServerSettings) -> ApiError:
    """The 503 of a request whose sequences the generator aborted (it is shutting down)."""
    return ApiError(
        503,
        "generation was aborted (the server is shutting down); retry later",
        "service_unavailable",
        headers={"Retry-After": str(settings.retry_after_s)},
    )


def usage(completions: Sequence[Completion], *, n: int = 1) -> dict[str, int]:
    """OpenAI's ``usage`` of a request's completions, ``n`` per prompt (its prompt counted
    once)."""
    return openai_usage(
        sum(c.prompt_tokens for c in completions[::n]),
        sum(c.completion_tokens for c in completions),
    )
