"""The OpenMP worker threads a thread keeps after its parallel work, let go.

torch's CPU kernels (and batchline's own, built with ``-fopenmp``) run their parallel loops on
OpenMP teams. GNU OpenMP (the runtime torch's Linux wheels ship) gives each thread that starts
a parallel region a pool of workers of its own, and keeps that pool, idle, after the region
ends. Once the process holds more of these threads than it has CPUs, every worker stops
spinning between regions and sleeps on a futex instead (libgomp's "throttled" wait), and each
of a step's hundreds of small parallel products then pays a wake-up.

That is what a model loaded on one thread and stepped on another meets: the loading thread's
pool stays, the engine thread makes its own, and the process is over its CPUs. Measured on a
2-core AMX Xeon (2026-12-02), a SmolLM2-360M-shaped int4 batch-1 decode step took 25 ms on
the thread that loaded it and 35 ms on the generator's thread; with the loading thread's pool
let go first, 23 ms on the generator's thread. ``OMP_WAIT_POLICY=passive`` made both 36 ms;
``=active`` made the other thread's 45 ms (the idle pool's worker spun on a core).

:func:`release_thread_pool` lets the calling thread's pool go (``omp_pause_resource_all``,
OpenMP 5.0), through the libgomp the process has already loaded: it never loads one. libgomp
frees only the calling thread's pool (checked: another thread's team, busy at the time, kept
its worker), and a later parallel region on the calling thread makes a new one (a thread
start, microseconds). LLVM's libomp and Intel's libiomp5 are left alone: their hard pause
shuts down the whole runtime, other threads' teams too. Only the standard library at import."""

from __future__ import annotations

import ctypes
import logging
import os
import threading

__all__ = ["loaded_openmp", "release_thread_pool"]

logger = logging.getLogger(__name__)

#: The runtime whose pause is per thread (GNU's), by its shared object's name.
_RUNTIME = "libgomp"
_OMP_PAUSE_HARD = 2  # omp_pause_hard: the threads themselves go, not only their state

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_looked = False


def loaded_openmp(maps: str = "/proc/self/maps") -> str | None:
    """The path of the GNU OpenMP runtime this process has loaded (the first in ``maps``)."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").partition("/")[2]
                name = os.path.basename(path)
                if path and name.startswith(_RUNTIME) and ".so" in name:
                    return "/" + path
    except OSError:
        return None
    return None


def _runtime() -> ctypes.CDLL | None:
    global _library, _looked
    with _lock:
        if not _looked:
            _looked = True
            path = loaded_openmp()
            if path is not None:
                try:
                    # RTLD_NOLOAD: the copy already in the process, never a second runtime
                    lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                    lib.omp_pause_resource_all.restype = ctypes.c_int
                    _library = lib
                except (OSError, AttributeError) as exc:  # no such symbol: OpenMP < 5.0
                    logger.debug("OpenMP pools are kept: %s has no pause (%s)", path, exc)
        return _library


def release_thread_pool() -> bool:
    """Let the calling thread's idle OpenMP workers go; False where the process has no
    libgomp that can (none loaded, or one without ``omp_pause_resource_all``) or it refused.
    Call it outside any parallel region (from Python, always), once the thread's parallel
    work is done: the end of a model's load on a thread that will not step it."""
    lib = _runtime()
    if lib is None:
        return False
    return bool(lib.omp_pause_resource_all(_OMP_PAUSE_HARD) == 0)
