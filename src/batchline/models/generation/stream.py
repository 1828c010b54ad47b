"""The request-level generation API: what the server, the ``run`` job and the benchmark call.

>>> async def main(gen: TextGenerator, ids: list[int]) -> str:
...     async with gen:
...         stream = gen.submit(ids, SamplingParams(max_tokens=32, stop=("\\n\\n",)))
...         async for delta in stream:       # text as it is produced, complete characters only
...             print(delta.text, end="")
...         return (await stream.result()).text

- :class:`TextGenerator` is what every generator implements (continuous, static, one at a
  time, vLLM). ``submit`` never waits: a full waiting queue raises ``QueueFullError`` (the
  server answers 429); a request that can never fit raises ``RecordTooLargeError``.
- :class:`GenerationStream` is one request: iterate it for :class:`GenerationDelta` items, or
  ``await stream.result()`` for the :class:`Completion`. ``stream.abort()`` (or cancelling the
  task awaiting it) ends the sequence with ``finish_reason="abort"`` and frees its slot at the
  engine's next step.
- Text is produced incrementally against a :class:`Detokenizer` (``decode(ids) -> str``; a
  ``tokenizers.Tokenizer`` is one): only complete characters are emitted (a trailing U+FFFD
  from a partial UTF-8 sequence is held back until it completes or the sequence ends); a stop
  string ends the sequence, the text is cut before it and ``finish_reason`` is ``"stop"``; the
  EOS token counts as a generated token but its text is never emitted.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, Self

from batchline._errors import RecordTooLargeError
from batchline.models.generation.engine import (
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StepOutput,
    TokenLogprob,
)
from batchline.models.generation.stats import GenerationStats

__all__ = [
    "Completion",
    "Detokenizer",
    "GenerationDelta",
    "GenerationStream",
    "IncrementalDetokenizer",
    "StopStringScanner",
    "TextGenerator",
    "TrackedSequence",
    "check_fits",
    "check_token_ids",
    "completions_of",
]

_REPLACEMENT = "\ufffd"
# prompt tokens decoded in front of the output, so a tokenizer that drops a leading space at
# the start of a decode does not drop it from the first generated word
_CONTEXT_TOKENS = 5


class Detokenizer(Protocol):
    """Turns token ids into text. ``tokenizers.Tokenizer`` satisfies it."""

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class GenerationDelta:
    """What one step added to one request: new text (complete characters only; may be empty
    while text is held back) and the token ids produced. The last delta has ``finished``."""

    text: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason | None = None
    #: one per token of ``token_ids`` when the request asked (``SamplingParams.logprobs``)
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: with the first token, when asked (``SamplingParams.prompt_logprobs``): one per prompt
    #: token after the first
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request. ``text`` is the concatenation of every delta's text.

    ``completion_tokens`` counts every token generated (an EOS token and a token that
    completed a stop string included). ``ttft_s`` is ``None`` when no token was generated
    (aborted while waiting). ``queue_wait_s`` is the time from ``submit()`` to the request's
    admission: it joined the running batch (continuous), its batch started (static, one at a
    time), or vLLM scheduled it (its first output's arrival less vLLM's own prefill time, or
    the arrival alone when vLLM keeps no request stats; see ``vllm_generator``); ``None`` when it
    never got there (aborted or closed while waiting). ``priority`` is its
    ``SamplingParams.priority`` (the batcher's, higher first), what the server labels the queue
    wait with. Times are on the generator's clock.
    """

    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    ttft_s: float | None
    latency_s: float
    queue_wait_s: float | None = None
    priority: int = 0
    #: one per token of ``token_ids`` when the request asked (``SamplingParams.logprobs``)
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: one per prompt token after the first, when asked (``SamplingParams.prompt_logprobs``)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


