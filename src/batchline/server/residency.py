"""On-demand models for the server: a :class:`batchline._residency.Residency` of served batch
models under ``memory_budget``.

With ``memory_budget`` set, the server starts without loading its batch models (except those
named in ``preload`` or ``pin``); a model loads on its first request, and requests that arrive
meanwhile wait for that load (at most ``request_timeout_s``: then 504). Loads run one at a
time, so each one's footprint can be measured: the growth of the process's resident memory
(``/proc/self/statm``) across the load, and the peak it reached during the load (``VmHWM``,
reset before it: what the model's next load reserves; an ONNX load peaks near twice its
weights, the parsed file beside the session's copy), or of torch's CUDA allocations for a model on
``cuda`` when torch is loaded; before the first load, the weights' size on disk is the
estimate. A failed load answers the requests waiting for it with 503 naming the cause, and the
next request tries again; a model that can never fit is a 503 saying so.

Generate models are managed alike (their generator starts at the load and drains at the
unload); a vLLM engine's memory is counted too, as it runs in a child process of the server.

What a request does (``routes``): ``await use_model(...)`` acquires the model (loading it as
needed) and leaves a release in the request's scope, which the gate calls when the response
is done, so a model is busy (never evicted) from a request's pick to its last byte.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

from batchline._residency import (
    MemoryBudgetError,
    ModelLoadError,
    Residency,
    ResidentState,
    parse_bytes,
)
from batchline.models.specs import ModelSpec
from batchline.server.errors import ApiError

__all__ = [
    "RELEASES",
    "build_residency",
    "estimate_bytes",
    "memory_in_use",
    "release_all",
    "return_memory",
    "total_memory",
    "use_served",
]

logger = logging.getLogger("batchline.server")

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
        torch: Any = sys.modules["torch"]
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


def _reset_peak() -> int | None:
    """Reset the process's peak RSS (``VmHWM``) to its RSS now and return that (``None``
    where Linux does not allow it)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return _peak()
    except (OSError, ValueError):
        return None


def _peak() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise ValueError("no VmHWM")


def estimate_bytes(spec: ModelSpec) -> int:
    """The first estimate of a model's footprint: its weights' size on disk (0 when unknown:
    the first load then measures it)."""
    path: Path | None = None
    if spec.kind == "builtin":
        try:
            if spec.source == "default":
                from batchline.models.onnx.minilm import weights_dir

                path = weights_dir() / "model.safetensors"
            elif spec.source == "smollm2":  # its fp32 folder, once converted (the GGUF is Q4)
                from batchline.models.generation.smollm2 import converted_folder

                path = converted_folder()
        except Exception:  # the weights package is missing: the load will say so
            return 0
    elif spec.kind in ("onnx", "hf"):
        path = spec.path
    if path is None or not path.exists():
        return 0
    if path.is_file():
        size = path.stat().st_size
        data = path.with_name(path.name + ".data")  # torch.onnx's external weights
        return size + (data.stat().st_size if data.is_file() else 0)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build_residency(
    settings: Any,
    specs: list[ModelSpec],
    load_served: Callable[[ModelSpec], Any],
    unload_served: Callable[[Any], Any],
    on_event: Callable[[str, str, dict[str, Any]], None],
) -> Residency[Any]:
    """A residency of ``specs`` under ``settings.memory_budget``: ``load_served``
    (async, spec → started served model) and ``unload_served`` (async) do the work."""
    budget = parse_bytes(settings.memory_budget, total=total_memory())
    device = str(getattr(settings.knobs, "device", "cpu") or "cpu")
    by_name = {s.name: s for s in specs}
    one_at_a_time = asyncio.Lock()

    async def load(name: str) -> tuple[Any, int | None, int | None]:
        async with one_at_a_time:  # so each load's memory growth is its own
            before = memory_in_use(device)
            peak_from = _reset_peak() if device == "cpu" else None
            started = time.perf_counter()
            served = await load_served(by_name[name])
            grown = memory_in_use(device) - before
            peak = _peak() - peak_from if peak_from is not None else None
            logger.info(
                "model %s loaded in %.1fs (%.0f MiB, peak %s MiB)",
                name,
                time.perf_counter() - started,
                grown / 2**20,
                f"{peak / 2**20:.0f}" if peak is not None else "?",
            )
            return served, grown if grown > 0 else None, peak if peak and peak > 0 else None

    async def unload(name: str, served: Any) -> None:
        logger.info("unloading model %s", name)
        await unload_served(served)

    async def reclaim() -> None:
        await asyncio.to_thread(return_memory)  # gc and malloc_trim off the event loop

    residency: Residency[Any] = Residency(
        budget_bytes=budget,
        load=load,
        unload=unload,
        keep_alive_s=settings.keep_alive_s,
        on_event=on_event,
        reclaim=reclaim,
    )
    for spec in specs:
        weights = estimate_bytes(spec)
        residency.add(
            spec.name,
            estimate_bytes=weights,
            # a first load reserves twice the weights: an ONNX load peaked at 2.0x (192 MiB
            # MLP: the parsed file beside the session's copy); later loads, their measured peak
            load_peak_bytes=2 * weights,
            pinned=spec.name in settings.pin,
            keep_alive_s=settings.model_keep_alive_s.get(spec.name, settings.keep_alive_s),
        )
    return residency


async def use_served(
    residency: Residency[Any],
    name: str,
    scope: MutableMapping[str, Any],
    timeout_s: float,
    *,
    max_waiting: int,
    retry_after_s: int = 1,
) -> Any:
    """The served model ``name``, loaded as needed and held until the request ends (its
    release is left in ``scope`` for the gate). 504 when it is not loaded within
    ``timeout_s``, 503 naming the cause when its load fails or it can never fit, 429 when
    ``max_waiting`` requests already wait for it to load (its queue's room, counted in
    requests while it has no queue)."""
    if (
        residency.state(name) is not ResidentState.RESIDENT
        and residency.active(name) >= max_waiting
    ):
        raise ApiError(
            429,
            f"model {name!r} is loading and {max_waiting} requests already wait for it; retry "
            "after the Retry-After delay",
            "rate_limit_exceeded",
            headers={"Retry-After": str(retry_after_s)},
        )
    try:
        async with asyncio.timeout(timeout_s):
            served = await residency.acquire(name)
    except TimeoutError:
        raise ApiError(
            504,
            f"model {name!r} was not loaded within request_timeout_s={timeout_s} (waiting for "
            "memory or for its load); retry later",
            "timeout",
        ) from None
    except (ModelLoadError, MemoryBudgetError) as exc:
        raise ApiError(503, str(exc), "service_unavailable") from None
    scope.setdefault(RELEASES, []).append(lambda: residency.release(name))
    return served


def release_all(scope: MutableMapping[str, Any]) -> None:
    """Give back every model a request acquired (the gate, when the response is done)."""
    for release in scope.pop(RELEASES, ()):
        release()
