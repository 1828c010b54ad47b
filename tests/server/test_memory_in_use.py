"""The server's measure of a load's memory counts its child processes (a vLLM engine runs in
one): a child holding 200 MiB raises it by about that much."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from batchline.server.residency import memory_in_use

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

HOLD = 200 * 2**20


def test_memory_in_use_counts_child_processes() -> None:
    before = memory_in_use()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys, time; b = bytearray({HOLD}); b[::4096] = b'x' * len(b[::4096]); "
            "print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        grown = memory_in_use() - before
        while grown < HOLD * 0.9 and time.monotonic() < deadline:
            time.sleep(0.05)
            grown = memory_in_use() - before
        assert grown >= HOLD * 0.9
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    assert memory_in_use() - before < HOLD * 0.5  # gone with the child
