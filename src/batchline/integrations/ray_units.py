"""How ``batchline run --engine ray`` hands work to its replicas: units, faults and the tally.

A unit is a slice of the records the pipeline read, never across an output chunk
(:class:`UnitPlan`); :class:`RayAdapter` sends it to the live replica with the most room
(each replica has a capacity in units: a few for a batch model, enough to keep a generator's
running batch and the queue behind it full). Only the driver writes, once per record.

Faults, as the driver sees them (Ray retries nothing itself: every loss comes back here):

- A replica process that dies fails every unit it had in flight. Ray restarts it (up to
  ``max_restarts``) and each lost unit is sent again, to whichever replica has room.
- A unit lost a second time is a suspect: it is split in halves, and each half runs *alone*
  on a replica (nothing else in flight there), so that a loss can be blamed on it alone.
- A single record lost ``max_unit_attempts`` times, the last times alone, is that record's
  failure (``Failed``: listed in ``_skipped.jsonl`` or stopping the job, as the job's
  ``--on-bad-record`` says), not retried forever.
- A replica that Ray has given up on (past ``max_restarts``) takes no more units; when none is
  left the job stops, its committed chunks kept for ``--resume``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from batchline._errors import BatchlineError, ModelError
from batchline.datasets.outcomes import Failed, Outcome, Written
from batchline.datasets.sources import Record
from batchline.integrations.ray_replica import ReplicaReady, UnitResult
from batchline.integrations.session import last_line
from batchline.jobs.batch import Seen, input_key

__all__ = ["RayAdapter", "Tally", "UnitDone", "UnitPlan"]

logger = logging.getLogger(__name__)

# Failures of the machinery, not of the unit's records: the unit is sent again.
_LOST = (
    ray.exceptions.RayActorError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.WorkerCrashedError,
)


@dataclass(frozen=True)
class UnitDone:
    """One unit's results, just written by the driver (passed to ``run_on_ray(on_unit=...)``)."""

    first_index: int
    records: int
    replica: int
    node_id: str
    pid: int
    attempt: int
    round_trip_s: float


