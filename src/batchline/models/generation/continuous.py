"""Continuous (iteration-level) batching over a :class:`StepEngine`.

One worker thread drives the engine, a step at a time (a torch engine's steps through its
:class:`~.step_scheduler.StepScheduler`: :func:`~.step_scheduler.run_step`; any other engine's
through ``engine.step()``). Between two steps, finished sequences have left
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
   KV positions per request, released when it finishes or aborts. Where the engine's store is
   one rectangle of its rows (:class:`~.engine.KvRectangle`: the torch engine's), a request
   also joins only while that rectangle stays within :data:`KV_STORE_FACTOR` times the budget
   (alone, it always joins): a long prompt then runs beside fewer short ones. A sequence is
   therefore never evicted mid-way (``preempted`` stays 0, no recompute is ever wasted), at
   the price of admitting fewer sequences than an optimistic scheduler while outputs are
   shorter than ``max_tokens`` (vLLM reserves per block as tokens arrive and preempts by
   recompute instead).
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
import dataclasses
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from batchline._errors import (
    BatcherClosedError,
    ModelError,
    QueueFullError,
)
from batchline._priority import aged_rank
from batchline.models.generation.admission import RowCost
from batchline.models.generation.engine import (
    GenerationRequest,
    KvRectangle,
    PrefixCaching,
    SamplingParams,
    StepEngine,
)
from batchline.models.generation.engine_generator import EngineGenerator, Update, check_min
from batchline.models.generation.lifecycle import duplicated
from batchline.models.generation.stats import (
    GenerationStats,
    NowClock,
)
from batchline.models.generation.stream import (
    Detokenizer,
    GenerationStream,
    TextGenerator,
    TrackedSequence,
)

__all__ = ["KV_STORE_FACTOR", "ContinuousGenerator", "EngineGenerator"]

#: An engine whose KV store is one rectangle of its running rows (:class:`~.engine.KvRectangle`)
#: admits a row only while that rectangle stays within this many times ``kv_token_budget``
#: positions (a row alone always joins). Without it one long prompt beside many short ones made
#: the store every row as wide as the longest: a 360M served one 1,800-token prompt among 40
#: short ones and its process grew to 18.8 GB for a budget of 16,384 positions (1.3 GB of
#: them; Zen 5, 2026-12-05). At 4 rows of equal length join as the budget alone lets them: the
#: store's slots and columns are powers of two, each under twice what the rows need (the
#: columns under four times the longest row), so for a budget that is a power of two too (the
#: default) their product stays within 4 times it.
KV_STORE_FACTOR = 4


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
        check_min("max_running", max_running)
        if start_running is not None:
            check_min("start_running", start_running)
        check_min("kv_token_budget", kv_token_budget, 2)
        check_min("max_waiting", max_waiting)
        check_min("max_overtakes", max_overtakes, 0)
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
        self._rectangle = engine if isinstance(engine, KvRectangle) else None
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
        self._queue([seq])
        return seq.stream

    def submit_many(self, requests: Sequence[GenerationRequest]) -> list[GenerationStream]:
        """Queue every request for admission, or none, under one hold of the lock: the worker
        sees them all at its next admission (see :class:`TextGenerator`)."""
        duplicated(requests)
        seqs = [self._new_sequence(r.prompt_ids, r.params, r.request_id) for r in requests]
        self._queue(seqs)
        return [seq.stream for seq in seqs]

    def _queue(self, seqs: Sequence[TrackedSequence]) -> None:
        """Put checked sequences in the waiting order together, or raise ``QueueFullError``
        and put none."""
        with self._cond:
            if len(self._waiting) + len(seqs) > self.max_waiting:
                self._recorder.on_reject()
                asked = "" if len(seqs) == 1 else f"; {len(seqs)} asked at once"
                raise QueueFullError(
                    f"{self.name}: {len(self._waiting)} requests are already waiting "
                    f"(max_waiting={self.max_waiting}){asked}; retry later or raise max_waiting"
                )
            for seq in seqs:
                bisect.insort(self._waiting, _Waiting(seq, self._rank(seq)), key=lambda w: w.key)
            self._cond.notify()
        for seq in seqs:
            self._register(seq)

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
        rows = len(self._running)
        longest = max((s.kv_reservation for s in self._running.values()), default=0)
        for waiting in list(self._waiting):
            if room <= 0:
                break
            cost = waiting.seq.kv_reservation
            fits = self._reserved + cost <= self._kv_budget
            if fits and rows and self._rectangle is not None:  # a row alone always joins
                wide = self._rectangle.kv_positions_with(rows + 1, max(longest, cost))
                fits = wide <= KV_STORE_FACTOR * self._kv_budget
            if fits:
                self._waiting.remove(waiting)
                self._reserved += cost
                room -= 1
                rows, longest = rows + 1, max(longest, cost)
                admitted.append(waiting.seq)
                for earlier in skipped:
                    earlier.overtaken += 1
            elif waiting.overtaken >= self.max_overtakes:
                break  # overtaken enough: it blocks everyone ranked behind it until it fits
            else:
                skipped.append(waiting)
        return admitted

    def _observe_row_cost(self, rows: int, seconds: float) -> None:
        """Count the step in its row count's cost if it only decoded: no request joined it,
        and its plan (where the engine's steps are planned) prefilled no prompt piece (a long
        prompt's later chunks)."""
        if self._row_cost is not None and self._decode_only is not False:
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
                self._observe_row_cost(len(batch), self._clock.now() - started)
            with cond:
                for rid in ended:
                    done = self._running.pop(rid, None)
                    if done is not None:
                        self._reserved -= done.kv_reservation
            self._post(step_updates)


if TYPE_CHECKING:  # mypy proves it implements the request-level protocol

    def _is_text_generator(g: ContinuousGenerator) -> TextGenerator:
        return g
