"""Continuous (iteration-level) batching over a :class:`StepEngine`.

One worker thread drives ``engine.step()``. Between two steps, finished sequences have left
(the engine frees them in the step that finishes them), aborted ones are removed, and waiting
requests join, so a short request never waits for a long one to end.

Scheduling policy of :class:`ContinuousGenerator`:

1. **Caps.** At most ``max_running`` sequences are in the engine, and the sum of their
   *reservations* never exceeds ``kv_token_budget``. With ``start_running`` below
   ``max_running``, the cap between them is measured instead of assumed: it starts at
   ``start_running``, and while requests wait and the engine runs as many rows as the cap
   allows, it rises one row at a time for as long as a row's marginal cost in a decode step
   stays within ``row_cost_ratio`` of an average row's (:class:`~.admission.RowCost`, from
   the decode-only steps' own times). Until the row counts around the cap are measured
   (4 rows apart, 8 steps each) it rises to measure them. When one more row would not pay,
   the cap falls back to the last row that did (to ``start_running`` if none did); the counts
   above it count for 256 decode steps, then are measured again (the device may have been
   busy with other work). A running sequence is never evicted when the cap falls: fewer
   join.
2. **Worst-case reservation, no preemption.** Admission reserves ``len(prompt) + max_tokens``
   KV positions per request, released when it finishes or aborts. A sequence is therefore
   never evicted mid-way (``preempted`` stays 0, no recompute is ever wasted), at the price of
   admitting fewer sequences than an optimistic scheduler while outputs are shorter than
   ``max_tokens`` (vLLM reserves per block as tokens arrive and preempts by recompute instead).
3. **Aged priority, then FCFS, with bounded overtaking.** Waiting requests are considered in
   the core queue's order (``batchline._priority.aged_rank``, the same function): a request of
   priority ``p`` (``SamplingParams.priority``, higher first) ranks as if it had arrived
   ``p * priority_aging_s`` seconds earlier, so with the server's classes and the default 10 s
   an ``interactive`` request joins before ``batch`` ones queued less than 10 s before it, and
   after older ones; equal ranks keep their arrival order (``priority_aging_s=None``: strict
   priority, which can starve the lower class). One whose reservation does not fit now is
   skipped and later-ranked ones that fit may go ahead of it, but each admission ahead of it
   counts one *overtake*. Once a request has been overtaken ``max_overtakes`` times, nothing
   ranked behind it is admitted until it fits: the running sequences end within their
   ``max_tokens`` steps, so it waits a bounded number of steps. A blocked ``batch`` request
   holds back only what ranks behind it: an ``interactive`` one that ranks ahead of it (it
   arrived less than ``priority_aging_s`` after it) still joins, and is no overtake; one that
   ranks behind it (it arrived later than that) waits those bounded steps. A request's rank
   never changes while it waits, and a new arrival ranks at its arrival time minus at most
   ``priority_aging_s`` times the priority gap, so every request is eventually first: nothing
   starves. Running sequences are never preempted for a higher-priority arrival: priority
   decides who joins, not who stays (a prompt already admitted also finishes its chunked
   prefill before a later-admitted one, in the engine).
4. **Aborts** (``stream.abort()``, a cancelled waiter, a stop string) take effect before the
   next step: the slot and the reservation are free for that step's admissions.
5. **Engine errors fail open.** An exception from ``engine.step()`` fails the requests that
   were running in that step with ``ModelError`` (their sequences are aborted in the engine)
   and the generator goes on serving waiting and new requests.

The thread sleeps on a condition variable while there is nothing to do (no busy-spin); results
reach the event loop with one ``loop.call_soon_threadsafe`` per step.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import contextvars
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from batchline._batcher import State
from batchline._errors import (
    BatcherClosedError,
    ConstraintError,
    InputError,
    ModelError,
    QueueFullError,
)
from batchline._priority import aged_rank
from batchline.models.generation.admission import RowCost
from batchline.models.generation.engine import (
    GenerationRequest,
    PrefixCaching,
    SamplingParams,
    StepEngine,
    StepOutput,
)
from batchline.models.generation.lifecycle import GeneratorLifecycle
from batchline.models.generation.stats import (
    GenerationStats,
    GenerationStatsRecorder,
    MonotonicClock,
    NowClock,
)
from batchline.models.generation.stream import (
    Detokenizer,
    GenerationStream,
    IncrementalDetokenizer,
    StepUpdate,
    TextGenerator,
    TrackedSequence,
    check_submit,
)

__all__ = ["ContinuousGenerator", "EngineGenerator"]

Update = tuple[TrackedSequence, "StepUpdate | BaseException"]


def _check_min(name: str, value: int, minimum: int = 1) -> None:
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
        prompt = check_submit(
            name=self.name,
            state=self._state,
            request_id=rid,
            in_use=self._live,
            prompt_ids=prompt_ids,
            params=params,
            max_context_tokens=self._engine.max_context_tokens,
            kv_token_budget=self._kv_budget,
            on_reject=self._recorder.on_reject,
        )
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
        outputs: Sequence[StepOutput] = self._engine.step()
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


@dataclass(eq=False, slots=True)
class _Waiting:
    seq: TrackedSequence
    #: the admission order: (aged rank, arrival number), lowest first
    key: tuple[float, int]
    overtaken: int = 0


class ContinuousGenerator(EngineGenerator):
    """Iteration-level batching: sequences join and leave the running batch between steps.

    >>> from batchline.models.generation.fake import FakeEngine, FakeTokenizer
    >>> async def main() -> str:
    ...     tok = FakeTokenizer()
    ...     async with ContinuousGenerator(FakeEngine(), tok, max_running=4) as gen:
    ...         stream = gen.submit(tok.encode("2 + 3 ="), SamplingParams(max_tokens=8))
    ...         return (await stream.result()).text

    Args:
        engine: the model (not thread-safe: only this generator's worker thread calls it).
        detokenizer: ``decode(ids) -> str``, e.g. a ``tokenizers.Tokenizer``.
        max_running: sequences in the engine at once, at most.
        start_running: where the cap starts and the least it falls to; between it and
            ``max_running`` the measured cost of a row moves it (the module's policy). None, or
            ``max_running`` or more: the cap is ``max_running``, fixed.
        row_cost_ratio: a row pays while its marginal step cost is at most this share of an
            average row's.
        kv_token_budget: the sum of running sequences' ``len(prompt) + max_tokens``, at most;
            a request that exceeds it alone is refused with ``RecordTooLargeError``.
        max_waiting: requests waiting for admission, at most; beyond, ``submit`` raises
            ``QueueFullError``.
        max_overtakes: how many later-ranked requests may be admitted ahead of one that does
            not fit before it blocks admission until it fits (see the module's policy).
        priority_aging_s: seconds of waiting worth one point of ``SamplingParams.priority``,
            as the batcher's knob of that name (``None``: strict priority, which can starve
            low priorities).
        clock: where timings are read (any thread); default ``time.monotonic``.
    """

    def __init__(
        self,
        engine: StepEngine,
        detokenizer: Detokenizer,
        *,
        max_running: int = 16,
        start_running: int | None = None,
        row_cost_ratio: float = 0.8,
        kv_token_budget: int = 16_384,
        max_waiting: int = 1_024,
        max_overtakes: int = 16,
        priority_aging_s: float | None = 10.0,
        clock: NowClock | None = None,
        name: str = "continuous",
    ) -> None:
        _check_min("max_running", max_running)
        if start_running is not None:
            _check_min("start_running", start_running)
        _check_min("kv_token_budget", kv_token_budget, 2)
        _check_min("max_waiting", max_waiting)
        _check_min("max_overtakes", max_overtakes, 0)
        if priority_aging_s is not None and not priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0 or None, got {priority_aging_s!r}")
        super().__init__(
            engine, detokenizer, kv_token_budget=kv_token_budget, clock=clock, name=name
        )
        self.max_running = max_running
        self.start_running = min(max_running, start_running or max_running)
        self._cap = self.start_running
        # measured only where the cap may move
        moves = self.start_running < max_running
        self._row_cost = RowCost(ratio=row_cost_ratio) if moves else None
        self._prefix_caching = isinstance(engine, PrefixCaching)  # a Protocol check: once
        self.max_waiting = max_waiting
        self.max_overtakes = max_overtakes
        self.priority_aging_s = priority_aging_s
        self._cond = threading.Condition()
        self._waiting: list[_Waiting] = []  # in admission order (see _Waiting.key)
        self._arrivals = itertools.count()
        self._exit = False
        self._thread: threading.Thread | None = None

    # -- public -----------------------------------------------------------------------------

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationStream:
        """Queue a request for admission; never waits (see :class:`TextGenerator`)."""
        seq = self._new_sequence(prompt_ids, params, request_id)
        with self._cond:
            if len(self._waiting) >= self.max_waiting:
                self._recorder.on_reject()
                raise QueueFullError(
                    f"{self.name}: {len(self._waiting)} requests are already waiting "
                    f"(max_waiting={self.max_waiting}); retry later or raise max_waiting"
                )
            bisect.insort(self._waiting, _Waiting(seq, self._rank(seq)), key=lambda w: w.key)
            self._cond.notify()
        self._register(seq)
        return seq.stream

    def _rank(self, seq: TrackedSequence) -> tuple[float, int]:
        """Where ``seq`` goes in the waiting order (under the lock: arrivals are numbered)."""
        priority = seq.request.params.priority
        aging_s = self.priority_aging_s
        arrival = next(self._arrivals)
        if aging_s is None:
            return float(-priority), arrival
        return aged_rank(priority, seq.submitted_at, aging_s), arrival

    @property
    def stats(self) -> GenerationStats:
        with self._cond:
            running, waiting, reserved = len(self._running), len(self._waiting), self._reserved
        stats = self._recorder.snapshot(running=running, waiting=waiting, kv_reserved=reserved)
        if not self._prefix_caching:
            return dataclasses.replace(stats, running_cap=self._cap)
        engine = cast("PrefixCaching", self._engine)
        return dataclasses.replace(
            stats,
            running_cap=self._cap,
            prefix_cache_tokens=engine.prefix_cache_tokens,
            prefix_cache_hits=engine.prefix_cache_hits,
            prefix_tokens_reused=engine.prefix_tokens_reused,
            prompt_tokens_computed=engine.prompt_tokens_computed,
            prompts_shared=engine.prompts_shared,
        )

    # -- lifecycle --------------------------------------------------------------------------

    async def _start_worker(self) -> None:
        self._thread = threading.Thread(
            target=self._work, name=f"batchline-{self.name}", daemon=True
        )
        self._thread.start()

    async def _shutdown_worker(self) -> None:
        with self._cond:
            if self._waiting or self._running:
                self._abort_all = True
            self._exit = True
            self._cond.notify()
        thread = self._thread
        if thread is not None:
            # the worker's last deliveries were posted before it exited: they run first
            await asyncio.to_thread(thread.join)

    def _abort(self, request_id: str) -> None:
        found: TrackedSequence | None = None
        with self._cond:
            for waiting in self._waiting:
                if waiting.seq.request_id == request_id:
                    self._waiting.remove(waiting)
                    found = waiting.seq
                    break
            else:
                if request_id in self._running:
                    self._to_abort.add(request_id)
                    self._cond.notify()
        if found is not None:
            # never reached the engine: end it here, nothing to free
            self._deliver([self._end(found)])

    # -- the worker thread ------------------------------------------------------------------

    def _move_cap_locked(self) -> None:
        """The cap one row up while the last row paid and requests wait for a row, or down to
        the rows that paid once one more would not (the module's policy, 1)."""
        cost = self._row_cost
        if cost is None:
            return
        cap = self._cap
        verdict = cost.pays(cap)
        if verdict is False:
            while cap > self.start_running and not cost.pays(cap - 1):
                cap -= 1  # that row did not pay either (or was only there to be measured)
            self._cap = cap
        elif (
            cap < self.max_running
            and self._waiting
            and len(self._running) >= cap
            and (verdict or (verdict is None and cost.measured(cap)))  # None: measure more
        ):
            self._cap = cap + 1

    def _admit_locked(self) -> list[TrackedSequence]:
        admitted: list[TrackedSequence] = []
        skipped: list[_Waiting] = []
        self._move_cap_locked()
        room = self._cap - len(self._running)
        if room <= 0:
            return admitted  # no free slot: spare the per-step copy of the waiting queue
        for waiting in list(self._waiting):
            if room <= 0:
                break
            cost = waiting.seq.kv_reservation
            if self._reserved + cost <= self._kv_budget:
                self._waiting.remove(waiting)
                self._reserved += cost
                room -= 1
                admitted.append(waiting.seq)
                for earlier in skipped:
                    earlier.overtaken += 1
            elif waiting.overtaken >= self.max_overtakes:
                break  # overtaken enough: it blocks everyone ranked behind it until it fits
            else:
                skipped.append(waiting)
        return admitted

    def _prompts_so_far(self) -> int | None:
        """The prompt tokens the engine has computed, where the cap is measured and the engine
        says (else None): unchanged across a step, the step only decoded."""
        if self._row_cost is None or not self._prefix_caching:
            return None
        return cast("PrefixCaching", self._engine).prompt_tokens_computed

    def _observe_row_cost(self, rows: int, seconds: float, prompts_before: int | None) -> None:
        """Count the step in its row count's cost if it only decoded: no request joined it,
        and the engine (where it says) computed no prompt token in it (a long prompt's later
        chunks)."""
        if self._row_cost is not None and self._prompts_so_far() == prompts_before:
            self._row_cost.observe(rows, seconds)

    def _work(self) -> None:
        try:
            self._loop_steps()
        except BaseException as exc:  # a bug here must not leave requests hanging
            with self._cond:
                seqs = [w.seq for w in self._waiting] + list(self._running.values())
                self._waiting.clear()
                self._running.clear()
                self._reserved = 0
                self._exit = True
            self._post(
                [
                    (s, ModelError(f"{self.name}: the scheduler thread failed: {exc!r}"))
                    for s in seqs
                ]
            )
            raise

    def _loop_steps(self) -> None:
        engine = self._engine
        cond = self._cond
        while True:
            updates: list[Update] = []
            with cond:
                while not (
                    self._waiting
                    or self._running
                    or self._to_abort
                    or self._abort_all
                    or self._exit
                ):
                    cond.wait()
                if self._abort_all:
                    self._abort_all = False
                    for waiting in self._waiting:
                        updates.append(
                            (waiting.seq, BatcherClosedError(f"{self.name} stopped first"))
                        )
                    self._waiting.clear()
                    self._to_abort.update(self._running)
                aborted = self._take_aborted()
                self._reserved -= sum(s.kv_reservation for s in aborted)
                updates += [self._end(s) for s in aborted]
                if aborted:
                    self._kv_now()
                if self._exit and not self._waiting and not self._running:
                    self._post(updates)
                    return
                admitted = self._admit_locked()
                joined_at = self._clock.now() if admitted else 0.0
                prompts_before = self._prompts_so_far()
                for seq in admitted:
                    try:
                        engine.add_request(seq.request)
                    except Exception as exc:
                        self._reserved -= seq.kv_reservation
                        updates.append((seq, self._refused(exc)))
                        continue
                    seq.admitted_at = joined_at  # its queue wait ends: it joins the next step
                    self._running[seq.request_id] = seq
                batch = dict(self._running)
            self._post(updates)
            if not batch:
                continue
            started = self._clock.now()
            try:
                step_updates, ended = self._step(batch)
            except Exception as exc:
                with cond:
                    failed = [s for rid, s in batch.items() if self._running.pop(rid, None)]
                    self._reserved -= sum(s.kv_reservation for s in failed)
                    updates = self._engine_failed(exc, failed)
                    self._kv_now()
                self._post(updates)
                continue
            if not admitted:
                self._observe_row_cost(len(batch), self._clock.now() - started, prompts_before)
            with cond:
                for rid in ended:
                    done = self._running.pop(rid, None)
                    if done is not None:
                        self._reserved -= done.kv_reservation
            self._post(step_updates)


if TYPE_CHECKING:  # mypy proves it implements the request-level protocol

    def _is_text_generator(g: ContinuousGenerator) -> TextGenerator:
        return g
