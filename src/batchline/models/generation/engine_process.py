"""``ProcessGenerator``: a :class:`~.stream.TextGenerator` whose engine runs in a process of its
own, so that the engine never waits for the GIL behind the HTTP front end (vLLM's EngineCore
is the model).

The engine process (:mod:`.engine_child`) loads the model and runs its generator as
``load_text_generator`` builds it in-process (the continuous scheduler over the torch engine,
its detokenizer and stop strings); this process keeps the tokenizer, the
:class:`~.stream.GenerationStream` objects and the event loop. ``load_text_generator`` builds
one when ``Knobs.engine_process`` is set::

    model = load_text_generator(parse_spec("smollm2"), Knobs(engine_process=True))
    async with model.generator as gen:            # the engine process is already loaded
        completion = await gen.submit(model.encode("Hi"), SamplingParams()).result()
    model.close()

Behaviour, as the in-process generator's unless said here:

- **Start.** ``launch()`` spawns the process (``spawn``, never ``fork``: torch's threads), which
  loads the model while this process loads the tokenizer; ``wait_ready()`` waits for it and
  logs the start time (:attr:`ProcessGenerator.start_s`, also ``engine_start_s`` in the model
  info's details). A load that fails raises here, as the same error type. Spawning imports the
  main module: a script of one's own needs ``if __name__ == "__main__":``.
- **Submit** never waits: the request checks run here (the context and KV budget the engine
  process reported), and ``QueueFullError`` comes once ``max_waiting + max_running`` requests
  are in flight (the engine process's own waiting cap then never refuses one; if it does, with
  the cap that the measured cost of a row moves below ``max_running``, the stream fails with
  ``QueueFullError``). Messages to the engine process go through a writer thread: a full pipe
  never blocks the event loop.
- **Outputs** arrive one message per engine step, read on the event loop (``add_reader``),
  each delivered in one pass; an error raised in the engine process (a failed step, a refused
  request, a grammar given up on) fails the stream with the same type and message. The
  completions' times are the engine process's, from when it received the request.
- **Abort**, drain and ``stop(drain=False)`` are forwarded; priorities travel with
  ``SamplingParams``. The engine process exits once its generator has stopped.
- **Stats**: the request counters are counted here, the engine's fields (steps, tokens, TTFT,
  KV, the cap) come from the engine process, at most :data:`~.engine_child.STATS_EVERY_S` old
  while requests run and current whenever none is left; :meth:`ProcessGenerator.fetch_stats`
  asks for them now.
- **An engine process that dies** (killed, crashed) fails every request in flight with an
  ``EngineGoneError`` naming its exit code; later submits raise it too, and
  :attr:`ProcessGenerator.gone` says why (a server's ``/ready`` and ``/health`` answer 503 on
  it). Nothing else in this process is touched: a server goes on serving its other models.
  It ignores SIGINT and SIGTERM (see :mod:`.engine_child`); one this process never stopped is
  killed when it exits.
- The engine's steps do not reach the server's traces (no ``step_observer``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from batchline._errors import EngineGoneError, ModelError, QueueFullError
from batchline.models.generation.engine import GenerationRequest, SamplingParams
from batchline.models.generation.engine_child import (
    LoadedModel,
    Ready,
    from_wire,
    run_engine_process,
)
from batchline.models.generation.lifecycle import GeneratorLifecycle, duplicated
from batchline.models.generation.stats import (
    GenerationStats,
    GenerationStatsRecorder,
    MonotonicClock,
)
from batchline.models.generation.stream import (
    Completion,
    GenerationStream,
    TextGenerator,
)

__all__ = ["ProcessGenerator"]

logger = logging.getLogger("batchline.generation")

#: How long a stopped engine process may take to exit (it has already answered "stopped", or
#: the drain's own timeout has passed) before it is killed.
EXIT_GRACE_S = 30.0

#: Engine processes launched and maybe still running, for :func:`_kill_at_exit`.
_launched: set[BaseProcess] = set()


def _kill_at_exit() -> None:
    """At this process's exit, kill the engine processes never stopped: they ignore SIGTERM
    (a signal to the whole process group must not cut a drain short), which is how
    ``multiprocessing``'s own exit hook, run after this one, would end them before joining."""
    for process in _launched:
        if process.is_alive():
            process.kill()


