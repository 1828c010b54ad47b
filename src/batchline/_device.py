"""``Device``: the processing slots of one device, time-shared by several batchers.

Several models served from one process share one device (a GPU, or the machine's model
sessions). Each model keeps its own batcher, queue and batching rules; a ``Device`` decides
which batcher's next batch takes a free slot. The policy:

* **Work-conserving.** A free slot is never left idle while an attached batcher has a batch
  ready to go (records queued, a free slot of its own under ``max_concurrent_batches``, not
  holding for ``min_batch_size``): it is granted at once, and a slot that frees is handed on
  at once, before the finished batch's results are handed out.
* **Weighted fair share.** Each batcher has a virtual time: the slot-seconds its batches held
  device slots, divided by its ``weight``. When several batchers wait, the slot goes to the
  one with the least virtual time; ties go to the one that has waited longest. A batch is
  charged its batcher's mean slot time when it starts and corrected to the time it really
  held the slot when it frees it (start-time fair queuing), so grants of several slots at
  once are fair too. Two batchers that always have work get slot-time in the ratio of their
  weights (1:1 → half each; 2:1 → two thirds and one third), whatever their batch lengths.
* **Priority first.** Each waiting batcher offers the aged priority of the record its next
  batch starts with (``priority + waited / priority_aging_s``, see ``batchline._queue``). The
  slot goes to a batcher of the highest raw priority among the waiters; a lower one whose
  aged priority has caught up with that level (floor) competes with it by fair share. With
  the server's classes (interactive 0, batch -1) and 10 s of aging: a model whose next
  record is interactive gets the slot before one whose next record is batch, unless that
  batch record has waited 10 s; then the two share by weight, so batch work never starves.
  Batchers of one priority share by weight alone, as below.
* **The last slot kept for a light model** (``reserve_s`` > 0, off by default). A model whose
  requests cost little on the device (a small MLP, microseconds a batch) rarely has a batch
  waiting when a slot frees, so a heavy one takes every slot and the light one's next batch
  waits behind a heavy batch; on a CPU, the heavy one's threads also take the cores that the
  event loop needs to parse the light one's requests. With ``reserve_s``, the last free slot
  is not given to a batcher that already holds one while another batcher that holds none
  had a batch within the last ``reserve_s`` seconds: it stays free for that one (and, on a
  CPU, its core for the request path) until it asks or has been quiet for ``reserve_s``. A
  batcher alone still gets every slot, one that holds no slot is never kept waiting, and two
  batchers that always have work share by weight as above (each is always waiting or
  running, so neither reserves).
* **No banked credit.** A batcher with nothing running and nothing waiting that asks again
  (a newcomer, or one that was idle) has its virtual time lifted to the device's virtual time
  (the start tag of the latest grant). So a model idle for an hour cannot then hold the device
  for an hour, and one model's burst cannot starve another: it only gets its share.

A grant is used or handed back in the same step (a batcher whose records were all withdrawn
hands it straight to the next one), and a slot frees when ``process_fn`` returns, as a
batcher's own slot does. Everything runs on the event loop of the batchers, which must share
one loop; a ``Device`` needs no lock.

>>> device = Device(slots=2, reserve_s=0.1)
>>> embed = DynamicBatcher(embed_fn, device=device, weight=2)       # doctest: +SKIP
>>> classify = DynamicBatcher(classify_fn, device=device)           # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from batchline._clock import Clock, LoopClock, TimerHandle

__all__ = ["Device"]


class _Client(Protocol):
    """What the device needs from a batcher."""

    def _use_device_slot(self, grant: _Grant) -> bool:
        """Dispatch a batch on ``grant`` now; False (the grant unused) when none is ready."""
        ...

    def _notify(self) -> None: ...

    def _head_priority(self, now: float) -> tuple[int, float]:
        """The raw and the aged priority of the record its next batch starts with."""
        ...


class _Member:
    """One batcher's account at the device."""

    __slots__ = (
        "client",
        "held_s",
        "holds",
        "last_active",
        "running",
        "vtime",
        "wait_s",
        "wait_seq",
        "wait_since",
        "waiting",
        "weight",
    )

    def __init__(self, client: _Client, weight: float) -> None:
        self.client = client
        self.weight = weight
        self.vtime = 0.0  # slot-seconds used / weight, lifted when it comes back from idle
        self.waiting = False
        self.wait_seq = 0
        self.wait_since = 0.0
        self.running = 0  # device slots held by its batches now
        self.held_s = 0.0  # slot-seconds held in total
        self.holds = 0
        self.wait_s = 0.0  # seconds spent waiting for a slot with a batch ready
        self.last_active = float("-inf")  # when it last asked for a slot or freed one


