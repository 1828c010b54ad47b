"""``VllmGenerator``: a thin :class:`TextGenerator` over vLLM's async engine (GPU machines only).

vLLM does the continuous batching, KV paging, detokenization and stop strings itself; this
adapter adds batchline's admission (a cap on requests that have not produced a token yet:
beyond it ``submit`` raises ``QueueFullError`` at once, so a server answers 429 instead of
queueing without bound), the ``RecordTooLargeError`` check against the model's context, abort
on cancel, and the same :class:`GenerationStats` as the other generators.

It uses only vLLM's documented async API (``AsyncLLM`` in vLLM's V1 engine, or the older
``AsyncLLMEngine``):

- ``engine.generate(prompt, sampling_params, request_id)`` -> async iterator of
  ``RequestOutput`` (``.finished``, ``.outputs[0]`` with ``.text``, ``.token_ids`` and
  ``.finish_reason`` in ``"stop" | "length" | "abort" | None``), cumulative by default
  (``RequestOutputKind.CUMULATIVE``): each output holds the whole text so far;
- ``await engine.abort(request_id)``.

The prompt is passed as token ids (``{"prompt_token_ids": [...]}``, vLLM's ``TokensPrompt``).
vLLM is imported lazily, only by :meth:`VllmGenerator.from_engine_args` and the default
sampling-parameter conversion. **Not exercised against a real vLLM here** (vLLM is CUDA-only):
the tests drive it with a stand-in object of the same shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, Self, cast

from batchline._batcher import State
from batchline._errors import BatcherClosedError, ModelError, QueueFullError
from batchline.models.generation.engine import FinishReason, SamplingParams
from batchline.models.generation.stats import (
    GenerationStats,
    GenerationStatsRecorder,
    MonotonicClock,
    NowClock,
)
from batchline.models.generation.stream import (
    Completion,
    GenerationDelta,
    GenerationStream,
    TextGenerator,
    check_submit,
)

__all__ = ["VllmCompletionOutput", "VllmEngine", "VllmGenerator", "VllmRequestOutput"]


class VllmCompletionOutput(Protocol):
    """The fields batchline reads from vLLM's ``CompletionOutput``."""

    @property
    def text(self) -> str: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def finish_reason(self) -> str | None: ...


class VllmRequestOutput(Protocol):
    """The fields batchline reads from vLLM's ``RequestOutput``."""

    @property
    def outputs(self) -> Sequence[VllmCompletionOutput]: ...

    @property
    def finished(self) -> bool: ...


