"""``GenerationStats``: a frozen snapshot of what a text generator has done, on an injected clock.

Every generator (continuous, static, sequential, vLLM) fills the same fields, so the server
can export them to Prometheus under stable names. Definitions:

- ``ttft`` (time to first token): from ``submit()`` to the end of the step that produced the
  request's first token (the time the worker saw it, not when a client read it).
- ``itl`` (inter-token latency): the gap between two consecutive steps that produced tokens for
  the same request (one sample per gap).
- ``latency``: from ``submit()`` to the step that finished the request (completed ones only).
- ``tokens_per_s``: generated tokens divided by the seconds since ``start()`` (wall throughput).
- Percentiles cover the most recent ``window`` samples (10,000 by default); ``nan`` when empty.
- ``kv_tokens_reserved``: the worst case (prompt + ``max_tokens``) of every admitted sequence;
  ``kv_tokens_in_use``: what the engine reported holding after its last step, or after the
  last sequences left it between steps (abort, timeout, failure): 0 once nothing runs.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from batchline._clock import MonotonicClock
from batchline._stats import percentile

__all__ = ["GenerationStats", "GenerationStatsRecorder", "MonotonicClock", "NowClock"]


class NowClock(Protocol):
    """Where a generator reads time (any thread). ``batchline.ManualClock`` satisfies it."""

    def now(self) -> float: ...


@dataclass(frozen=True, slots=True)
class GenerationStats:
    """What a generator has done so far. A snapshot: it never changes after it is taken.

    Counters (``requests_*``, ``*_tokens_total``, ``steps``) only grow. ``requests_completed``
    counts requests that ended with ``stop`` or ``length``; ``requests_aborted`` those that
    ended with ``abort`` (client abort, disconnect, or stop() without drain);
    ``requests_failed`` those whose ``result()`` raised (engine error, closed, a constraint
    the grammar engine gave up on);
    ``requests_rejected`` submits refused with ``QueueFullError`` or ``RecordTooLargeError``.
    ``preempted`` is always 0 for batchline's schedulers (they reserve the worst case instead).
    ``prefix_cache_*``: the engine's prompt-prefix cache, where it has one (the torch engine):
    its capacity in positions, the prompts that started with a cached prefix and the prompt
    tokens they did not prefill. ``prompt_tokens_computed``: the prompt tokens the engine
    prefilled (where it says); ``prompts_shared``: prompts it did not prefill because an
    identical one joined the same step (``n`` samples). ``running_cap``: the most sequences
    the scheduler admits now (the continuous one's cap, which the measured cost of a row may
    move; 0 where the generator does not say).
    """

    requests_submitted: int = 0
    requests_completed: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    requests_rejected: int = 0
    preempted: int = 0
    running: int = 0
    waiting: int = 0
    kv_tokens_reserved: int = 0
    kv_tokens_in_use: int = 0
    kv_token_budget: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    steps: int = 0
    avg_running_per_step: float = 0.0
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0
    ttft_p50_s: float = math.nan
    ttft_p99_s: float = math.nan
    itl_p50_s: float = math.nan
    itl_p99_s: float = math.nan
    latency_p50_s: float = math.nan
    latency_p99_s: float = math.nan
    prefix_cache_tokens: int = 0
    prefix_cache_hits: int = 0
    prefix_tokens_reused: int = 0
    prompt_tokens_computed: int = 0
    prompts_shared: int = 0
    running_cap: int = 0


class GenerationStatsRecorder:
    """Thread-safe counters and sample windows behind :class:`GenerationStats`."""

    def __init__(self, clock: NowClock, *, kv_token_budget: int = 0, window: int = 10_000) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.kv_token_budget = kv_token_budget
        self._started_at: float | None = None
        self._stopped_at: float | None = None
        self.submitted = 0
        self.completed = 0
        self.aborted = 0
        self.failed = 0
        self.rejected = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.steps = 0
        self._running_sum = 0
        self.kv_in_use = 0
        self._ttft: deque[float] = deque(maxlen=window)
        self._itl: deque[float] = deque(maxlen=window)
        self._latency: deque[float] = deque(maxlen=window)

    def started(self) -> None:
        with self._lock:
            self._started_at = self._clock.now()
            self._stopped_at = None

    def stopped(self) -> None:
        with self._lock:
            self._stopped_at = self._clock.now()

    def on_submit(self, prompt_tokens: int) -> None:
        with self._lock:
            self.submitted += 1
            self.prompt_tokens += prompt_tokens

    def on_reject(self) -> None:
        with self._lock:
            self.rejected += 1

    def on_step(
        self,
        running: int,
        kv_in_use: int,
        *,
        tokens: int = 0,
        ttft: Sequence[float] = (),
        itl: Sequence[float] = (),
    ) -> None:
        """One engine step: ``tokens`` generated in it, with the TTFT and inter-token samples
        it produced (one lock for the whole step: this is the worker thread's hot path)."""
        with self._lock:
            self.steps += 1
            self._running_sum += running
            self.kv_in_use = kv_in_use
            self.generated_tokens += tokens
            self._ttft.extend(ttft)
            self._itl.extend(itl)

    def on_kv_in_use(self, kv_in_use: int) -> None:
        """Sequences left the engine outside a step (aborted, timed out, failed): what it
        holds now, so the gauge does not keep the last step's value until the next step."""
        with self._lock:
            self.kv_in_use = kv_in_use

    def on_tokens(self, count: int, *, first_after_s: float | None, gap_s: float | None) -> None:
        """``count`` tokens reached one request: ``first_after_s`` is its TTFT when they are its
        first, ``gap_s`` the time since its previous tokens otherwise."""
        with self._lock:
            self.generated_tokens += count
            if first_after_s is not None:
                self._ttft.append(first_after_s)
            if gap_s is not None:
                self._itl.append(gap_s)

    def on_end(self, outcome: str, latency_s: float | None = None) -> None:
        """``outcome``: ``completed``, ``aborted`` or ``failed``."""
        with self._lock:
            if outcome == "completed":
                self.completed += 1
                if latency_s is not None:
                    self._latency.append(latency_s)
            elif outcome == "aborted":
                self.aborted += 1
            else:
                self.failed += 1

    def snapshot(self, *, running: int, waiting: int, kv_reserved: int) -> GenerationStats:
        with self._lock:
            now = self._clock.now()
            end = self._stopped_at if self._stopped_at is not None else now
            elapsed = 0.0 if self._started_at is None else max(0.0, end - self._started_at)
            return GenerationStats(
                requests_submitted=self.submitted,
                requests_completed=self.completed,
                requests_aborted=self.aborted,
                requests_failed=self.failed,
                requests_rejected=self.rejected,
                preempted=0,
                running=running,
                waiting=waiting,
                kv_tokens_reserved=kv_reserved,
                kv_tokens_in_use=self.kv_in_use,
                kv_token_budget=self.kv_token_budget,
                prompt_tokens_total=self.prompt_tokens,
                generated_tokens_total=self.generated_tokens,
                steps=self.steps,
                avg_running_per_step=self._running_sum / self.steps if self.steps else 0.0,
                elapsed_s=elapsed,
                tokens_per_s=self.generated_tokens / elapsed if elapsed > 0 else 0.0,
                ttft_p50_s=percentile(self._ttft, 50),
                ttft_p99_s=percentile(self._ttft, 99),
                itl_p50_s=percentile(self._itl, 50),
                itl_p99_s=percentile(self._itl, 99),
                latency_p50_s=percentile(self._latency, 50),
                latency_p99_s=percentile(self._latency, 99),
            )