class GenerationStream:
    """One submitted request, seen from the event loop.

    Iterate it (``async for delta in stream``) for the deltas as the steps produce them, and/or
    ``await stream.result()`` for the :class:`Completion`; both raise the request's error if it
    failed. ``abort()`` ends it with ``finish_reason="abort"``; cancelling a task that awaits
    ``result()`` or the next delta aborts it too (a client that disconnects frees its slot).
    """

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        *,
        on_abort: Callable[[str], None],
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._on_abort = on_abort
        self._loop = asyncio.get_running_loop()
        self._clock = clock if clock is not None else self._loop.time
        #: when it was submitted or last made progress (a delta, its end), on ``clock`` (the
        #: loop's by default): what a wait without progress is measured from
        self.progressed_at = self._clock()
        self._deltas: deque[GenerationDelta] = deque()
        self._result: asyncio.Future[Completion] = self._loop.create_future()
        self._waiter: asyncio.Future[None] | None = None
        self._abort_requested = False

    @property
    def done(self) -> bool:
        """True once the request has ended (its result or error is set)."""
        return self._result.done()

    def abort(self) -> None:
        """End the request: its slot frees at the engine's next step. Idempotent; a no-op once
        it has ended."""
        if self._result.done() or self._abort_requested:
            return
        self._abort_requested = True
        self._on_abort(self.request_id)

    async def result(self) -> Completion:
        """Wait for the request to end. Cancelling the waiting task aborts the request."""
        try:
            return await asyncio.shield(self._result)
        except asyncio.CancelledError:
            self.abort()
            raise

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> GenerationDelta:
        while True:
            if self._deltas:
                return self._deltas.popleft()
            if self._result.done():
                exc = self._result.exception()
                if exc is not None:
                    raise exc
                raise StopAsyncIteration
            waiter: asyncio.Future[None] = self._loop.create_future()
            self._waiter = waiter
            try:
                await waiter
            except asyncio.CancelledError:
                self.abort()
                raise
            finally:
                self._waiter = None

    # -- called by generators, on the event loop ------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _push(self, delta: GenerationDelta) -> None:
        if self._result.done():
            return
        self.progressed_at = self._clock()
        self._deltas.append(delta)
        self._wake()

    def _complete(self, completion: Completion) -> bool:
        if self._result.done():
            return False
        self.progressed_at = self._clock()
        self._result.set_result(completion)
        self._wake()
        return True

    def _fail(self, exc: BaseException) -> bool:
        if self._result.done():
            return False
        self.progressed_at = self._clock()
        self._result.set_exception(exc)
        # retrieved here: a caller that only iterates gets the error from __anext__, and an
        # unread error must not be logged as "never retrieved"
        self._result.exception()
        self._wake()
        return True


async def completions_of(
    streams: Sequence[GenerationStream],
    timeout_s: float,
    *,
    now: Callable[[], float] | None = None,
) -> list[Completion]:
    """Every stream's completion, in order, or the first error one of them raises;
    ``TimeoutError`` once ``timeout_s`` pass with no progress from any of them
    (:attr:`GenerationStream.progressed_at`: the first token's wait, a queue's included, then
    the wait for each next one): a request that makes progress runs to its end, one stuck or
    starved ends. It wakes on the ends and at the deadlines, not on every token. Leaving early
    aborts the streams it still waits for. ``now``: the streams' clock (the loop's)."""
    clock = now if now is not None else asyncio.get_running_loop().time
    waits = [asyncio.ensure_future(s.result()) for s in streams]
    try:
        while True:
            for wait in waits:  # an error ends it at once, the first stream's first
                error = wait.exception() if wait.done() else None
                if error is not None:
                    raise error
            pending = [w for w in waits if not w.done()]
            if not pending:
                return [w.result() for w in waits]
            last = max(s.progressed_at for s in streams)
            remaining = last + timeout_s - clock()
            if remaining <= 0:
                raise TimeoutError
            await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for stream, wait in zip(streams, waits, strict=True):
            if not wait.done():
                stream.abort()
                wait.cancel()
            elif not wait.cancelled():
                wait.exception()  # retrieved: an error we did not get to is not logged