class VllmEngine(Protocol):
    """The part of ``vllm.AsyncLLMEngine`` / ``vllm.v1.engine.async_llm.AsyncLLM`` used here."""

    def generate(
        self, prompt: Mapping[str, list[int]], sampling_params: object, request_id: str
    ) -> AsyncIterator[VllmRequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...


def to_vllm_sampling_params(params: SamplingParams) -> object:
    """batchline's :class:`SamplingParams` as ``vllm.SamplingParams`` (imports vLLM)."""
    vllm = importlib.import_module("vllm")
    structured: dict[str, Any] = {}
    if params.constraint is not None:
        options = importlib.import_module("vllm.sampling_params").StructuredOutputsParams
        structured["structured_outputs"] = options(**params.constraint.vllm_options())
    return cast(
        object,
        vllm.SamplingParams(
            n=1,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            stop=list(params.stop),
            ignore_eos=params.ignore_eos,
            **structured,
        ),
    )


def _finish_reason(raw: str | None) -> FinishReason:
    if raw in ("stop", "length", "abort"):
        return cast(FinishReason, raw)
    return "stop"


class VllmGenerator:
    """:class:`TextGenerator` over a vLLM async engine.

    Example (on a GPU machine with vLLM)::

        gen = VllmGenerator.from_engine_args("HuggingFaceTB/SmolLM2-135M-Instruct")
        async with gen:
            completion = await gen.submit(ids, SamplingParams(max_tokens=64)).result()

    Args:
        engine: the vLLM engine (or anything with its ``generate``/``abort`` shape).
        max_context_tokens: the model's ``max_model_len``; longer requests are refused.
        max_waiting: requests submitted that have not produced a token yet, at most (vLLM's
            own queue included); beyond, ``submit`` raises ``QueueFullError``.
        sampling_params_factory: turns batchline's ``SamplingParams`` into what ``generate``
            takes (default: :func:`to_vllm_sampling_params`).
        shutdown_engine: call the engine's ``shutdown()`` on ``stop()`` (set when this object
            built the engine).
    """

    def __init__(
        self,
        engine: VllmEngine,
        *,
        max_context_tokens: int,
        max_waiting: int = 1_024,
        sampling_params_factory: Callable[[SamplingParams], object] | None = None,
        clock: NowClock | None = None,
        shutdown_engine: bool = False,
        name: str = "vllm",
    ) -> None:
        if max_context_tokens < 2:
            raise ValueError(f"max_context_tokens must be >= 2, got {max_context_tokens}")
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self._engine = engine
        self._max_context = max_context_tokens
        self.max_waiting = max_waiting
        self._to_params = (
            sampling_params_factory
            if sampling_params_factory is not None
            else to_vllm_sampling_params
        )
        self._clock: NowClock = clock if clock is not None else MonotonicClock()
        self._recorder = GenerationStatsRecorder(self._clock)
        self._shutdown_engine = shutdown_engine
        self.name = name
        self._state = State.NEW
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._waiting: set[str] = set()
        self._running: set[str] = set()
        self._ids = itertools.count()
        self._stop_task: asyncio.Task[None] | None = None

    @classmethod
    def from_engine_args(
        cls, model: str, *, max_waiting: int = 1_024, **engine_args: object
    ) -> VllmGenerator:
        """Build vLLM's async engine for ``model`` (``AsyncEngineArgs(model=..., **engine_args)``)
        and wrap it. Needs ``vllm`` and a GPU."""
        try:
            vllm = importlib.import_module("vllm")
        except ImportError as exc:
            raise ModelError(
                "VllmGenerator needs vLLM (pip install vllm; CUDA machines only)"
            ) from exc
        args = vllm.AsyncEngineArgs(model=model, **engine_args)
        try:
            engine_cls = importlib.import_module("vllm.v1.engine.async_llm").AsyncLLM
        except (ImportError, AttributeError):
            engine_cls = vllm.AsyncLLMEngine
        engine = engine_cls.from_engine_args(args)
        max_len = int(engine.model_config.max_model_len)
        return cls(
            cast(VllmEngine, engine),
            max_context_tokens=max_len,
            max_waiting=max_waiting,
            shutdown_engine=True,
        )

    @property
    def max_context_tokens(self) -> int:
        return self._max_context

    @property
    def stats(self) -> GenerationStats:
        return self._recorder.snapshot(
            running=len(self._running), waiting=len(self._waiting), kv_reserved=0
        )

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._state is not State.NEW:
            raise RuntimeError(f"{self.name} is {self._state.value}; a generator starts once")
        self._state = State.RUNNING
        self._recorder.started()

    async def stop(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Refuse new requests; with ``drain`` wait for admitted ones (at most ``timeout_s``),
        then abort what is left (requests with no token yet fail with ``BatcherClosedError``)."""
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
        tasks = list(self._tasks.values())
        if drain and tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        left = [t for t in self._tasks.values() if not t.done()]
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left)
        if self._shutdown_engine:
            shutdown = getattr(self._engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
        self._state = State.STOPPED
        self._recorder.stopped()

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationStream:
        """Start one request in vLLM now or raise (see :class:`TextGenerator`)."""
        rid = request_id if request_id is not None else f"{self.name}-{next(self._ids)}"
        prompt = list(
            check_submit(
                name=self.name,
                state=self._state,
                request_id=rid,
                in_use=self._tasks,
                prompt_ids=prompt_ids,
                params=params,
                max_context_tokens=self._max_context,
                kv_token_budget=None,
                on_reject=self._recorder.on_reject,
            )
        )
        if len(self._waiting) >= self.max_waiting:
            self._recorder.on_reject()
            raise QueueFullError(
                f"{self.name}: {len(self._waiting)} requests are waiting for their first token "
                f"(max_waiting={self.max_waiting}); retry later or raise max_waiting"
            )
        stream = GenerationStream(rid, len(prompt), on_abort=self._abort)
        self._waiting.add(rid)
        self._recorder.on_submit(len(prompt))
        task = asyncio.get_running_loop().create_task(
            self._run(rid, prompt, params, stream, self._clock.now()), name=f"{self.name}-{rid}"
        )
        self._tasks[rid] = task
        task.add_done_callback(lambda _: self._tasks.pop(rid, None))
        return stream

    def _abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    async def _run(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        stream: GenerationStream,
        submitted_at: float,
    ) -> None:
        recorder = self._recorder
        first_at: float | None = None
        last_at: float | None = None
        ids: tuple[int, ...] = ()
        text = ""
        try:
            outputs = self._engine.generate(
                {"prompt_token_ids": prompt}, self._to_params(params), rid
            )
            async for out in outputs:
                now = self._clock.now()
                completion_out = out.outputs[0]
                new_ids = tuple(completion_out.token_ids[len(ids) :])
                new_text = completion_out.text[len(text) :]
                ids = tuple(completion_out.token_ids)
                text = completion_out.text
                if new_ids:
                    recorder.on_tokens(
                        len(new_ids),
                        first_after_s=now - submitted_at if first_at is None else None,
                        gap_s=None if last_at is None else now - last_at,
                    )
                    if first_at is None:
                        first_at = now
                        self._waiting.discard(rid)
                        self._running.add(rid)
                    last_at = now
                if out.finished:
                    reason = _finish_reason(completion_out.finish_reason)
                    stream._push(GenerationDelta(new_text, new_ids, True, reason))
                    self._finish(stream, reason, text, ids, submitted_at, first_at, now)
                    return
                stream._push(GenerationDelta(new_text, new_ids))
            # the iterator ended without a finished output: vLLM aborted it
            now = self._clock.now()
            stream._push(GenerationDelta("", (), True, "abort"))
            self._finish(stream, "abort", text, ids, submitted_at, first_at, now)
        except asyncio.CancelledError:
            # abort(), a cancelled client or stop(): tell vLLM (idempotent), end the stream
            with contextlib.suppress(Exception):
                await self._engine.abort(rid)
            now = self._clock.now()
            if self._state is not State.RUNNING and first_at is None:
                if stream._fail(BatcherClosedError(f"{self.name} stopped before this request ran")):
                    recorder.on_end("failed")
            else:
                stream._push(GenerationDelta("", (), True, "abort"))
                self._finish(stream, "abort", text, ids, submitted_at, first_at, now)
        except Exception as exc:
            error = ModelError(f"{self.name}: vLLM failed on request {rid!r}: {exc!r}")
            error.__cause__ = exc
            if stream._fail(error):
                recorder.on_end("failed")
        finally:
            self._waiting.discard(rid)
            self._running.discard(rid)

    def _finish(
        self,
        stream: GenerationStream,
        reason: FinishReason,
        text: str,
        ids: tuple[int, ...],
        submitted_at: float,
        first_at: float | None,
        now: float,
    ) -> None:
        completion = Completion(
            text=text,
            token_ids=ids,
            prompt_tokens=stream.prompt_tokens,
            completion_tokens=len(ids),
            finish_reason=reason,
            ttft_s=None if first_at is None else first_at - submitted_at,
            latency_s=now - submitted_at,
        )
        if stream._complete(completion):
            if reason == "abort":
                self._recorder.on_end("aborted")
            else:
                self._recorder.on_end("completed", completion.latency_s)


if TYPE_CHECKING:  # mypy proves it implements the request-level protocol

    def _is_text_generator(g: VllmGenerator) -> TextGenerator:
        return g
