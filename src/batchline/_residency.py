"""``Residency``: which models are loaded, under a memory budget: load on demand, evict what
is idle, never what is busy.

Many models, one device, limited memory. Each model has a footprint: first an estimate (read
off its files), then what its load measured. A model loads when the first request for it
acquires it; requests that arrive meanwhile wait for that one load. The rules:

* **The budget holds.** The bytes accounted (resident models, loads under way at their
  estimate or, once measured, the peak a load of that model reached, unloads not yet
  finished) never exceed ``budget_bytes`` less ``reserved_bytes`` (what the process holds
  without any model). A load waits until its estimate fits. A load that measures more than
  its estimate becomes its new estimate, and the estimate of every model of its ``group``
  not measured yet (models loaded the same way), and idle models are evicted to get back
  under the budget (while none can be, the excess is logged by the caller through
  ``on_event``). With ``one_load_at_a_time``, a load is admitted only when no other is under
  way, so each admission counts what the loads before it measured, not what they were
  expected to need. With ``in_use`` (what the models hold now, measured), a load must fit
  beside the larger of that and the bytes accounted: memory an unload did not give back
  counts, as long as any model is accounted at all (else it is not the models').
* **Evict what is idle, least recently used first, and only when needed.** A model is idle
  when no request holds it (``active`` counts the requests waiting for it or using it) and it
  is not pinned. A load that does not fit evicts idle models, oldest use first, only as many
  bytes as it lacks (counting unloads already under way), and none at all when even every
  idle model would not make room: then it waits for a change (a release, a finished unload,
  a failed load) and looks again. Nothing is evicted while free memory suffices.
* **A swap is paid once per batch of work, in turn.** Requests take a ticket when they ask.
  Loads that must wait for room start in the order of their models' oldest tickets (a model
  asked for later never jumps the queue, so no request waits through more than the swaps
  asked for before it), unless the one ahead cannot fit beside what no swap frees (pinned
  models, lasting claims): waiting behind it would only be waiting. And once a model has
  waited ``swap_patience_s`` for room, a request for a resident model that asks after it is
  held back (it does not count as using the model): the resident model serves the work it
  was given, goes idle, is swapped out, and the held request comes back in its turn. (The
  patience lets a loaded model take a little more work first, where a swap would cost more
  than the wait: a simulated 6 clients on three models made 21 loads with 10 s of it, 28
  with none.) Without this, a model busy with a stream of new requests kept its room while
  the others waited past their timeouts (``tests/test_residency_rotation.py``). Only
  requests take turns (``acquire(name, turn=True)``): while a claim that lasts (a batch
  run) holds the model, the swap waits for it anyway, and its requests are admitted.
* **Keep-alive.** An idle model is also unloaded ``keep_alive_s`` after its last use.
* **Never a deadlock, never a lost request.** A waiting acquire holds no model and no
  memory; each change wakes every waiter to look again. A model that could never fit (what
  its files say, steady or at its load's peak, is more than the budget less the pinned
  models) is refused at once with ``MemoryBudgetError``; a measured figure past the room
  never refuses a model: its load goes alone, once everything idle is out. A failed load
  answers every request waiting for it with ``ModelLoadError`` naming the cause; the model
  stays loadable (the next acquire loads it again). A cancelled acquire (the request's
  timeout) gives up its claim and nothing else.

The manager runs on one event loop; its time comes from ``clock`` (tests pass a
``ManualClock``), its loads and unloads from the injected ``load`` and ``unload``. Standard
library only.

>>> residency = Residency(budget_bytes=6 << 30, load=load, unload=unload)   # doctest: +SKIP
>>> residency.add("emb", estimate_bytes=90 << 20)                          # doctest: +SKIP
>>> handle = await residency.acquire("emb")    # loads it, or waits for room
>>> ...                                         # use it
>>> residency.release("emb")                   # idle again: evictable, keep-alive runs
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Generic, TypeVar

from batchline._clock import Clock, LoopClock
from batchline._resident import Entry as _Entry
from batchline._resident import (
    MemoryBudgetError,
    ModelLoadError,
    ResidentState,
    ResidentStats,
)
from batchline._sizes import format_size as _size
from batchline._sizes import parse_bytes

__all__ = [
    "MemoryBudgetError",
    "ModelLoadError",
    "Residency",
    "ResidentState",
    "ResidentStats",
    "parse_bytes",
]

H = TypeVar("H")

#: ``load(name) -> (handle, measured_bytes or None)``, or ``(handle, measured_bytes,
#: peak_bytes)`` when the load also measured its transient peak (what the next load of the
#: model reserves while it runs).
Load = Callable[[str], Awaitable[tuple[H, int | None] | tuple[H, int | None, int | None]]]
#: ``unload(name, handle)``: free the model (errors are reported through ``on_event``).
Unload = Callable[[str, H], Awaitable[None]]
#: ``on_event(kind, name, details)``: ``load``, ``load_failed``, ``evict``, ``over_budget``.
OnEvent = Callable[[str, str, Mapping[str, float | str]], None]


class Residency(Generic[H]):
    """Models loaded on demand under ``budget_bytes`` (``None``: no budget, only keep-alive);
    see the module docstring for the rules.

    Args:
        budget_bytes: the memory the resident models may hold together.
        load, unload: how a model is loaded (``(handle, measured bytes or None)``) and freed.
        keep_alive_s: an idle model is unloaded this long after its last use (``None``:
            only when its room is needed); ``add`` may set it per model.
        clock: where time comes from (tests pass a ``ManualClock``).
        on_event: told of every load, failed load, eviction and budget overshoot (metrics,
            logs).
        reclaim: awaited after each unload, once the residency holds no reference to the
            model, before its memory counts as free (e.g. collect and hand memory back to
            the OS: while ``unload`` runs, its caller still holds the model).
        reserved_bytes: the part of the budget no model may use (the process's own memory).
        one_load_at_a_time: admit a load only when no other is under way.
        swap_patience_s: how long a request for a model that waits for room lets the loaded
            model go on taking new requests (0: none; see the module docstring).
        in_use: the bytes the models hold now, measured (e.g. the process's memory less
            ``reserved_bytes``); a load must fit beside it too.
    """

    def __init__(
        self,
        *,
        budget_bytes: int | None,
        load: Load[H],
        unload: Unload[H],
        keep_alive_s: float | None = 300.0,
        clock: Clock | None = None,
        on_event: OnEvent | None = None,
        reclaim: Callable[[], Awaitable[None]] | None = None,
        reserved_bytes: int = 0,
        one_load_at_a_time: bool = False,
        in_use: Callable[[], int] | None = None,
        swap_patience_s: float = 0.0,
    ) -> None:
        if budget_bytes is not None and (isinstance(budget_bytes, bool) or budget_bytes < 1):
            raise ValueError(f"budget_bytes must be >= 1 or None, got {budget_bytes!r}")
        if isinstance(reserved_bytes, bool) or reserved_bytes < 0:
            raise ValueError(f"reserved_bytes must be >= 0, got {reserved_bytes!r}")
        if keep_alive_s is not None and not keep_alive_s > 0:
            raise ValueError(f"keep_alive_s must be > 0 or None, got {keep_alive_s!r}")
        if not swap_patience_s >= 0:
            raise ValueError(f"swap_patience_s must be >= 0, got {swap_patience_s!r}")
        self._swap_patience_s = swap_patience_s
        self.budget_bytes = budget_bytes
        self._load = load
        self._unload = unload
        self._keep_alive_s = keep_alive_s
        self._clock: Clock = clock if clock is not None else LoopClock()
        self._on_event = on_event
        self._reclaim = reclaim
        self.reserved_bytes = int(reserved_bytes)
        self._one_load_at_a_time = one_load_at_a_time
        self._in_use = in_use
        self._entries: dict[str, _Entry[H]] = {}
        self._changed: list[asyncio.Future[None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_ticket = 0

    # -- models ---------------------------------------------------------------------------------

    def add(
        self,
        name: str,
        *,
        estimate_bytes: int,
        pinned: bool = False,
        keep_alive_s: float | None = -1.0,
        load_peak_bytes: int = 0,
        group: str | None = None,
        advice: str = "",
    ) -> None:
        """Register a model (not loaded yet). ``estimate_bytes``: its expected footprint (read
        off its files) until a load measures it; ``load_peak_bytes``: what its load is
        expected to need at its peak, until one is measured (0: the estimate).
        ``keep_alive_s``: this model's (``None``: none; left out: the manager's). ``group``:
        models loaded the same way (one source, one layout): what one's load measures
        becomes the estimate of those not measured yet. ``advice``: what else than a larger
        budget makes it fit (a generator's smaller KV budget), said where it never fits."""
        if name in self._entries:
            raise ValueError(f"model {name!r} is already registered")
        if isinstance(estimate_bytes, bool) or estimate_bytes < 0:
            raise ValueError(f"estimate_bytes must be >= 0, got {estimate_bytes!r}")
        keep = self._keep_alive_s if keep_alive_s == -1.0 else keep_alive_s
        if keep is not None and not keep > 0:
            raise ValueError(f"keep_alive_s must be > 0 or None, got {keep_alive_s!r}")
        self._entries[name] = _Entry(name, int(estimate_bytes), pinned, keep)
        self._entries[name].load_peak = int(load_peak_bytes)
        self._entries[name].declared = max(int(estimate_bytes), int(load_peak_bytes))
        self._entries[name].group = group
        self._entries[name].advice = advice

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    @property
    def accounted_bytes(self) -> int:
        """Bytes held against the budget: resident models, loads and unloads under way."""
        return sum(e.accounted for e in self._entries.values())

    def state(self, name: str) -> ResidentState:
        return self._entry(name).state

    def active(self, name: str) -> int:
        """Requests waiting for ``name`` or using it."""
        return self._entry(name).active

    def handle(self, name: str) -> H | None:
        """The loaded model (``None`` unless resident)."""
        e = self._entry(name)
        return e.handle if e.state is ResidentState.RESIDENT else None

    def stats(self) -> list[ResidentStats]:
        return [
            ResidentStats(
                name=e.name,
                state=e.state,
                footprint_bytes=e.estimate,
                measured=e.measured,
                load_peak_bytes=e.load_peak,
                accounted_bytes=e.accounted,
                pinned=e.pinned,
                active=e.active,
                loads=e.loads,
                load_failures=e.load_failures,
                evictions=e.evictions,
                load_seconds=e.load_seconds,
            )
            for e in self._entries.values()
        ]

    # -- using a model ----------------------------------------------------------------------------

    async def acquire(self, name: str, *, turn: bool = False) -> H:
        """The loaded model, held until ``release(name, turn=...)``: loads it (waiting for
        room) when it is not resident. Raises ``ModelLoadError`` (its load failed),
        ``MemoryBudgetError`` (it can never fit); cancelling gives up the claim.

        ``turn``: a short claim (a request) that takes turns: once another model waits for
        room, it waits behind that swap rather than keep this model loaded. A claim without it
        (a batch that holds the model for its whole run) is admitted at once, and while one
        holds the model no claim waits behind a swap (the swap waits for it anyway)."""
        e = self._entry(name)
        e.active += 1
        ticket = self._next_ticket
        self._next_ticket += 1
        e.waiting[ticket] = self._clock.now()
        self._cancel_timer(e)
        try:
            while True:
                if e.state is ResidentState.RESIDENT:
                    if turn and self._behind_a_swap(e, ticket):
                        e.held += 1
                        try:
                            await self._wait_change()
                        finally:
                            e.held -= 1
                        continue
                    del e.waiting[ticket]
                    if turn:
                        e.turns += 1
                    else:
                        e.lasting += 1
                    e.last_used = self._clock.now()
                    assert e.handle is not None
                    return e.handle
                if e.state is ResidentState.LOADING:
                    assert e.loading is not None
                    await asyncio.shield(e.loading)  # a failure raises ModelLoadError here
                    continue
                if e.state is ResidentState.UNLOADING:
                    assert e.unloading is not None
                    await asyncio.shield(e.unloading)
                    continue
                if self._try_start_load(e):
                    continue
                await self._wait_change()
        except BaseException:
            e.waiting.pop(ticket, None)
            self._drop_claim(e)
            self._notify()  # the queue's head may have left
            raise

    def release(self, name: str, *, turn: bool = False) -> None:
        """A claim is done with the model (``turn`` as it was acquired): idle when none holds
        it any more."""
        e = self._entry(name)
        if (e.turns if turn else e.lasting) <= 0:
            raise RuntimeError(f"release({name!r}) without an acquire (turn={turn})")
        if turn:
            e.turns -= 1
        else:
            e.lasting -= 1
        e.last_used = self._clock.now()
        self._drop_claim(e)

    async def preload(self, name: str) -> None:
        """Load ``name`` now (waiting for room), and leave it idle."""
        await self.acquire(name)
        self.release(name)

    async def close(self) -> None:
        """Unload every model (after the loads under way), whatever is using it."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for e in self._entries.values():
            self._cancel_timer(e)
            if e.state is ResidentState.RESIDENT:
                self._evict(e, "close")
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- the rules ------------------------------------------------------------------------------

    def _try_start_load(self, e: _Entry[H]) -> bool:
        """Start loading ``e`` if its estimate fits (evicting idle models as needed); False:
        wait for a change. Raises ``MemoryBudgetError`` when it can never fit."""
        need = max(e.estimate, e.load_peak)
        budget = self.budget_bytes
        if budget is not None:
            never = self.never_fits(e.name)
            if never is not None:
                raise MemoryBudgetError(never)
            room = budget - self.reserved_bytes
            # a load measured past the whole room (never_fits: its files fit) loads alone, once
            # everything idle is out: its excess is logged as over_budget, and shed after
            need = min(need, room)
            if self._one_load_at_a_time and any(
                o.state is ResidentState.LOADING for o in self._entries.values()
            ):
                return False  # the load under way is woken on when it ends, measured
            if self._ahead_of(e):
                return False  # loads start in the order they were asked for
            free = room - self._held()
            if free < need:
                self._make_room(need - free)
                return False
        e.state = ResidentState.LOADING
        e.accounted = need
        e.loading = asyncio.get_running_loop().create_future()
        self._spawn(self._run_load(e, e.loading))
        self._notify()  # the next in line may look now
        return True

    def never_fits(self, name: str) -> str | None:
        """Why ``name`` can never load under the budget (what its files say it needs, steady or
        at its load's peak, is more than the budget less the reserve and the pinned models),
        ``None`` when it can."""
        e = self._entry(name)
        budget = self.budget_bytes
        if budget is None:
            return None
        # What the files say, not what a load measured: a measurement may hold other work's
        # memory (a load beside 16 clients' long texts measured twice its files), and a model
        # that loaded once must not become one that never loads. A load that measured more
        # than the room loads alone (_try_start_load).
        need = e.declared
        pinned = sum(
            max(o.accounted, o.estimate) for o in self._entries.values() if o.pinned and o is not e
        )
        if need <= budget - self.reserved_bytes - pinned:
            return None
        return (
            f"model {e.name!r} needs {_size(need)}, more than the memory budget of {_size(budget)}"
            + (
                f" less {_size(self.reserved_bytes)} the server holds itself"
                if self.reserved_bytes
                else ""
            )
            + (f" less {_size(pinned)} held by pinned models" if pinned else "")
            + ("; raise --memory-budget, or unpin a model" if pinned else "; raise --memory-budget")
            + (f", or {e.advice}" if e.advice else "")
        )

    def _in_line(self) -> list[_Entry[H]]:
        """Models with requests waiting for a load to start (not resident, not loading)."""
        return [
            o
            for o in self._entries.values()
            if o.waiting and o.state in (ResidentState.UNLOADED, ResidentState.UNLOADING)
        ]

    def _ahead_of(self, e: _Entry[H]) -> bool:
        """Whether a model asked for before ``e`` still waits for its load (and a swap can
        make its room)."""
        first = next(iter(e.waiting), None)
        return first is not None and any(
            next(iter(o.waiting)) < first and self._swap_helps(o)
            for o in self._in_line()
            if o is not e
        )

    def _behind_a_swap(self, e: _Entry[H], ticket: int) -> bool:
        """Whether a request (``ticket``) for the resident ``e`` waits its turn: it asked after
        ``e`` was loaded and after a model that still waits for a load (evicting ``e`` may be
        what makes that one's room), and that one has waited ``swap_patience_s``. What asked
        before the load ended is ``e``'s work."""
        if self.budget_bytes is None or e.pinned or e.lasting or ticket < e.admit_below:
            return False
        now = self._clock.now()
        for o in self._in_line():
            first, asked = next(iter(o.waiting.items()))
            if first < ticket and now - asked >= self._swap_patience_s and self._swap_helps(o):
                return True
        return False

    def _swap_helps(self, o: _Entry[H]) -> bool:
        """Whether ``o`` fits beside what no swap frees (pinned models, lasting claims): if it
        does not, waiting behind it (a load in line, a request held back) only waits too."""
        if self.budget_bytes is None:
            return True
        others = [x for x in self._entries.values() if x is not o]
        stuck = sum(x.accounted for x in others if x.pinned or x.lasting)
        return max(o.estimate, o.load_peak) <= self.budget_bytes - self.reserved_bytes - stuck

    def _held(self) -> int:
        """The bytes the models hold: accounted, or measured when that is more (memory an
        unload kept); with none accounted, what is measured is not the models'."""
        held = self.accounted_bytes
        if self._in_use is not None and held > 0:
            held = max(held, self._in_use())
        return held

    def _make_room(self, short: int) -> None:
        """Evict idle models, least recently used first, to free ``short`` more bytes than the
        unloads under way will; none if even all idle models would not do while others stay."""
        short -= sum(
            o.accounted for o in self._entries.values() if o.state is ResidentState.UNLOADING
        )
        if short <= 0:
            return  # unloads under way will make the room
        idle = sorted(
            (o for o in self._entries.values() if self._evictable(o)), key=lambda o: o.last_used
        )
        idle_bytes = sum(o.accounted for o in idle)
        if idle_bytes < short and self.accounted_bytes - self._unloading_bytes() > idle_bytes:
            return  # evicting would not make room: wait for a model to go idle
        # (when the idle models are all that is accounted, evicting them all makes room: what
        # is measured beyond them then no longer counts, see _held)
        for o in idle:
            if short <= 0:
                break
            short -= o.accounted
            self._evict(o, "room")

    @staticmethod
    def _evictable(e: _Entry[H]) -> bool:
        return e.state is ResidentState.RESIDENT and e.active == e.held and not e.pinned

    async def _run_load(self, e: _Entry[H], done: asyncio.Future[None]) -> None:
        started = self._clock.now()
        try:
            loaded = await self._load(e.name)
        except Exception as exc:
            e.state = ResidentState.UNLOADED
            e.accounted = 0
            e.load_failures += 1
            e.load_seconds += self._clock.now() - started
            cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            error = ModelLoadError(
                f"model {e.name!r} failed to load ({cause}); the next request tries again"
            )
            error.__cause__ = exc
            done.set_exception(error)
            done.exception()  # retrieved: nobody may be waiting
            self._emit("load_failed", e.name, {"error": cause})
            self._notify()
            return
        seconds = self._clock.now() - started
        handle, measured = loaded[0], loaded[1]
        peak = loaded[2] if len(loaded) > 2 else None
        if peak is not None:
            e.load_peak = int(peak)
            for o in self._same_group(e):
                o.load_peak = max(o.load_peak, e.load_peak)
        e.handle = handle
        e.admit_below = self._next_ticket  # what waited for this load is its work
        e.state = ResidentState.RESIDENT
        e.loads += 1
        e.load_seconds += seconds
        e.last_used = self._clock.now()
        if measured is not None:
            e.estimate = int(measured)
            e.measured = True
            for o in self._same_group(e):
                o.estimate = max(o.estimate, e.estimate)
        e.accounted = e.estimate  # the load's peak reservation ends with it
        done.set_result(None)
        self._emit("load", e.name, {"seconds": seconds, "bytes": e.accounted})
        if e.active == e.held:
            self._arm_timer(e)
        if not self._shed():
            self._emit(
                "over_budget",
                e.name,
                {"bytes": self.accounted_bytes + self.reserved_bytes - (self.budget_bytes or 0)},
            )
        self._notify()

    def _same_group(self, e: _Entry[H]) -> list[_Entry[H]]:
        """The models loaded as ``e`` is, not measured yet."""
        if e.group is None:
            return []
        return [
            o
            for o in self._entries.values()
            if o.group == e.group and o is not e and not o.measured
        ]

    def _shed(self) -> bool:
        """Over the budget (a load measured more than its estimate): evict idle models to get
        back under it. False while it cannot (every other model busy or pinned)."""
        if self.budget_bytes is None:
            return True
        room = self.budget_bytes - self.reserved_bytes
        if self.accounted_bytes <= room:
            return True
        self._make_room(self.accounted_bytes - room)
        return self.accounted_bytes - self._unloading_bytes() <= room

    def _unloading_bytes(self) -> int:
        return sum(
            o.accounted for o in self._entries.values() if o.state is ResidentState.UNLOADING
        )

    def _evict(self, e: _Entry[H], reason: str) -> None:
        self._cancel_timer(e)
        e.state = ResidentState.UNLOADING
        e.unloading = asyncio.get_running_loop().create_future()
        self._emit("evict", e.name, {"reason": reason, "bytes": e.accounted})
        self._spawn(self._run_unload(e, e.unloading))

    async def _run_unload(self, e: _Entry[H], done: asyncio.Future[None]) -> None:
        handle, e.handle = e.handle, None
        try:
            if handle is not None:
                await self._unload(e.name, handle)
                del handle  # the residency's last reference: what reclaim frees includes it
                if self._reclaim is not None:
                    await self._reclaim()
        except Exception as exc:  # freed as far as we can tell: never stuck in UNLOADING
            self._emit("unload_failed", e.name, {"error": f"{type(exc).__name__}: {exc}"})
        finally:
            e.state = ResidentState.UNLOADED
            e.accounted = 0
            e.evictions += 1
            done.set_result(None)
            self._notify()

    def _drop_claim(self, e: _Entry[H]) -> None:
        e.active -= 1
        if e.active == e.held:
            if e.state is ResidentState.RESIDENT:
                self._arm_timer(e)
            self._shed()  # over the budget, waiting for a model to go idle: this one
            self._notify()  # an idle model is evictable now

    # -- keep-alive -------------------------------------------------------------------------------

    def _arm_timer(self, e: _Entry[H]) -> None:
        self._cancel_timer(e)
        if e.pinned or e.keep_alive_s is None:
            return
        e.timer = self._clock.call_at(e.last_used + e.keep_alive_s, lambda: self._expire(e))

    def _expire(self, e: _Entry[H]) -> None:
        e.timer = None
        if self._evictable(e):
            self._evict(e, "keep_alive")

    @staticmethod
    def _cancel_timer(e: _Entry[H]) -> None:
        if e.timer is not None:
            e.timer.cancel()
            e.timer = None

    # -- plumbing ---------------------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry[H]:
        e = self._entries.get(name)
        if e is None:
            raise KeyError(f"model {name!r} is not registered; models: {', '.join(self._entries)}")
        return e

    async def _wait_change(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._changed.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._changed:
                self._changed.remove(waiter)

    def _notify(self) -> None:
        waiters, self._changed = self._changed, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _emit(self, kind: str, name: str, details: Mapping[str, float | str]) -> None:
        if self._on_event is not None:
            self._on_event(kind, name, details)