class TextGenerator(Protocol):
    """What every text generator offers (continuous, static, one at a time, vLLM)."""

    async def start(self) -> None: ...

    async def stop(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Refuse new requests; ``drain=True`` lets admitted ones finish (until ``timeout_s``),
        then what is left is ended: running ones with ``finish_reason="abort"``, waiting ones
        with ``BatcherClosedError``."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc_info: object) -> None: ...

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationStream:
        """Admit one request now or raise: ``QueueFullError`` (waiting queue full),
        ``RecordTooLargeError`` (prompt + max_tokens over the context or KV budget),
        ``BatcherClosedError`` (stopping), ``ValueError`` (empty prompt, duplicate id)."""
        ...

    def submit_many(self, requests: Sequence[GenerationRequest]) -> list[GenerationStream]:
        """Admit every request now, or none (raising as :meth:`submit` does), in one go: a
        scheduler that admits between steps sees them all at once, so requests that fit join the
        same step (a row's ``n`` samples share one prefill of their prompt)."""
        ...

    @property
    def stats(self) -> GenerationStats: ...

    @property
    def max_context_tokens(self) -> int: ...

    @property
    def max_request_tokens(self) -> int:
        """The most prompt + ``max_tokens`` one request may have: the context, or the KV
        budget where smaller; a caller's default ``max_tokens`` fits in what it leaves."""
        ...

    @property
    def gone(self) -> str | None:
        """Why this generator will take no more requests until it is started anew (its engine
        exited: :class:`~batchline.EngineGoneError`, which its submits then raise), else None."""
        ...

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``RecordTooLargeError`` when this request can never be admitted, and
        ``ValueError`` for a token id outside the model's vocabulary where the generator knows
        it, as :meth:`submit` would, admitting nothing: a caller that admits several requests
        all or none checks each first."""
        ...


def check_fits(
    prompt_tokens: int, max_tokens: int, *, max_context_tokens: int, kv_token_budget: int | None
) -> None:
    """Raise ``RecordTooLargeError`` when a request can never be admitted."""
    total = prompt_tokens + max_tokens
    if total > max_context_tokens:
        raise RecordTooLargeError(
            f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} = {total} tokens "
            f"exceeds the model's context of {max_context_tokens} tokens; shorten the prompt "
            "or lower max_tokens"
        )
    if kv_token_budget is not None and total > kv_token_budget:
        raise RecordTooLargeError(
            f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} = {total} tokens "
            f"exceeds the KV-cache budget of {kv_token_budget} tokens; shorten the prompt, "
            "lower max_tokens or raise kv_token_budget"
        )


def check_token_ids(prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int) -> None:
    """``ValueError`` when a prompt token or a ``logit_bias`` key is outside the model's
    vocabulary, ``[0, vocab_size)``: the request's own fault, told before it is admitted."""
    low, high = min(prompt_ids, default=0), max(prompt_ids, default=0)
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"prompt token ids must be in [0, {vocab_size}), the model's vocabulary; "
            f"got {low}..{high}"
        )
    biased = params.logit_bias
    if biased and biased[-1][0] >= vocab_size:  # ascending ids: the last is the largest
        raise ValueError(
            f"logit_bias names token {biased[-1][0]}, "
            f"outside the model's vocabulary of {vocab_size}"
        )


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text pieces, emitting complete text only.

    It decodes a short window (from ``prefix`` to the end) and emits what that adds over the
    window's already-emitted part: O(window) per token, not O(sequence). A decode that ends in
    U+FFFD is an unfinished UTF-8 sequence: nothing is emitted until it completes.
    """

    def __init__(self, detokenizer: Detokenizer, context_ids: Sequence[int] = ()) -> None:
        self._decode = detokenizer.decode
        self._ids: list[int] = list(context_ids[-_CONTEXT_TOKENS:]) if context_ids else []
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (maybe ``""``)."""
        self._ids.extend(ids)
        return self._take(final=False)

    def flush(self) -> str:
        """The sequence has ended: return whatever is still held back."""
        return self._take(final=True)

    def _take(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        emitted = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(emitted) or (not final and text.endswith(_REPLACEMENT)):
            return ""
        self._prefix = self._read
        self._read = len(self._ids)
        return text[len(emitted) :]


class StopStringScanner:
    """Finds stop strings in text that arrives in pieces, even across pieces.

    After each piece the text is cut before the earliest stop string in the text received so
    far (so of two overlapping stop strings, the one completed first wins). ``feed`` returns
    the text that is safe to emit: a suffix that could be the start of a stop string is held
    back until the next piece decides it.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._text = ""
        self._sent = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add ``piece``; return ``(text to emit now, a stop string was found)``."""
        if not self._stops:
            return piece, False
        start = max(0, len(self._text) - self._longest + 1)
        self._text += piece
        found = -1
        for stop in self._stops:
            at = self._text.find(stop, start)
            if at != -1 and (found == -1 or at < found):
                found = at
        if found != -1:
            end = max(found, self._sent)
            out = self._text[self._sent : end]
            self._text = self._text[:end]
            self._sent = end
            return out, True
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._text)), hold, -1):
                if self._text.endswith(stop[:k]):
                    hold = k
                    break
        end = max(self._sent, len(self._text) - hold)
        out = self._text[self._sent : end]
        self._sent = end
        return out, False

    def flush(self) -> str:
        out = self._text[self._sent :]
        self._sent = len(self._text)
        return out