class UnitPlan:
    """Which unit a record index belongs to: units never cross an output chunk's boundary."""

    def __init__(self, chunk_size: int, target: int) -> None:
        self.chunk_size = chunk_size
        if target >= chunk_size:
            self._span = (target // chunk_size) * chunk_size  # whole chunks
            self._parts = 0
        else:
            self._parts = -(-chunk_size // target)  # equal slices of one chunk
            self._span = -(-chunk_size // self._parts)

    def key(self, index: int) -> int:
        if not self._parts:
            return index // self._span
        chunk, offset = divmod(index, self.chunk_size)
        return chunk * self._parts + offset // self._span


@dataclass(frozen=True)
class _Part:
    """One answered part of a unit (the whole unit unless it was split)."""

    replica: int
    attempt: int
    round_trip_s: float
    result: UnitResult


class Tally:
    """Where the work ran and what the replicas say of it, for the summary."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.units = 0
        self.resubmitted = 0
        self.latencies: list[float] = []
        self.by_node: Counter[str] = Counter()
        #: replica processes that died and that Ray restarts (or was restarting at the end)
        self.restarts = 0
        # CPU time of each replica process: when it was ready (0 for a restarted one), and lately.
        self.cpu_from: dict[tuple[int, int], float] = {}
        self.cpu_to: dict[tuple[int, int], float] = {}
        # Each replica process's latest answer (its stats are cumulative, per process).
        self.latest: dict[tuple[int, int], UnitResult] = {}
        #: records the driver answered from an earlier unit's result (never sent)
        self.driver_duplicates = 0

    @property
    def tokens_by_replica(self) -> list[int]:
        """Completion tokens each replica's generator computed in this run (duplicates
        answered from an earlier completion are not computed again)."""
        tokens = [0] * self.replicas
        for (replica, _), result in self.latest.items():
            tokens[replica] += result.figures.tokens
        return tokens

    @property
    def tokens(self) -> int:
        return sum(r.figures.tokens for r in self.latest.values())

    def see(self, replica: int, result: UnitResult) -> None:
        self.cpu_to[(replica, result.pid)] = result.cpu_s
        self.latest[(replica, result.pid)] = result

    def merged(self) -> dict[str, float]:
        """The replicas' batchers as one: utilization, batch size and cost, padding waste."""
        snaps = [r.figures.stats for r in self.latest.values() if r.figures.stats is not None]
        busy = sum(s.busy_time_s for s in snaps)
        idle = sum(s.idle_time_s for s in snaps)
        batches = sum(s.total_batches for s in snaps)
        cost = sum(s.total_batch_cost for s in snaps)
        rows = sum(s.avg_batch_size * s.total_batches for s in snaps)
        waste = sum(s.padding_waste * s.total_batch_cost for s in snaps)
        return {
            "utilization": busy / (busy + idle) if busy + idle > 0 else 0.0,
            "avg_batch_size": rows / batches if batches else 0.0,
            "avg_batch_cost": cost / batches if batches else 0.0,
            "padding_waste": waste / cost if cost else 0.0,
        }

    @property
    def duplicates(self) -> int:
        """Records answered from an earlier identical input's result: by the driver (never
        sent), and by a replica within its own units."""
        return self.driver_duplicates + sum(r.figures.duplicates for r in self.latest.values())

    @property
    def cpu_s(self) -> float:
        return sum(t - self.cpu_from.get(k, 0.0) for k, t in self.cpu_to.items())


class RayAdapter:
    """:class:`~batchline.datasets.pipeline.Adapter` for model replicas on Ray: each block is
    one unit, sent to the live replica with the most room (``capacity[i]`` units in flight at
    most). Faults as the module docstring says."""

    def __init__(
        self,
        actors: Sequence[tuple[Any, ReplicaReady]],
        *,
        capacity: Sequence[int],
        max_unit_attempts: int,
        on_unit: Callable[[UnitDone], None] | None = None,
        on_tokens: Callable[[int], None] | None = None,
        dedupe_window: int = 0,
        key_of: Callable[[Record], bytes | None] | None = None,
    ) -> None:
        self.actors = [actor for actor, _ in actors]
        # the job's distinct inputs, once per job (not once per replica): a record whose
        # input repeats one of them takes that one's outcome and is never sent
        self.seen = Seen[asyncio.Future[Outcome]](dedupe_window) if dedupe_window > 0 else None
        # what identifies a record's answer: its input (a text, a score pair), or the job
        # kind's own key (a picture's content, a batch line), taken off the loop (it may read)
        self.key_of = key_of
        self.capacity = list(capacity)
        self.max_unit_attempts = max_unit_attempts
        self.on_unit = on_unit
        self.on_tokens = on_tokens
        self.tally = Tally(len(self.actors))
        for i, (_, ready) in enumerate(actors):
            self.tally.cpu_from[(i, ready.pid)] = ready.cpu_s
        self.alive = [True] * len(self.actors)
        # a replica that lost its process is down until it answers again (Ray restarts it;
        # a call sent meanwhile would fail at once, and count as a loss of its records)
        self.down = [False] * len(self.actors)
        self._probes: dict[int, asyncio.Future[None]] = {}
        self.load = [0] * len(self.actors)
        self._freed = asyncio.Condition()
        self._landed: dict[int, list[_Part]] = {}  # by the unit's first record index

    async def submit(self, records: Sequence[Record]) -> asyncio.Future[list[Outcome]]:
        keys: list[bytes | None] = []
        if self.seen is not None:
            if self.key_of is None:
                keys = [input_key(record.input) for record in records]
            else:
                key_of = self.key_of
                keys = await asyncio.to_thread(lambda: [key_of(r) for r in records])
        fresh, waits, answers = self._dedupe(records, keys)
        # a replica's room is taken now, in submit order (none for a unit of duplicates only)
        replica = await self._acquire(alone=False) if fresh else None
        return asyncio.ensure_future(self._answered(records, fresh, waits, answers, replica))

    def _dedupe(
        self, records: Sequence[Record], keys: Sequence[bytes | None]
    ) -> tuple[list[int], dict[int, asyncio.Future[Outcome]], dict[int, asyncio.Future[Outcome]]]:
        """The records to send (their places), those answered by an earlier record's outcome,
        and the outcomes the sent ones promise to later duplicates (``keys``: each record's,
        None for one never answered from another's)."""
        if self.seen is None:
            return list(range(len(records))), {}, {}
        loop = asyncio.get_running_loop()
        fresh: list[int] = []
        waits: dict[int, asyncio.Future[Outcome]] = {}
        answers: dict[int, asyncio.Future[Outcome]] = {}
        for i, key in enumerate(keys):
            first = self.seen.get(key) if key is not None else None
            if first is not None:
                waits[i] = first
                continue
            fresh.append(i)
            if key is not None:
                answers[i] = loop.create_future()
                self.seen.put(key, answers[i])
        self.tally.driver_duplicates = self.seen.duplicates
        return fresh, waits, answers

    async def _answered(
        self,
        records: Sequence[Record],
        fresh: list[int],
        waits: dict[int, asyncio.Future[Outcome]],
        answers: dict[int, asyncio.Future[Outcome]],
        replica: int | None,
    ) -> list[Outcome]:
        if not waits:  # the common case: the unit as it is
            try:
                got = await self._unit(records, replica, key=records[0].index)
                for i, answer in answers.items():
                    answer.set_result(got[i])
                return got
            finally:
                for answer in answers.values():
                    answer.cancel()  # no-op once answered
        outcomes: list[Outcome] = [None] * len(records)
        try:
            if replica is not None:
                sent = [records[i] for i in fresh]
                got = await self._unit(sent, replica, key=records[0].index)
                for i, outcome in zip(fresh, got, strict=True):
                    outcomes[i] = outcome
                    if i in answers:
                        answers[i].set_result(outcome)
            else:
                self._landed[records[0].index] = []  # nothing sent: every record a duplicate
            for i, first in waits.items():
                outcomes[i] = await asyncio.shield(first)
        finally:
            for answer in answers.values():
                answer.cancel()  # no-op once answered: unanswered, the waiters fail with us
        return outcomes

    def utilization(self) -> float:
        generators = [r for r in self.tally.latest.values() if r.figures.generation is not None]
        if generators:  # running sequences over the running cap, as a local job's bar
            running = sum(
                r.figures.generation.running for r in generators if r.figures.generation is not None
            )
            cap = sum(r.figures.max_running for r in generators)
            return min(1.0, running / cap) if cap else 0.0
        return self.tally.merged()["utilization"]

    def written(self, records: Sequence[Record], done: Written) -> None:
        """After the pipeline wrote a unit: count it where it ran, and call ``on_unit``."""
        parts = self._landed.pop(records[0].index)
        tally = self.tally
        tally.units += 1
        if not parts:  # every record of it answered by the driver from earlier units
            return
        for part in parts:
            result = part.result
            answered = sum(not isinstance(o, Failed) for o in result.outcomes)
            tally.by_node[result.node_id] += answered
            tally.latencies.extend([part.round_trip_s] * answered)
        if self.on_tokens is not None and tally.latest:
            self.on_tokens(tally.tokens)
        last = parts[-1]
        if self.on_unit is not None:
            self.on_unit(
                UnitDone(
                    first_index=records[0].index,
                    records=len(records),
                    replica=last.replica,
                    node_id=last.result.node_id,
                    pid=last.result.pid,
                    attempt=max(p.attempt for p in parts),
                    round_trip_s=last.round_trip_s,
                )
            )

    # -- room on the replicas ----------------------------------------------------------------

    async def _acquire(self, *, alone: bool) -> int:
        """The live replica with the most room, once one has room (``alone``: an idle one,
        which then takes nothing else until released)."""
        async with self._freed:
            while True:
                if not any(self.alive):
                    raise ModelError(
                        "every replica is gone (see the Ray logs for why); committed chunks "
                        "are kept: rerun with --resume to continue"
                    )
                free = [
                    i
                    for i, alive in enumerate(self.alive)
                    if alive
                    and not self.down[i]
                    and (self.load[i] == 0 if alone else self.load[i] < self.capacity[i])
                ]
                if free:
                    best = min(free, key=lambda i: self.load[i] / self.capacity[i])
                    self.load[best] = self.capacity[best] if alone else self.load[best] + 1
                    return best
                await self._freed.wait()

    async def _release(self, replica: int, *, alone: bool) -> None:
        async with self._freed:
            self.load[replica] = 0 if alone else self.load[replica] - 1
            self._freed.notify_all()

    # -- a unit's journey --------------------------------------------------------------------

    async def _unit(
        self, records: Sequence[Record], replica: int | None, *, key: int
    ) -> list[Outcome]:
        parts: list[_Part] = []
        # a replica is not sent the copied columns: they stay with the driver, which writes them
        sent = [dataclasses.replace(r, extra={}) if r.extra else r for r in records]
        outcomes = await self._run(sent, parts, replica=replica, losses=0, alone=False)
        self._landed[key] = parts
        return outcomes

    async def _run(
        self,
        records: list[Record],
        parts: list[_Part],
        *,
        replica: int | None,
        losses: int,
        alone: bool,
    ) -> list[Outcome]:
        """Run ``records`` until they are answered: on a loss, again; from the second loss,
        split and alone; a single record lost ``max_unit_attempts`` times is its failure."""
        while True:
            if replica is None:
                replica = await self._acquire(alone=alone)
            sent = time.perf_counter()
            try:
                result = await self._call(replica, records, alone=alone)
            except _LOST as exc:
                losses += 1
                self._lost(records, replica, losses, exc)
                replica = None
                if len(records) == 1 and losses >= self.max_unit_attempts:
                    index = records[0].index
                    logger.warning("record %d lost %d replicas: reported as failed", index, losses)
                    return [
                        Failed(
                            f"model error: the replica running it died each of the {losses} "
                            f"times it was tried, the last times alone ({last_line(exc)})"
                        )
                    ]
                if losses >= 2 and len(records) > 1:
                    half = len(records) // 2
                    halves = await asyncio.gather(
                        self._run(records[:half], parts, replica=None, losses=1, alone=True),
                        self._run(records[half:], parts, replica=None, losses=1, alone=True),
                    )
                    return [*halves[0], *halves[1]]
                alone = alone or losses >= 2
                continue
            self.tally.see(replica, result)
            parts.append(_Part(replica, losses + 1, time.perf_counter() - sent, result))
            return result.outcomes

    async def _call(self, replica: int, records: list[Record], *, alone: bool) -> UnitResult:
        """One try on ``replica`` (its room released after, whatever happens)."""
        try:
            result: UnitResult = await self.actors[replica].process.remote(records)
            return result
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, BatchlineError):
                raise cause from None
            raise
        finally:
            await self._release(replica, alone=alone)

    async def _probe(self, replica: int) -> None:
        """Wait until a down replica answers again (restarted, its models loaded), or Ray has
        given up on it."""
        delay = 0.1
        while True:
            try:
                ready: ReplicaReady = await self.actors[replica].ready.remote()
            except ray.exceptions.ActorDiedError:
                self.alive[replica] = False
                self.tally.restarts -= 1  # not restarted after all: Ray gave up on it
                break
            except _LOST:
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
                continue
            # a new process (Ray restarted it): its CPU time counts from when it was ready
            self.tally.cpu_from.setdefault((replica, ready.pid), ready.cpu_s)
            break
        async with self._freed:
            self.down[replica] = False
            del self._probes[replica]
            self._freed.notify_all()

    def _lost(self, records: Sequence[Record], replica: int, losses: int, exc: Exception) -> None:
        if isinstance(exc, ray.exceptions.RayActorError) and exc.actor_init_failed:
            raise ModelError(f"a replica could not load the model: {last_line(exc)}") from None
        if isinstance(exc, ray.exceptions.ActorDiedError):
            self.alive[replica] = False  # Ray has given up restarting it
        elif replica not in self._probes:
            self.tally.restarts += 1
            self.down[replica] = True
            self._probes[replica] = asyncio.ensure_future(self._probe(replica))
        logger.warning(
            "replica %d lost records %d..%d (%s, loss %d); sending them again",
            replica,
            records[0].index,
            records[-1].index,
            type(exc).__name__,
            losses,
        )
        self.tally.resubmitted += 1
