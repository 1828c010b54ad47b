"""``models.common.openmp``: the calling thread's idle OpenMP workers let go, another thread's
kept, and the runtime found among the process's mappings (never loaded)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchline.models.common.openmp import loaded_openmp

# One parallel region of two threads per ``work()`` (an add over more elements than ATen's
# grain), so that the thread that ran it keeps a pool of one worker; the OS threads are counted
# in /proc. A second thread makes a pool of its own and holds it, blocked, while the main thread
# lets its own go: only one worker may go.
_SCRIPT = """
import os, threading
import torch
torch.set_num_threads(2)
from batchline.models.common.openmp import release_thread_pool

def tasks():
    return len(os.listdir("/proc/self/task"))

def work():
    torch.ones(1_000_000).add_(1)

ready, leave = threading.Event(), threading.Event()
def other():
    work()
    ready.set()
    leave.wait()
    work()  # its pool still serves it

thread = threading.Thread(target=other)
thread.start()
ready.wait()
work()
before = tasks()
released = release_thread_pool()
after = tasks()
leave.set()
thread.join()
work()  # a new pool for the main thread
print(released, before - after)
"""


@pytest.mark.skipif(
    sys.platform != "linux" or (os.cpu_count() or 1) < 2, reason="Linux, two cores or more"
)
def test_only_the_calling_thread_s_workers_go() -> None:
    pytest.importorskip("torch")
    found = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__config__.parallel_info())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "ATen parallel backend: OpenMP" not in found:
        pytest.skip("torch without OpenMP")
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    if out[0] == "False":
        pytest.skip("this torch's OpenMP runtime is not libgomp")
    assert out == ["True", "1"]


def test_the_runtime_is_found_in_the_mappings(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f10-7f20 rw-p 00000000 00:00 0 \n"
        "7f20-7f30 r-xp 00000000 08:01 2 /opt/py/site-packages/torch/lib/libgomp.so.1\n"
        "7f30-7f40 r-xp 00000000 08:01 3 /usr/lib/libiomp5.so\n"
    )
    assert loaded_openmp(str(maps)) == "/opt/py/site-packages/torch/lib/libgomp.so.1"
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 3 /usr/lib/libomp.so.5\n")
    assert loaded_openmp(str(maps)) is None  # LLVM's runtime pauses every thread's: not used
    assert loaded_openmp(str(tmp_path / "absent")) is None