@dataclass(slots=True)
class StepUpdate:
    """What one step did for one tracked sequence (built on the worker thread)."""

    delta: GenerationDelta
    completion: Completion | None
    stop_hit: bool
    """A stop string appeared: the engine must abort this sequence before its next step."""


@dataclass(eq=False, slots=True)
class TrackedSequence:
    """One request's bookkeeping above the engine: text assembly, stop strings, timings.

    Only the thread that runs the engine calls :meth:`advance` / :meth:`end`.
    """

    request: GenerationRequest
    stream: GenerationStream
    submitted_at: float
    eos_token_ids: frozenset[int]
    detok: IncrementalDetokenizer
    scanner: StopStringScanner = field(init=False)
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False
    withdrawn: bool = False
    """Aborted before it reached the engine (static batching: still in the batcher's queue)."""
    dispatched: bool = False
    """Handed to the engine's thread (static batching): only that thread may end it now."""
    admitted_at: float | None = None
    """When it joined the engine's running batch (its queue wait ends there)."""
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    context: contextvars.Context | None = None
    """The context it was submitted in, kept only for a step observer (traces)."""

    def __post_init__(self) -> None:
        self.scanner = StopStringScanner(self.request.params.stop)
        if self.request.params.logprobs is not None:
            self.logprobs = []

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def kv_reservation(self) -> int:
        return self.request.max_total_tokens

    def advance(self, out: StepOutput, now: float) -> StepUpdate:
        params = self.request.params
        new_ids = tuple(out.token_ids)
        text_ids: Sequence[int] = new_ids
        if (
            out.finished
            and out.finish_reason == "stop"
            and not params.ignore_eos
            and new_ids
            and new_ids[-1] in self.eos_token_ids
        ):
            text_ids = new_ids[:-1]
        piece = self.detok.push(text_ids) if text_ids else ""
        if out.finished:
            piece += self.detok.flush()
        emit, stop_hit = self.scanner.feed(piece)
        if out.finished and not stop_hit:
            emit += self.scanner.flush()
        if new_ids:
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
            self.token_ids.extend(new_ids)
            if self.logprobs is not None and out.logprobs is not None:
                self.logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                self.prompt_logprobs = out.prompt_logprobs
        self.text_parts.append(emit)
        finished = out.finished or stop_hit
        reason: FinishReason | None = None
        if stop_hit:
            reason = "stop"
        elif out.finished:
            reason = out.finish_reason if out.finish_reason is not None else "stop"
        delta = GenerationDelta(emit, new_ids, finished, reason, out.logprobs, out.prompt_logprobs)
        completion = self._completion(reason, now) if reason is not None else None
        self.finished = finished
        return StepUpdate(delta, completion, stop_hit)

    def end(self, reason: FinishReason, now: float) -> StepUpdate:
        """End the sequence outside a step (abort): whatever text is held is emitted."""
        emit = self.scanner.feed(self.detok.flush())[0] + self.scanner.flush()
        self.text_parts.append(emit)
        self.finished = True
        return StepUpdate(
            GenerationDelta(emit, (), True, reason), self._completion(reason, now), False
        )

    def _completion(self, reason: FinishReason, now: float) -> Completion:
        return Completion(
            text="".join(self.text_parts),
            token_ids=tuple(self.token_ids),
            prompt_tokens=len(self.request.prompt_ids),
            completion_tokens=len(self.token_ids),
            finish_reason=reason,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.submitted_at,
            latency_s=now - self.submitted_at,
            queue_wait_s=None if self.admitted_at is None else self.admitted_at - self.submitted_at,
            priority=self.request.params.priority,
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            prompt_logprobs=self.prompt_logprobs,
        )
