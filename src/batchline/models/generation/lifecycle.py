"""``GeneratorLifecycle``: start, stop, drain and the admission checks, written once for every
generator.

The continuous and static schedulers (:mod:`.continuous`, :mod:`.static`) and the vLLM adapter
(:mod:`.vllm_generator`) differ in what they run, not in how they start and stop: a generator
starts once; ``stop()`` refuses new requests, lets admitted ones finish when asked to drain (for
at most ``timeout_s``), then ends what is left; concurrent ``stop()`` calls share one stop. Each
subclass says what its worker is through three hooks. What a request must be to be taken (a
running generator, a fresh id, a prompt that fits the context and KV budget) is checked here
too: :meth:`GeneratorLifecycle.check` is the one size check, used by every ``submit`` and by a
caller that admits several requests all or none (the server's ``/generate`` with many prompts).
"""

from __future__ import annotations

import asyncio
from collections.abc import Container, Sequence
from typing import Self

from batchline._batcher import State
from batchline._errors import BatcherClosedError
from batchline.models.generation.engine import GenerationRequest, SamplingParams
from batchline.models.generation.stats import GenerationStatsRecorder
from batchline.models.generation.stream import GenerationStream, check_fits, check_token_ids

__all__ = ["GeneratorLifecycle", "duplicated"]


def duplicated(requests: Sequence[GenerationRequest]) -> None:
    """Raise ``ValueError`` when two of ``requests`` have one ``request_id``: a group is
    admitted all or none, so this is checked before any is."""
    seen: set[str] = set()
    for request in requests:
        if request.request_id in seen:
            raise ValueError(f"request_id {request.request_id!r} is given twice")
        seen.add(request.request_id)


class GeneratorLifecycle:
    """The state machine NEW -> RUNNING -> STOPPING -> STOPPED of a generator."""

    def __init__(self, name: str, recorder: GenerationStatsRecorder) -> None:
        self.name = name
        self._recorder = recorder
        self._state = State.NEW
        self._stop_task: asyncio.Task[None] | None = None

    @property
    def state(self) -> State:
        return self._state

    @property
    def max_context_tokens(self) -> int:
        """The longest prompt + ``max_tokens`` one request may have."""
        raise NotImplementedError

    @property
    def gone(self) -> str | None:
        """Why this generator takes no more requests (see ``TextGenerator.gone``): None here,
        where the engine runs in this process and its failures fail requests, not it."""
        return None

    def _kv_limit(self) -> int | None:
        """The KV-cache budget one request must fit in, when the generator keeps one."""
        return None

    @property
    def max_request_tokens(self) -> int:
        """The most prompt + ``max_tokens`` one request may have: the context, or the KV
        budget where that is smaller (what :meth:`check` refuses beyond)."""
        budget = self._kv_limit()
        context = self.max_context_tokens
        return context if budget is None else min(context, budget)

    @property
    def vocab_size(self) -> int | None:
        """The token ids the model takes, ``[0, vocab_size)``, where this generator knows them
        (what :meth:`check` holds a prompt and ``logit_bias`` to); None where it does not."""
        return None

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``RecordTooLargeError`` when this request can never be admitted (prompt +
        ``max_tokens`` over the context or the KV budget), ``ValueError`` for a token id
        outside :attr:`vocab_size` (a prompt's, a ``logit_bias`` key); admits and counts
        nothing. Told here, a streamed answer is refused before its first byte."""
        check_fits(
            len(prompt_ids),
            params.max_tokens,
            max_context_tokens=self.max_context_tokens,
            kv_token_budget=self._kv_limit(),
        )
        vocab = self.vocab_size
        if vocab is not None:
            check_token_ids(prompt_ids, params, vocab)

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationStream:
        """Admit one request now or raise (``TextGenerator.submit``): the subclass's."""
        raise NotImplementedError

    def submit_many(self, requests: Sequence[GenerationRequest]) -> list[GenerationStream]:
        """Admit every request now, or none: one :meth:`submit` each, with no wait between
        them, and what was admitted aborted when one is refused. A generator whose worker
        admits between the event loop's steps (the vLLM adapter's tasks, the static batcher's)
        takes them together this way; one whose worker is a thread queues them at once."""
        duplicated(requests)
        streams: list[GenerationStream] = []
        try:
            for request in requests:
                streams.append(
                    self.submit(request.prompt_ids, request.params, request_id=request.request_id)
                )
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    def _admissible(
        self,
        request_id: str,
        in_use: Container[str],
        prompt_ids: Sequence[int],
        params: SamplingParams,
    ) -> tuple[int, ...]:
        """What ``submit`` checks before it takes a request, in order; the prompt as a tuple.

        Not running → ``RuntimeError`` (never started) or ``BatcherClosedError``; a
        ``request_id`` in use or an empty prompt → ``ValueError``; a request that can never fit
        → ``RecordTooLargeError`` (:meth:`check`), counted as a rejection.
        """
        if self._state is not State.RUNNING:
            if self._state is State.NEW:
                raise RuntimeError(f"{self.name} is not running; call start() or use 'async with'")
            raise BatcherClosedError(f"{self.name} is {self._state.value}; submit refused")
        if request_id in in_use:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt = tuple(prompt_ids)
        if not prompt:
            raise ValueError("the prompt has no tokens")
        try:
            self.check(prompt, params)
        except Exception:
            self._recorder.on_reject()
            raise
        return prompt

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._state is not State.NEW:
            raise RuntimeError(f"{self.name} is {self._state.value}; a generator starts once")
        await self._start_worker()
        self._state = State.RUNNING
        self._recorder.started()

    async def stop(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Refuse new requests; with ``drain``, let admitted ones finish (for at most
        ``timeout_s``); then running ones end with ``finish_reason="abort"`` and waiting ones
        fail with ``BatcherClosedError``. Concurrent calls all return once stopped."""
        if self._state is State.NEW:
            self._state = State.STOPPED
            return
        if self._state is State.STOPPED:
            return
        if self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(
                self._do_stop(drain, timeout_s)
            )
        await asyncio.shield(self._stop_task)

    async def _do_stop(self, drain: bool, timeout_s: float | None) -> None:
        self._state = State.STOPPING
        if drain:
            await self._drain(timeout_s)
        await self._shutdown_worker()
        self._state = State.STOPPED
        self._recorder.stopped()

    # -- hooks --------------------------------------------------------------------------------

    async def _start_worker(self) -> None:
        """Start what runs the requests (a thread, nothing for an engine that runs itself)."""

    async def _drain(self, timeout_s: float | None) -> None:
        """Wait, for at most ``timeout_s``, until every admitted request has ended."""
        raise NotImplementedError

    async def _shutdown_worker(self) -> None:
        """End what is left (abort running, close waiting) and wait for the worker to exit."""
        raise NotImplementedError
