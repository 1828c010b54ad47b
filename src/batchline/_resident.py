"""One model's place in a :class:`batchline._residency.Residency`: the errors its acquire
raises, its state, its snapshot (:class:`ResidentStats`), and the record the residency keeps
of it (:class:`Entry`: its footprint, its claims and the requests waiting for it, by ticket).
Standard library only."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

from batchline._clock import TimerHandle
from batchline._errors import ModelError

__all__ = ["Entry", "MemoryBudgetError", "ModelLoadError", "ResidentState", "ResidentStats"]

H = TypeVar("H")


class ModelLoadError(ModelError):
    """Raised by ``Residency.acquire`` (to every request waiting for that load) when a model's
    load failed; the message names the cause. The model stays loadable."""


class MemoryBudgetError(ModelError):
    """Raised by ``Residency.acquire`` when a model can never fit: its footprint is more than
    the memory budget less what pinned models hold."""


class ResidentState(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    RESIDENT = "resident"
    UNLOADING = "unloading"


@dataclass(frozen=True, slots=True)
class ResidentStats:
    """One model's residency, a snapshot."""

    name: str
    state: ResidentState
    footprint_bytes: int
    """Its estimate, or what its last load measured."""
    measured: bool
    load_peak_bytes: int
    """The most one of its loads grew memory by, at its peak (0: not measured yet): a load
    needs room for this or the footprint, whichever is more."""
    accounted_bytes: int
    """What it holds against the budget now (0 when unloaded)."""
    pinned: bool
    active: int
    """Requests waiting for it or using it."""
    loads: int
    load_failures: int
    evictions: int
    load_seconds: float
    """Seconds spent loading it, in total."""


class Entry(Generic[H]):
    """One model's record in the residency (its manager's alone: read it only there)."""

    __slots__ = (
        "accounted",
        "active",
        "admit_below",
        "advice",
        "declared",
        "estimate",
        "evictions",
        "group",
        "handle",
        "held",
        "keep_alive_s",
        "last_used",
        "lasting",
        "load_failures",
        "load_peak",
        "load_seconds",
        "loading",
        "loads",
        "measured",
        "name",
        "pinned",
        "state",
        "timer",
        "turns",
        "unloading",
        "waiting",
    )

    def __init__(self, name: str, estimate: int, pinned: bool, keep_alive_s: float | None) -> None:
        self.name = name
        self.estimate = estimate
        self.load_peak = 0  # the most a load of it grew memory by, at its peak (0: unknown)
        #: what its files say it needs (steady, or at its load's peak): whether it can ever fit
        self.declared = estimate
        #: what else than a larger budget makes it fit, where its backend knows (said with it)
        self.advice = ""
        self.group: str | None = None
        self.measured = False
        self.pinned = pinned
        self.keep_alive_s = keep_alive_s
        self.state = ResidentState.UNLOADED
        self.accounted = 0
        self.handle: H | None = None
        self.active = 0
        self.held = 0  # of ``active``: requests held back while another model waits for room
        self.waiting: dict[int, float] = {}  # requests not admitted yet: ticket -> asked at
        self.admit_below = 0  # tickets asked before its last load ended: its batch of work
        self.lasting = 0  # admitted claims that do not take turns (see ``acquire``)
        self.turns = 0  # admitted claims that do
        self.last_used = 0.0
        self.loading: asyncio.Future[None] | None = None
        self.unloading: asyncio.Future[None] | None = None
        self.timer: TimerHandle | None = None
        self.loads = 0
        self.load_failures = 0
        self.evictions = 0
        self.load_seconds = 0.0