class _Grant:
    """One device slot held by one batch."""

    __slots__ = ("charged", "granted_at", "member")

    def __init__(self, member: _Member, granted_at: float, charged: float) -> None:
        self.member = member
        self.granted_at = granted_at
        self.charged = charged


class Device:
    """Processing slots shared by several batchers, fairly and without idling.

    Args:
        slots: batches that may run at once across all attached batchers (e.g. the model
            sessions, or what the GPU runs well concurrently).
        clock: where time comes from; the attached batchers use it too. Tests pass a
            ``ManualClock``.
        name: used in error messages.
        reserve_s: keep the last free slot for a batcher that holds none and had a batch
            within this many seconds, rather than give it to one that already holds a slot
            (0, the default: never). ``batchline serve`` sets it for several models on a CPU.

    Attach a batcher with ``DynamicBatcher(..., device=device, weight=w)`` (``weight`` > 0,
    1 by default). Each batcher's ``max_concurrent_batches`` still caps how many of the
    device's slots it holds at once. See the module docstring for the policy.
    """

    def __init__(
        self,
        slots: int = 1,
        *,
        clock: Clock | None = None,
        name: str = "device",
        reserve_s: float = 0.0,
    ) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        if isinstance(reserve_s, bool) or not isinstance(reserve_s, (int, float)) or reserve_s < 0:
            raise ValueError(f"reserve_s must be a number >= 0, got {reserve_s!r}")
        self._slots = slots
        self._reserve_s = float(reserve_s)
        self._members: list[_Member] = []  # of the running batchers
        self._reserve_timer: TimerHandle | None = None
        self._reserve_until = 0.0
        self.reserved_s = 0.0  # seconds the last slot was kept free for a light batcher
        self._reserved_since: float | None = None
        self._free = slots
        self._clock: Clock = clock if clock is not None else LoopClock()
        self.name = name
        self._waiters: list[_Member] = []
        self._seq = 0
        self._vnow = 0.0  # the device's virtual time: the start tag of the latest grant
        self._handing_out = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running_clients = 0

    @property
    def slots(self) -> int:
        return self._slots

    @property
    def reserve_s(self) -> float:
        return self._reserve_s

    @property
    def busy(self) -> int:
        """Slots held by running batches now."""
        return self._slots - self._free

    @property
    def waiting(self) -> int:
        """Batchers with a batch ready, waiting for a slot."""
        return len(self._waiters)

    @property
    def clock(self) -> Clock:
        return self._clock

    def __repr__(self) -> str:
        return f"Device({self.name!r}, slots={self._slots}, busy={self.busy})"

    # -- for the batchers ---------------------------------------------------------------------

    def _attach(self, client: _Client, weight: float) -> _Member:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"weight must be a number > 0, got {weight!r}")
        return _Member(client, float(weight))

    def _bind(self, loop: asyncio.AbstractEventLoop, member: _Member) -> None:
        """A batcher starts on ``loop``; every batcher of a device must share one loop."""
        if self._running_clients and self._loop is not loop:
            raise RuntimeError(
                f"{self.name}: its batchers must run on one event loop; another loop is "
                "already using it (build one Device per event loop)"
            )
        self._loop = loop
        self._running_clients += 1
        self._members.append(member)

    def _unbind(self, member: _Member) -> None:
        self._running_clients -= 1
        self._members.remove(member)
        if self._running_clients == 0:
            self._loop = None
            if self._reserve_timer is not None:
                self._reserve_timer.cancel()
                self._reserve_timer = None
        else:
            self._hand_out(self._clock.now())  # a slot it reserved for itself is free

    def _request(self, member: _Member) -> None:
        """``member`` has a batch ready: grant a slot now, or queue it for the next one."""
        if member.waiting:
            return
        if member.running == 0 and member.vtime < self._vnow:
            member.vtime = self._vnow  # back from idle: no banked credit
        now = self._clock.now()
        member.last_active = now
        member.waiting = True
        self._seq += 1
        member.wait_seq = self._seq
        member.wait_since = now
        self._waiters.append(member)
        self._hand_out(now)

    def _leave(self, member: _Member) -> None:
        """``member`` has nothing ready any more (records withdrawn, or it stopped)."""
        if member.waiting:
            member.waiting = False
            self._waiters.remove(member)
            self._track_reserve(self._clock.now())

    def _release(self, grant: _Grant) -> None:
        """A batch freed its slot (exactly once per grant): charge what it held, hand it on."""
        member = grant.member
        now = self._clock.now()
        held = now - grant.granted_at
        member.last_active = now
        member.vtime += (held - grant.charged) / member.weight
        member.held_s += held
        member.holds += 1
        member.running -= 1
        self._free += 1
        self._hand_out(now)

    def _wait_s(self, member: _Member) -> float:
        """Seconds ``member`` has waited for slots, the wait in progress included."""
        if not member.waiting:
            return member.wait_s
        try:
            now = self._clock.now()
        except RuntimeError:  # LoopClock read from a thread: the wait in progress is left out
            return member.wait_s
        return member.wait_s + max(0.0, now - member.wait_since)

    # -- the policy ---------------------------------------------------------------------------

    def _hand_out(self, now: float) -> None:
        if self._handing_out:
            return  # a grant being used asked again: the loop below carries on
        self._handing_out = True
        try:
            waiters = self._waiters
            while self._free > 0 and waiters:
                candidates = self._top_class(waiters, now) if len(waiters) > 1 else waiters
                if self._free == 1 and self._reserve_s > 0:
                    candidates = self._unreserved(candidates, now)
                    if not candidates:
                        break
                # the least weighted service first; among equals, the longest waiting
                chosen = candidates[0]
                for m in candidates:
                    if m.vtime < chosen.vtime or (
                        m.vtime == chosen.vtime and m.wait_seq < chosen.wait_seq
                    ):
                        chosen = m
                waiters.remove(chosen)
                chosen.waiting = False
                grant = self._grant(chosen, now)
                if not chosen.client._use_device_slot(grant):
                    self._take_back(grant)
                    chosen.client._notify()
        finally:
            self._handing_out = False
        self._track_reserve(now)

    def _unreserved(self, candidates: list[_Member], now: float) -> list[_Member]:
        """The candidates that may take the last free slot: all of them, unless a batcher
        that holds none and waits for none was active within ``reserve_s``; then those that
        hold none (never a batcher kept from its first slot)."""
        light = [
            m
            for m in self._members
            if m.running == 0 and not m.waiting and now - m.last_active < self._reserve_s
        ]
        if not light:
            return candidates
        self._wake_at(min(m.last_active for m in light) + self._reserve_s)
        return [m for m in candidates if m.running == 0]

    def _wake_at(self, when: float) -> None:
        """Hand out again at ``when``, when the reserve that keeps a slot free lapses."""
        if self._reserve_timer is not None:
            if self._reserve_until <= when:
                return
            self._reserve_timer.cancel()

        def lapse() -> None:
            self._reserve_timer = None
            self._hand_out(self._clock.now())

        self._reserve_until = when
        self._reserve_timer = self._clock.call_at(when, lapse)

    def _track_reserve(self, now: float) -> None:
        """Count the seconds a slot stays free while a batcher has a batch ready."""
        kept = self._free > 0 and bool(self._waiters)
        if kept and self._reserved_since is None:
            self._reserved_since = now
        elif not kept and self._reserved_since is not None:
            self.reserved_s += now - self._reserved_since
            self._reserved_since = None

    @staticmethod
    def _top_class(waiters: list[_Member], now: float) -> list[_Member]:
        """The waiters whose next record is of the highest priority, counting aging up to
        that level (an aged batcher is promoted to it, never past it)."""
        heads = [(m, *m.client._head_priority(now)) for m in waiters]
        top = max(raw for _, raw, _ in heads)
        if all(raw == top for _, raw, _ in heads):
            return waiters
        return [m for m, raw, aged in heads if raw == top or aged >= top]

    def _grant(self, member: _Member, now: float) -> _Grant:
        member.wait_s += max(0.0, now - member.wait_since)
        if member.vtime > self._vnow:
            self._vnow = member.vtime
        charged = member.held_s / member.holds if member.holds else 0.0
        member.vtime += charged / member.weight
        member.running += 1
        self._free -= 1
        return _Grant(member, now, charged)

    def _take_back(self, grant: _Grant) -> None:
        member = grant.member
        member.vtime -= grant.charged / member.weight
        member.running -= 1
        self._free += 1