class ProcessGenerator(GeneratorLifecycle):
    """A text generator whose engine and scheduler run in a process of its own.

    Made by :meth:`launch` (``load_text_generator`` does it when ``Knobs.engine_process`` is
    set); see the module docstring for what differs from the in-process generator. Call
    :meth:`close` once it has stopped (``GenerationModel.close`` does): it ends an engine
    process that is still there (a generator never started).
    """

    def __init__(
        self, process: BaseProcess, conn: Connection, *, name: str, launched_at: float
    ) -> None:
        # the engine process's generator reads time.monotonic too: one clock on both sides
        super().__init__(name, GenerationStatsRecorder(MonotonicClock()))
        self._process = process
        self._conn = conn
        self._launched_at = launched_at
        self._ready: Ready | None = None
        #: seconds from launch() to the engine process's "ready" (spawn, imports, the load)
        self.start_s = 0.0
        self._flights: dict[str, GenerationStream] = {}
        self._ids = itertools.count()
        self._child_stats = GenerationStats()
        self._stats_waiters: list[asyncio.Future[None]] = []
        self._outbox: queue.SimpleQueue[tuple[object, ...] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = False
        self._stop_sent = False
        self._stop_timeout_s: float | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._gone: str | None = None  # why submits fail: the engine process exited
        self._closed = False

    @classmethod
    def launch(
        cls, load: Callable[..., LoadedModel], *args: object, name: str = "engine-process"
    ) -> ProcessGenerator:
        """Start the engine process; it calls ``load(*args)`` (a function it can import by
        name, and arguments it can unpickle: ``load_text_generator, spec, knobs``) and starts
        the generator of what that returns. Returns at once: :meth:`wait_ready` waits."""
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        # its load line as this process would log it (``batchline run`` says it, serve too)
        level = logging.getLogger("batchline.generation").getEffectiveLevel()
        process = context.Process(
            target=run_engine_process,
            args=(child_conn, load, args, level),
            name=f"batchline-engine-{name}",
            # multiprocessing's exit hook ends it (after _kill_at_exit has), and a parent that
            # died without one closes the pipe, which stops it
            daemon=True,
        )
        launched_at = time.perf_counter()
        process.start()
        child_conn.close()  # its end is the engine process's now: its exit closes the pipe
        atexit.unregister(_kill_at_exit)  # once, and after multiprocessing's: it runs first
        atexit.register(_kill_at_exit)
        _launched.difference_update([p for p in _launched if not p.is_alive()])
        _launched.add(process)
        return cls(process, conn, name=name, launched_at=launched_at)

    def wait_ready(self) -> Ready:
        """Block until the engine process has loaded the model and started its generator;
        log the start time. Raises what the load raised (the same type and message), or
        ``ModelError`` when the process exited first. Idempotent."""
        if self._ready is not None:
            return self._ready
        while True:
            try:
                message = self._conn.recv() if self._conn.poll(0.5) else None
            except (EOFError, OSError):
                message = None
            if message is not None and message[0] == "failed":
                self.close()
                raise from_wire(message[1])
            if message is not None and message[0] == "ready":
                break
            if not self._process.is_alive():
                self.close()
                raise ModelError(
                    f"{self.name}: the engine process {_exited(self._process.exitcode)} while "
                    "loading the model; see its log above"
                )
        ready: Ready = message[1]
        self._ready = ready
        self._child_stats = GenerationStats(kv_token_budget=ready.kv_token_budget)
        self.start_s = time.perf_counter() - self._launched_at
        logger.info(
            "%s: engine process %s ready in %.1f s (the model loaded in %.1f s of it)",
            self.name,
            self._process.pid,
            self.start_s,
            ready.load_s,
        )
        return ready

    # -- what the engine process reported ------------------------------------------------

    def _facts(self) -> Ready:
        if self._ready is None:
            raise RuntimeError(f"{self.name}: the engine process is not ready; call wait_ready()")
        return self._ready

    @property
    def max_context_tokens(self) -> int:
        return self._facts().max_context_tokens

    @property
    def kv_token_budget(self) -> int:
        return self._facts().kv_token_budget

    def _kv_limit(self) -> int | None:
        return self._facts().kv_token_budget

    @property
    def vocab_size(self) -> int | None:
        return self._facts().vocab_size

    @property
    def max_in_flight(self) -> int:
        """Requests in flight at most (waiting and running, together); beyond, ``submit``
        raises ``QueueFullError``."""
        facts = self._facts()
        return facts.max_waiting + facts.max_running

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def stats(self) -> GenerationStats:
        r = self._recorder
        return dataclasses.replace(
            self._child_stats,
            requests_submitted=r.submitted,
            requests_completed=r.completed,
            requests_aborted=r.aborted,
            requests_failed=r.failed,
            requests_rejected=r.rejected,
            prompt_tokens_total=r.prompt_tokens,
        )

    @property
    def gone(self) -> str | None:
        """Why this generator takes no more requests (its engine process exited unasked),
        else None."""
        return self._gone

    async def fetch_stats(self) -> GenerationStats:
        """:attr:`stats` with the engine's fields as the engine process has them now."""
        if self._loop is None or self._gone is not None or self._stop_sent:
            return self.stats
        waiter = self._loop.create_future()
        self._stats_waiters.append(waiter)
        self._send(("stats",))
        await waiter
        return self.stats

    # -- submit side (event loop) ----------------------------------------------------------

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationStream:
        """Send one request to the engine process now or raise (see :class:`TextGenerator`;
        ``EngineGoneError`` once the engine process has exited)."""
        rid = request_id if request_id is not None else f"{self.name}-{next(self._ids)}"
        return self.submit_many([GenerationRequest(rid, tuple(prompt_ids), params)])[0]

    def submit_many(self, requests: Sequence[GenerationRequest]) -> list[GenerationStream]:
        """Send every request to the engine process in one message, or none, and raise (see
        :class:`TextGenerator`): the engine process queues them together."""
        duplicated(requests)
        facts = self._ready  # known once started: a generator not started fails the state check
        prompts = [
            self._admissible(r.request_id, self._flights, r.prompt_ids, r.params) for r in requests
        ]
        assert facts is not None
        if self._gone is not None:
            raise EngineGoneError(self._gone)
        if len(self._flights) + len(requests) > self.max_in_flight:
            self._recorder.on_reject()
            asked = "" if len(requests) == 1 else f"; {len(requests)} asked at once"
            raise QueueFullError(
                f"{self.name}: {len(self._flights)} requests are already in flight "
                f"(max_waiting={facts.max_waiting} waiting + {facts.max_running} running)"
                f"{asked}; retry later or raise max_queue_size"
            )
        streams: list[GenerationStream] = []
        for request, prompt in zip(requests, prompts, strict=True):
            stream = GenerationStream(request.request_id, len(prompt), on_abort=self._abort)
            self._flights[request.request_id] = stream
            self._recorder.on_submit(len(prompt))
            streams.append(stream)
        wire = [
            (r.request_id, prompt, r.params) for r, prompt in zip(requests, prompts, strict=True)
        ]
        self._send(("submit", wire))
        return streams

    def _abort(self, request_id: str) -> None:
        if request_id in self._flights and self._gone is None:
            self._send(("abort", request_id))

    def _send(self, message: tuple[object, ...]) -> None:
        self._outbox.put(message)

    def _write(self) -> None:
        """The writer thread: the pipe's sends, so that a full pipe (an engine process busy
        reading, a burst of long prompts) never blocks the event loop."""
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except OSError:  # the engine process is gone: the reader says so
                return

    # -- lifecycle ---------------------------------------------------------------------------

    async def _start_worker(self) -> None:
        if self._ready is None:
            await asyncio.to_thread(self.wait_ready)
        if self._gone is None and not self._process.is_alive():
            raise ModelError(f"{self.name}: the engine process {_exited(self._process.exitcode)}")
        loop = self._loop = asyncio.get_running_loop()
        self._stopped = loop.create_future()
        self._writer = threading.Thread(
            target=self._write, name=f"batchline-{self.name}-pipe", daemon=True
        )
        self._writer.start()
        loop.add_reader(self._conn.fileno(), self._on_readable)
        self._reading = True

    async def _drain(self, timeout_s: float | None) -> None:
        # the engine process drains (for at most timeout_s) and ends the rest itself
        self._send_stop(drain=True, timeout_s=timeout_s)

    async def _shutdown_worker(self) -> None:
        self._send_stop(drain=False, timeout_s=None)
        assert self._stopped is not None
        wait_s = None if self._stop_timeout_s is None else self._stop_timeout_s + EXIT_GRACE_S
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._stopped), wait_s)
        await asyncio.to_thread(self._end_process)
        if self._writer is not None:
            self._outbox.put(None)
            await asyncio.to_thread(self._writer.join)
        self._stop_reading()
        # nothing is left unless the engine process never said "stopped" (and was killed)
        self._fail_flights(ModelError(f"{self.name}: the engine process did not stop in time"))

    def _send_stop(self, *, drain: bool, timeout_s: float | None) -> None:
        if not self._stop_sent:
            self._stop_sent = True
            self._stop_timeout_s = timeout_s if drain else 0.0
            self._send(("stop", drain, timeout_s))

    def _end_process(self) -> None:
        """Wait for the engine process to exit (it does once stopped), killing it after
        :data:`EXIT_GRACE_S`."""
        self._process.join(EXIT_GRACE_S)
        if self._process.is_alive():
            logger.warning("%s: the engine process did not exit; killing it", self.name)
            self._process.kill()
            self._process.join()

    def close(self) -> None:
        """End the engine process if it is still there (a stopped generator has already ended
        it) and free the pipe. Idempotent; blocking (at most a few seconds)."""
        if self._closed:
            return
        self._closed = True
        if self._process.is_alive():
            self._process.kill()
            self._process.join(EXIT_GRACE_S)
        if self._writer is not None and self._writer.is_alive():
            self._outbox.put(None)
            self._writer.join(EXIT_GRACE_S)
        if not self._reading:  # else the reader sees the pipe close, and closes it
            self._conn.close()

    # -- from the engine process (event loop) --------------------------------------------

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                self._on_message(self._conn.recv())
        except (EOFError, OSError):
            self._lost()

    def _on_message(self, message: tuple[object, ...]) -> None:
        kind = message[0]
        if kind == "out":
            if message[2] is not None:
                self._child_stats = message[2]  # type: ignore[assignment]
            self._deliver(message[1])  # type: ignore[arg-type]
        elif kind == "stats":
            self._child_stats = message[1]  # type: ignore[assignment]
            self._wake_stats_waiters()
        elif kind == "stopped":
            self._child_stats = message[1]  # type: ignore[assignment]
            self._wake_stats_waiters()
            if self._stopped is not None and not self._stopped.done():
                self._stopped.set_result(None)

    def _deliver(self, entries: Sequence[tuple[str, object, object]]) -> None:
        recorder = self._recorder
        for rid, delta, end in entries:
            stream = self._flights.get(rid)
            if stream is None:
                continue
            if delta is not None:
                stream._push(delta)  # type: ignore[arg-type]
            if end is None:
                continue
            del self._flights[rid]
            if isinstance(end, Completion):
                if stream._complete(end):
                    outcome = "aborted" if end.finish_reason == "abort" else "completed"
                    recorder.on_end(outcome, end.latency_s)
            elif stream._fail(from_wire(end)):  # type: ignore[arg-type]
                recorder.on_end("failed")

    def _wake_stats_waiters(self) -> None:
        waiters, self._stats_waiters = self._stats_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _stop_reading(self) -> None:
        if self._reading and self._loop is not None:
            self._reading = False
            self._loop.remove_reader(self._conn.fileno())
            self._conn.close()

    def _lost(self) -> None:
        """The pipe closed: the engine process has exited."""
        self._stop_reading()
        if self._stopped is not None and self._stopped.done():
            return  # it said "stopped" first: the exit was asked for
        self._gone = f"{self.name}: the engine process exited"
        assert self._loop is not None
        self._loop.create_task(self._fail_after_exit())

    async def _fail_after_exit(self) -> None:
        await asyncio.to_thread(self._process.join, EXIT_GRACE_S)
        code = self._process.exitcode
        self._gone = (
            f"{self.name}: the engine process (pid {self._process.pid}) {_exited(code)}; the "
            "model's requests in flight failed and it takes no more: restart the server (or "
            "reload the model) to serve it again"
        )
        logger.error("%s", self._gone)
        self._child_stats = dataclasses.replace(
            self._child_stats, running=0, waiting=0, kv_tokens_reserved=0, kv_tokens_in_use=0
        )
        self._fail_flights(EngineGoneError(self._gone))
        self._wake_stats_waiters()
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)

    def _fail_flights(self, error: ModelError) -> None:
        flights, self._flights = self._flights, {}
        for stream in flights.values():
            if stream._fail(error):
                self._recorder.on_end("failed")


def _exited(code: int | None) -> str:
    """How a process ended, from its exit code, for a message."""
    if code is None:
        return "exited"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        return f"was killed by signal {-code} (exit code {code})"
    return f"exited with code {code}"


if TYPE_CHECKING:  # mypy proves it implements the request-level protocol

    def _is_text_generator(g: ProcessGenerator) -> TextGenerator:
        return g
