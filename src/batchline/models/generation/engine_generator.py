"""What the engine-driven generators (:class:`~.continuous.ContinuousGenerator`,
:class:`~.static.StaticGenerator`) share: request checks and the registry of live requests on
the event loop, one engine step and its outputs turned into stream updates on the engine's
thread, and the delivery of those updates back to the event loop (one wake-up per step).

An engine whose steps a :class:`~.step_scheduler.StepScheduler` plans (the torch engine) is
stepped through :func:`~.step_scheduler.run_step`, so the generator knows from each step's
plan whether it only decoded; any other :class:`~.engine.StepEngine` through ``step()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import time
from collections.abc import Callable, Mapping, Sequence

from batchline._batcher import State
from batchline._errors import ConstraintError, InputError, ModelError
from batchline.models.generation.engine import (
    GenerationRequest,
    SamplingParams,
    StepEngine,
    StepOutput,
)
from batchline.models.generation.lifecycle import GeneratorLifecycle
from batchline.models.generation.stats import (
    GenerationStatsRecorder,
    MonotonicClock,
    NowClock,
)
from batchline.models.generation.step_scheduler import Planned, run_step
from batchline.models.generation.stream import (
    Detokenizer,
    GenerationStream,
    IncrementalDetokenizer,
    StepUpdate,
    TrackedSequence,
)

__all__ = ["EngineGenerator", "Update", "check_min"]

Update = tuple[TrackedSequence, "StepUpdate | BaseException"]


def check_min(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class EngineGenerator(GeneratorLifecycle):
    """What the engine-driven generators share: request checks, the registry of live requests,
    the running sequences and those marked to abort (under the subclass's lock), per-step
    output handling on the engine's thread and delivery to the event loop."""

    def __init__(
        self,
        engine: StepEngine,
        detokenizer: Detokenizer,
        *,
        kv_token_budget: int,
        clock: NowClock | None,
        name: str,
    ) -> None:
        self._engine = engine
        self._detokenizer = detokenizer
        self._eos = frozenset(engine.eos_token_ids)
        self._kv_budget = kv_token_budget
        self._clock: NowClock = clock if clock is not None else MonotonicClock()
        super().__init__(
            name, GenerationStatsRecorder(self._clock, kv_token_budget=kv_token_budget)
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, TrackedSequence] = {}
        self._idle: asyncio.Event | None = None
        self._ids = itertools.count()
        self._running: dict[str, TrackedSequence] = {}
        self._reserved = 0
        self._to_abort: set[str] = set()
        self._abort_all = False
        #: an engine whose steps are planned by a :class:`~.step_scheduler.StepScheduler`:
        #: stepped through :func:`~.step_scheduler.run_step`, so the plan of each is known
        self._planned = engine if isinstance(engine, Planned) else None
        #: whether the last step only decoded, by its plan (None: the engine does not say)
        self._decode_only: bool | None = None
        #: ``f(started, running)``, called on the engine's thread after every step, when set
        #: (the server's traces: ``batchline.server.tracing.StepTracer``); each sequence then
        #: keeps the context it was submitted in (``TrackedSequence.context``).
        self.step_observer: Callable[[float, Mapping[str, TrackedSequence]], None] | None = None
        #: ``f(updates)``, on the event loop with each delivery (one per step), when set: the
        #: deltas go to it, not into the streams (the engine process sends them to its parent).
        self.outlet: Callable[[list[Update]], None] | None = None

    @property
    def max_context_tokens(self) -> int:
        return self._engine.max_context_tokens

    @property
    def kv_token_budget(self) -> int:
        return self._kv_budget

    @property
    def vocab_size(self) -> int | None:
        """The engine's ``vocab_size``, where it says one (the torch engine does)."""
        vocab = getattr(self._engine, "vocab_size", None)
        return vocab if isinstance(vocab, int) else None

    def _kv_limit(self) -> int | None:
        return self._kv_budget

    async def start(self) -> None:
        if self._state is State.NEW:  # a second start raises in the base, touching nothing
            self._loop = asyncio.get_running_loop()
            self._idle = asyncio.Event()
            self._idle.set()
        await super().start()

    async def _drain(self, timeout_s: float | None) -> None:
        assert self._idle is not None
        if self._live:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout_s)

    # -- hooks for subclasses ---------------------------------------------------------------

    def _abort(self, request_id: str) -> None:
        raise NotImplementedError

    # -- submit side (event loop) -----------------------------------------------------------

    def _new_sequence(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None
    ) -> TrackedSequence:
        rid = request_id if request_id is not None else f"{self.name}-{next(self._ids)}"
        prompt = self._admissible(rid, self._live, prompt_ids, params)
        request = GenerationRequest(rid, prompt, params)
        stream = GenerationStream(rid, len(prompt), on_abort=self._abort)
        return TrackedSequence(
            request,
            stream,
            self._clock.now(),
            self._eos,
            IncrementalDetokenizer(self._detokenizer, prompt),
            context=None if self.step_observer is None else contextvars.copy_context(),
        )

    def _register(self, seq: TrackedSequence) -> None:
        self._live[seq.request_id] = seq
        self._recorder.on_submit(len(seq.request.prompt_ids))
        assert self._idle is not None
        self._idle.clear()

    # -- delivery (event loop) --------------------------------------------------------------

    def _post(self, updates: list[Update]) -> None:
        """From the worker thread: hand updates to the event loop (one wake-up)."""
        if not updates:
            return
        loop = self._loop
        assert loop is not None
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
            loop.call_soon_threadsafe(self._deliver, updates)

    def _deliver(self, updates: list[Update]) -> None:
        recorder = self._recorder
        outlet = self.outlet
        for seq, update in updates:
            stream = seq.stream
            if isinstance(update, BaseException):
                if stream._fail(update):
                    recorder.on_end("failed")
                    self._live.pop(seq.request_id, None)
                continue
            if outlet is None:
                stream._push(update.delta)
            completion = update.completion
            if completion is not None and stream._complete(completion):
                if completion.finish_reason == "abort":
                    recorder.on_end("aborted")
                else:
                    recorder.on_end("completed", completion.latency_s)
                self._live.pop(seq.request_id, None)
        if outlet is not None:
            outlet(updates)
        if not self._live and self._idle is not None:
            self._idle.set()

    # -- the engine's thread ----------------------------------------------------------------

    def _step(self, running: Mapping[str, TrackedSequence]) -> tuple[list[Update], list[str]]:
        """Run one engine step; return the updates and the ids of sequences that ended.

        Raises what ``engine.step()`` raised.
        """
        observer = self.step_observer
        started = time.perf_counter() if observer is not None else 0.0
        outputs: Sequence[StepOutput]
        planned = self._planned
        if planned is None:
            outputs = self._engine.step()
            self._decode_only = None
        else:  # the engine's scheduler plans, the engine executes: the plan says what ran
            plan, outputs = run_step(planned.scheduler, planned)
            self._decode_only = plan.decode_only
        now = self._clock.now()
        kv_in_use = self._engine.kv_tokens_in_use()  # before a stop string's abort frees any
        updates: list[Update] = []
        ended: list[str] = []
        tokens = 0
        ttft: list[float] = []
        itl: list[float] = []
        for out in outputs:
            seq = running.get(out.request_id)
            if seq is None or seq.finished:
                continue
            if out.error is not None:
                # its grammar gave up: a failure, never a "stop"; the reason alone (logged)
                seq.finished = True
                error = ConstraintError(out.error)
                updates.append((seq, error))
                ended.append(seq.request_id)
                continue
            if out.token_ids:
                tokens += len(out.token_ids)
                last = seq.last_token_at
                if last is None:
                    ttft.append(now - seq.submitted_at)
                else:
                    itl.append(now - last)
            update = seq.advance(out, now)
            if update.stop_hit and not out.finished:
                # a stop string ended it: free its slot before the next step
                self._engine.abort(seq.request_id)
            updates.append((seq, update))
            if update.delta.finished:
                ended.append(seq.request_id)
        self._recorder.on_step(len(outputs), kv_in_use, tokens=tokens, ttft=ttft, itl=itl)
        if observer is not None:
            observer(started, running)
        return updates, ended

    def _kv_now(self) -> None:
        """Sequences left the engine between steps (aborted, timed out, failed), and no step
        may follow soon: record what it holds now, so the gauge returns to zero with them."""
        with contextlib.suppress(Exception):  # best effort: the engine may be in trouble
            self._recorder.on_kv_in_use(self._engine.kv_tokens_in_use())

    def _end(self, seq: TrackedSequence) -> Update:
        """Abort ``seq`` (already out of the engine) with what it has produced."""
        return (seq, seq.end("abort", self._clock.now()))

    def _take_aborted(self) -> list[TrackedSequence]:
        """The running sequences marked to abort, out of the running set and the engine (under
        the lock); nothing is marked afterwards."""
        seqs = [s for rid in self._to_abort if (s := self._running.pop(rid, None)) is not None]
        for seq in seqs:
            self._engine.abort(seq.request_id)
        self._to_abort.clear()
        return seqs

    def _refused(self, exc: Exception) -> Exception:
        """The error of a request the engine's ``add_request`` refused: a ``ValueError`` is
        the request's own fault (a token id outside the vocabulary), anything else the
        model's."""
        error: Exception
        if isinstance(exc, ValueError):
            error = InputError(str(exc))  # the client reads it: no internal names
        else:
            error = ModelError(f"{self.name}: add_request: {exc!r}")
        error.__cause__ = exc
        return error

    def _engine_failed(self, exc: Exception, seqs: Sequence[TrackedSequence]) -> list[Update]:
        """The engine raised in a step: drop its sequences and fail their requests."""
        n = len(seqs)
        updates: list[Update] = []
        for seq in seqs:
            with contextlib.suppress(Exception):  # best effort: the engine is in trouble
                self._engine.abort(seq.request_id)
            error = ModelError(
                f"{self.name}: the engine raised during a step ({exc!r}); the {n} request(s) "
                "running in that step failed; new requests are still served"
            )
            error.__cause__ = exc
            updates.append((seq, error))
        return updates
