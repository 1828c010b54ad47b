"""The server's one registry of models: a :class:`batchline._residency.Residency` of its served
models. Without ``memory_budget`` every model is pinned and loaded at start (a failed load
stops the start); the rest of this text is about the budget.

With ``memory_budget`` set, the server starts without loading its batch models (except those
named in ``preload`` or ``pin``); a model loads on its first request, and requests that arrive
meanwhile wait for that load (at most ``request_timeout_s``: then 504). A failed load answers
the requests waiting for it with 503 naming the cause, and the next request tries again. A
model that can never fit (its footprint, or its load's peak, is more than the budget less
what the server and the pinned models hold) is said at once: at start, an error when it is
pinned or preloaded, one warning line when it loads on demand; on request, a 507 naming the
sizes, which no retry changes (``drive`` stops on it instead of retrying). Under rotating
load a model's queued work is served before it is swapped out, and loads go in the order
they were asked for (:mod:`batchline._residency`), so a swap is paid once per batch of work.

The budget bounds the whole process (its resident memory with its children's: what the
machine loses to it), so a peak RSS within the budget is what it promises:

* **Reserved**: what the process holds before any model (measured when the residency is
  built) plus what the runtimes of its models will add once (``models.footprint``) is taken
  off the budget first; the models share the rest.
* **Estimated**: before its first load, a model's footprint and its load's peak are read off
  its files by its backend (:func:`batchline.models.footprint.estimate_footprint`).
* **Measured**: loads and unloads run one at a time, and a load is admitted only when no
  other is under way; each load's growth of the resident memory (``/proc/self/statm``, or
  torch's CUDA allocations for a model on ``cuda``) and the peak it reached (``VmHWM``, when
  the load set a new high: it is never reset, so it stays the process's lifetime peak) are
  its footprint and its next load's peak (the log line of each load gives both, grown and
  counted). Inference on the resident models goes on meanwhile, so a measure is kept within
  [the estimate, twice the estimate]: never below what the files say the model holds (memory
  another model's work freed meanwhile), never absurdly above it. Models with the same spec
  and layout share what one measured.
* **Checked**: a load must also fit beside the memory measured now, less the reserve (an
  unload that did not give its memory back still counts).

Generate models are managed alike (their generator starts at the load and drains at the
unload); a vLLM engine's memory is counted too, as it runs in a child process of the server.

What a request does: the registry's ``acquire`` (:mod:`batchline.server.registry`) takes the
model (loading it as needed, :func:`use_served`) and leaves a release in the request's scope,
which the gate gives back (``ModelRegistry.release``) when the response is done, so a model is
busy (never evicted) from a request's pick to its last byte.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from starlette.types import Scope

from batchline._errors import InputError
from batchline._residency import (
    MemoryBudgetError,
    ModelLoadError,
    Residency,
    ResidentState,
    parse_bytes,
)
from batchline.models.footprint import Footprint, estimate_footprint, runtime_bytes
from batchline.models.specs import ModelSpec
from batchline.server.errors import ApiError
from batchline.server.settings import ServerSettings

__all__ = [
    "RELEASES",
    "build_residency",
    "memory_in_use",
    "return_memory",
    "total_memory",
    "use_served",
]

logger = logging.getLogger("batchline.server")

H = TypeVar("H")  # what a load gives: a started served model

#: The request-scope key holding the releases a request owes (the gate calls them).
RELEASES = "batchline.releases"


def total_memory() -> int:
    """The machine's physical memory in bytes (for a fractional budget)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_in_use(device: str = "cpu") -> int:
    """The resident memory of this process and its child processes (CPU: a vLLM engine runs
    in a child), or torch's CUDA allocations (``cuda``, when torch is loaded): what a load's
    footprint is measured by."""
    if device.startswith("cuda") and "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            return int(torch.cuda.memory_allocated())
    own = _resident(os.getpid())
    if own is None:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak, Linux KiB
    return own + sum(_resident(pid) or 0 for pid in _descendants(os.getpid()))


def _resident(pid: int) -> int | None:
    """A process's resident bytes (``/proc/PID/statm``), ``None`` where it cannot be read."""
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (``/proc/PID/task/TID/children``; none where the kernel
    does not list children)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children", encoding="ascii") as f:
                    children = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            found.extend(children)
            pending.extend(children)
    return found


