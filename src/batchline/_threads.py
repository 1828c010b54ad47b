"""Worker-thread priority (Linux: the nice value is per thread)."""

from __future__ import annotations

import os
import threading

__all__ = ["lower_thread_priority"]

_thread_state = threading.local()


def lower_thread_priority(delta: int) -> None:
    """Raise the calling thread's nice value by ``delta``, once per thread (a second call
    does nothing). Elsewhere than Linux, or where it is not allowed, the thread keeps its
    priority."""
    if getattr(_thread_state, "niced", False):
        return
    _thread_state.niced = True
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + delta)
    except (AttributeError, OSError):
        pass