def return_memory() -> None:
    """Hand freed memory back to the OS after an unload: collect the model's cycles, then
    ``malloc_trim`` (glibc). Measured with the default embedder: its 365 MiB of RSS stayed after
    ``close()``; dropping the last reference freed 160 MiB, and ``malloc_trim(0)`` another
    170 MiB (37 MiB left)."""
    import gc

    gc.collect()
    if sys.platform.startswith("linux"):
        import contextlib
        import ctypes

        with contextlib.suppress(OSError, AttributeError):  # not glibc (musl): nothing to trim
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def _high_water() -> int | None:
    """The process's peak resident memory so far (``VmHWM``; ``None`` where it cannot be
    read). Never reset: it stays the lifetime peak an operator compares with the budget."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def build_residency(
    settings: ServerSettings,
    specs: list[ModelSpec],
    load_served: Callable[[ModelSpec], Awaitable[H]],
    unload_served: Callable[[H], Awaitable[None]],
    on_event: Callable[[str, str, Mapping[str, float | str]], None] | None,
    tasks: dict[str, str] | None = None,
) -> Residency[H]:
    """A residency of ``specs`` under ``settings.memory_budget``: ``load_served``
    (async, spec → started served model) and ``unload_served`` (async) do the work. Without a
    budget every model is pinned and nothing is measured: the server loads them all at start."""
    by_name = {s.name: s for s in specs}
    if settings.memory_budget is None:
        return _all_resident(by_name, load_served, unload_served)
    budget = parse_bytes(settings.memory_budget, total=total_memory())
    device = str(getattr(settings.knobs, "device", "cpu") or "cpu")
    knobs = settings.knobs if settings.knobs.batching else settings.baseline_knobs
    estimates: dict[str, Footprint] = {
        s.name: estimate_footprint(s, knobs, (tasks or {}).get(s.name)) for s in specs
    }
    on_cpu = device == "cpu"
    # the process without models, and the runtimes its models will import (never unloaded)
    own = memory_in_use(device) if on_cpu else 0
    reserved = own + (runtime_bytes(f.runtime for f in estimates.values()) if on_cpu else 0)
    if reserved >= budget:
        logger.warning(
            "the memory budget of %.0f MiB is all taken by the server itself (%.0f MiB with its "
            "models' runtimes): no model will load; raise --memory-budget",
            budget / 2**20,
            reserved / 2**20,
        )
    one_at_a_time = asyncio.Lock()  # loads and unloads: each load's growth is its own

    async def load(name: str) -> tuple[H, int | None, int | None]:
        expected = estimates[name]
        async with one_at_a_time:
            runtime = runtime_bytes([expected.runtime]) if on_cpu else 0  # imported by this load
            before = memory_in_use(device) + runtime  # the runtime is in the reserve
            high_before = _high_water() if on_cpu else None
            started = time.perf_counter()
            served = await load_served(by_name[name])
            grown = memory_in_use(device) - before
            high = _high_water() if high_before is not None else None
            # the load's peak shows only where it set a new high for the process
            peak = (
                high - before
                if high is not None and high_before is not None and high > high_before
                else None
            )
        steady = _attribute(grown, expected.steady_bytes)
        reserve = _attribute(peak, expected.peak_bytes) if peak is not None else None
        logger.info(
            "model %s loaded in %.1fs (grew %.0f MiB, peak %s MiB; counted %s MiB, peak %s MiB)",
            name,
            time.perf_counter() - started,
            grown / 2**20,
            f"{peak / 2**20:.0f}" if peak is not None else "?",
            f"{steady / 2**20:.0f}" if steady is not None else "?",
            f"{reserve / 2**20:.0f}" if reserve is not None else "?",
        )
        return served, steady, reserve

    async def unload(name: str, served: H) -> None:
        logger.info("unloading model %s", name)
        async with one_at_a_time:
            await unload_served(served)

    async def reclaim() -> None:
        async with one_at_a_time:
            await asyncio.to_thread(return_memory)  # gc and malloc_trim off the event loop

    def in_use() -> int:
        return max(0, memory_in_use(device) - reserved)

    residency: Residency[H] = Residency(
        budget_bytes=budget,
        load=load,
        unload=unload,
        keep_alive_s=settings.keep_alive_s,
        on_event=on_event,
        reclaim=reclaim,
        reserved_bytes=min(reserved, budget - 1),
        one_load_at_a_time=True,
        in_use=in_use if on_cpu else None,
        # a third of a request's time: past it, the loaded model takes no new requests and is
        # swapped once its work is done, so the waiting request keeps time for its own load
        swap_patience_s=settings.request_timeout_s / 3,
    )
    for spec in specs:
        expected = estimates[spec.name]
        residency.add(
            spec.name,
            estimate_bytes=expected.steady_bytes,
            load_peak_bytes=expected.peak_bytes,
            pinned=spec.name in settings.pin,
            keep_alive_s=settings.model_keep_alive_s.get(spec.name, settings.keep_alive_s),
            group=f"{spec.kind}:{spec.source}:{spec.task}" if expected.steady_bytes else None,
            advice=expected.advice,
        )
    for spec in specs:
        never = residency.never_fits(spec.name)
        if never is None:
            continue
        if spec.name in settings.pin or spec.name in settings.preload:
            raise InputError(never)  # loaded at start: the start fails with one line
        logger.warning("%s (until then, its requests get 507)", never)
    return residency


def _all_resident(
    by_name: Mapping[str, ModelSpec],
    load_served: Callable[[ModelSpec], Awaitable[H]],
    unload_served: Callable[[H], Awaitable[None]],
) -> Residency[H]:
    async def load(name: str) -> tuple[H, None]:
        return await load_served(by_name[name]), None

    async def unload(name: str, served: H) -> None:
        try:
            await unload_served(served)
        except Exception:
            logger.exception("stopping model %s failed", name)

    residency: Residency[H] = Residency(budget_bytes=None, load=load, unload=unload)
    for name in by_name:
        residency.add(name, estimate_bytes=0, pinned=True, keep_alive_s=None)
    return residency


def _attribute(grown: int, expected: int) -> int | None:
    """What a load's measured growth says the model holds: at least the files' estimate (a
    smaller growth overlapped memory freed by other work) and at most twice it (a larger one
    counted other work's allocations); with no estimate, the growth. ``None`` (nothing
    learned) when memory did not grow."""
    if grown <= 0:
        return None
    if expected <= 0:
        return grown
    return min(max(grown, expected), 2 * expected)


async def use_served(
    residency: Residency[H],
    name: str,
    scope: Scope,
    timeout_s: float,
    *,
    max_waiting: int,
    retry_after_s: int = 1,
) -> H:
    """The served model ``name``, loaded as needed and held until the request ends (its
    release is left in ``scope`` for the gate). 504 when it is not loaded within
    ``timeout_s``, 503 naming the cause when its load fails, 507 when it can never fit (a
    retry cannot help: the budget or the pins must change), 429 when
    ``max_waiting`` requests already wait for it to load (its queue's room, counted in
    requests while it has no queue)."""
    resident = residency.state(name) is ResidentState.RESIDENT
    if not resident and residency.active(name) >= max_waiting:
        raise ApiError(
            429,
            f"model {name!r} is loading and {max_waiting} requests already wait for it; retry "
            "after the Retry-After delay",
            "rate_limit_exceeded",
            headers={"Retry-After": str(retry_after_s)},
        )
    try:
        async with asyncio.timeout(None if resident else timeout_s):  # resident: no timer
            served = await residency.acquire(name, turn=True)  # a request takes turns
    except TimeoutError:
        raise ApiError(
            504,
            f"model {name!r} was not loaded within request_timeout_s={timeout_s} (waiting for "
            "memory or for its load); retry later",
            "timeout",
        ) from None
    except MemoryBudgetError as exc:
        raise ApiError(507, str(exc), "insufficient_memory") from None
    except ModelLoadError as exc:
        raise ApiError(503, str(exc), "service_unavailable") from None
    scope.setdefault(RELEASES, []).append(lambda: residency.release(name, turn=True))
    return served
